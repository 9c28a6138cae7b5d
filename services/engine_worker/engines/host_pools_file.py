"""The worker's host pools file, `<data_dir>/host_pools.toml`: the hosts a `host` model's `pool` may start, and the
commands that start and stop them. Only the operator of the machine writes it: the commands are never a model param
(a model's params travel over the bus and are set through the admin API), and a file others may write is refused.

```toml
[pools.gpu-boxes]
down_s = 30                          # a host that failed is tried last for this long
[[pools.gpu-boxes.hosts]]
url = "http://10.0.0.5:8080"         # its OpenAI-compatible root (the paths sent start with /v1)
start_cmd = ["/usr/bin/ssh", "gpu1", "systemctl", "--user", "start", "llama"]
stop_cmd = ["/usr/bin/ssh", "gpu1", "systemctl", "--user", "stop", "llama"]
health_path = "/health"              # default /v1/models: up once it answers under 500
start_timeout_s = 300                # from its start_cmd to a healthy answer
idle_stop_s = 600                    # stop_cmd after this long without a request (0: never)
cmd_timeout_s = 60                   # a command still running then is killed
```

The file is read strictly: an unknown key, a command given as one string (there is no shell), a program named by a
relative path (it would depend on the worker's working dir), a URL that is not plain http(s) (a user or password in
it, a query) are each refused naming where they are.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import msgspec

POOLS_FILE = "host_pools.toml"
POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
HEALTH_PATH = re.compile(r"^/[A-Za-z0-9._~/-]{0,255}$")
MAX_FILE = 1 << 20

Arg = Annotated[str, msgspec.Meta(max_length=4096)]
Argv = Annotated[tuple[Arg, ...], msgspec.Meta(min_length=1, max_length=256)]


class PoolsError(ValueError):
    """The pools file cannot be used: missing, unreadable, writable by others, or not a well-formed declaration."""


class HostDecl(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One host of a pool, as the operator declared it."""

    url: Annotated[str, msgspec.Meta(max_length=2048)]
    start_cmd: Argv | None = None  # none: the host is up or not by itself, never started from here
    stop_cmd: Argv | None = None  # none: never stopped from here
    health_path: str = "/v1/models"
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 300.0
    idle_stop_s: Annotated[float, msgspec.Meta(ge=0, le=30 * 86_400)] = 600.0
    cmd_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0


class PoolDecl(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A pool: its hosts, in the order they are started."""

    hosts: Annotated[tuple[HostDecl, ...], msgspec.Meta(min_length=1, max_length=64)]
    down_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0


class PoolsFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pools: dict[str, PoolDecl] = {}


def pools_path(data_dir: str) -> Path:
    return Path(os.path.expanduser(data_dir)) / POOLS_FILE


def read_pools(path: Path) -> dict[str, PoolDecl]:
    """Every pool of the file at `path`, checked; PoolsError saying what and where otherwise."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise PoolsError(f"{path} is not a file")
        if st.st_mode & stat.S_IWOTH:
            raise PoolsError(f"{path} is writable by every user: its commands run as this worker (chmod o-w)")
        if st.st_size > MAX_FILE:
            raise PoolsError(f"{path} is over {MAX_FILE} bytes")
        text = path.read_text()
    except FileNotFoundError:
        raise PoolsError(f"no host pools file at {path}: a host model's pool is declared there") from None
    except OSError as exc:
        raise PoolsError(f"{path} cannot be read ({exc.strerror})") from None
    return parse_pools(text, str(path))


def parse_pools(text: str, where: str = POOLS_FILE) -> dict[str, PoolDecl]:
    """The pools of a pools file's text, checked (`where` names it in errors)."""
    try:
        doc = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PoolsError(f"{where} is not valid TOML: {exc}") from None
    try:
        parsed = msgspec.convert(doc, PoolsFile)
    except msgspec.ValidationError as exc:
        hint = ""
        if "got `str`" in str(exc) and "_cmd" in str(exc):
            hint = ' (a command is a list of its program and arguments, run without a shell: ["prog", "arg"])'
        raise PoolsError(f"{where}: {exc}{hint}") from None
    for name, pool in parsed.pools.items():
        if not POOL_NAME.match(name):
            raise PoolsError(f"{where}: pool name {name[:80]!r} is not a plain name (letters, digits, . _ -)")
        seen: set[str] = set()
        for i, host in enumerate(pool.hosts):
            at = f"{where}: pools.{name}.hosts[{i}]"
            _check_url(host.url, at)
            if host.url.rstrip("/") in seen:
                raise PoolsError(f"{at}.url: {host.url!r} is already a host of this pool")
            seen.add(host.url.rstrip("/"))
            if not HEALTH_PATH.match(host.health_path) or "/../" in host.health_path + "/":
                raise PoolsError(f"{at}.health_path: {host.health_path[:80]!r} is not a plain path starting with /")
            for key, argv in (("start_cmd", host.start_cmd), ("stop_cmd", host.stop_cmd)):
                if argv is not None:
                    _check_argv(argv, f"{at}.{key}")
    return dict(parsed.pools)


def _check_url(url: str, at: str) -> None:
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        raise PoolsError(f"{at}.url: {url[:80]!r} is not a URL") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise PoolsError(f"{at}.url: {url[:80]!r} is not an http(s) URL with a host")
    if u.username is not None or u.password is not None:
        raise PoolsError(f"{at}.url: no user or password in a URL (a key goes in a secret: api_key_secret)")
    if u.query or u.fragment or port == 0:
        raise PoolsError(f"{at}.url: {url[:80]!r} has a query, a fragment or port 0")


def _check_argv(argv: tuple[str, ...], at: str) -> None:
    prog = argv[0]
    if any("\0" in a for a in argv):
        raise PoolsError(f"{at}: an argument holds a NUL byte")
    if not prog or prog != prog.strip() or any(c.isspace() for c in prog):
        raise PoolsError(
            f"{at}: the program {prog[:80]!r} holds spaces: a command is a list of its program and arguments, "
            'run without a shell (["prog", "arg"])'
        )
    if "/" in prog and not os.path.isabs(prog):
        raise PoolsError(
            f"{at}: the program {prog[:80]!r} is a relative path (it would depend on the worker's working dir): "
            "name it by its absolute path, or by a bare name looked up on PATH"
        )
