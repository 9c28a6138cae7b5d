"""Redis connections for the services, from one URL: a plain `redis://` (or `rediss://`, `unix://`) URL, or a
Sentinel URL that follows the master through failovers, waiting one out:

    redis+sentinel://[[user]:password@]host1:port1[,host2:port2...]/<master-name>[/<db>][?sentinel_password=...]

The password (and user) is the one the master and its replicas require; the sentinels are asked without one unless
`sentinel_password` is given. A host without a port means Sentinel's own default, 26379. Each new connection asks a
sentinel where the master is now, so a client keeps working once the sentinels have promoted a replica: a command
that finds the master dead is tried again on a new connection until a new master answers (`FAILOVER_RETRIES`), and
fails with a ConnectionError (the limits store reads that as "unavailable", a 503) only if none does in time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

SCHEME = "redis+sentinel"
SENTINEL_PORT = 26379
# A sentinel that does not answer should not hold a connection attempt for the OS's two minutes: the next one is
# asked instead. Data connections get a connect timeout too (a dead master's host may drop packets, not refuse).
SENTINEL_TIMEOUT_S = 1.0
CONNECT_TIMEOUT_S = 2.0
# A command that finds the master gone is tried again, each time on a new connection that asks the sentinels where
# the master is now, for about as long as a failover takes (Sentinel's down-after plus an election: seconds). A
# request in flight then waits out the failover instead of failing. A script the dead master ran without
# answering may run twice: a rate-limit count or a reservation taken twice, never money booked twice (booking is
# idempotent by pod id).
FAILOVER_RETRIES = 20  # about 15 s of waits: Sentinel's down-after (2 s on a head) and an election, with room
FAILOVER_BACKOFF_S = {"base": 0.1, "cap": 1.0}  # jittered exponential


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def mask(url: str) -> str:
    """`url` with its password (if any) replaced by `***`, for log lines and error messages. Unlike
    `urllib.parse.urlsplit`, this takes several comma-separated hosts."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    before_query, q, query = rest.partition("?")
    userinfo, at, hosts = before_query.rpartition("@")
    if at:
        user, colon, _ = userinfo.partition(":")
        before_query = f"{user}{':***' if colon else ''}@{hosts}"
    if q:
        query = "&".join(
            f"{k}=***" if "password" in k.lower() else f"{k}={v}" if eq else k
            for k, eq, v in (part.partition("=") for part in query.split("&"))
        )
    return f"{scheme}://{before_query}{q}{query}"


def is_sentinel(url: str) -> bool:
    """Whether `url` names a Sentinel-monitored master (`redis+sentinel://`)."""
    return url.lower().startswith(SCHEME + "://")


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:26379
        host, close, tail = text[1:].partition("]")
        if not close or (tail and not tail.startswith(":")):
            raise ValueError(f"bad sentinel address {text!r} in {mask(url)}")
        port_text = tail[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ValueError(f"empty sentinel host in {mask(url)}")
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad sentinel port {port_text!r} in {mask(url)}")
    return host, int(port_text)


def parse_sentinel_url(url: str) -> SentinelUrl:
    """Parse `redis+sentinel://[[user]:password@]host:port[,host:port...]/<master>[/<db>][?sentinel_password=...]`;
    ValueError (the password masked) when it is not one."""
    if not is_sentinel(url):
        raise ValueError(f"not a {SCHEME}:// URL: {mask(url)}")
    rest = url[len(SCHEME) + 3 :]
    rest, _, query = rest.partition("?")
    userinfo, at, rest = rest.rpartition("@")  # the last @: a password may hold one unencoded
    hosts, slash, path = rest.partition("/")
    if not hosts:
        raise ValueError(f"no sentinel address in {mask(url)}")
    sentinels = tuple(_host_port(h.strip(), url) for h in hosts.split(","))
    parts = [unquote(p) for p in path.split("/")] if slash else []
    if parts and parts[-1] == "":
        parts.pop()  # a trailing slash
    if not parts or not parts[0]:
        raise ValueError(f"no master name in {mask(url)} (expected {SCHEME}://host:port/<master-name>[/<db>])")
    if len(parts) > 2:
        raise ValueError(f"too many path parts in {mask(url)} (expected /<master-name>[/<db>])")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError(f"bad database number {parts[1]!r} in {mask(url)}")
        db = int(parts[1])
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    options = parse_qs(query, keep_blank_values=True) if query else {}
    unknown = sorted(set(options) - {"sentinel_password"})
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)} in {mask(url)} (known: sentinel_password)")
    sentinel_password = options["sentinel_password"][-1] if "sentinel_password" in options else None
    return SentinelUrl(sentinels, parts[0], db, username, password, sentinel_password or None)


@functools.cache
def _sentinel_pool_classes() -> tuple[type, type]:
    from redis.asyncio import BlockingConnectionPool
    from redis.asyncio.sentinel import SentinelConnectionPool

    class Pool(SentinelConnectionPool):
        """Closes the sentinel clients it asks with its own connections (else their sockets stay open)."""

        async def aclose(self) -> None:
            try:
                await super().aclose()
            finally:
                await self.sentinel_manager.aclose()

    class BlockingPool(Pool, BlockingConnectionPool):
        """A Sentinel pool that waits for a free connection instead of opening one more (max_connections)."""

    return Pool, BlockingPool


def connection_pool(url: str, *, blocking: bool = False, **pool_opts: Any) -> Any:
    """A `redis.asyncio` connection pool for `url` (plain or `redis+sentinel://`). `blocking=True` makes it wait for
    a free connection (`max_connections`, `timeout`) instead of opening one more, as `BlockingConnectionPool`
    does; `pool_opts` go to the pool and its connections, as `ConnectionPool.from_url`'s keyword arguments do."""
    from redis.asyncio import BlockingConnectionPool, ConnectionPool

    if not is_sentinel(url):
        return (BlockingConnectionPool if blocking else ConnectionPool).from_url(url, **pool_opts)
    from redis.asyncio.sentinel import Sentinel

    parsed = parse_sentinel_url(url)
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
    }
    if parsed.sentinel_password:
        sentinel_kwargs["password"] = parsed.sentinel_password
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialWithJitterBackoff

    conn: dict[str, Any] = {
        "db": parsed.db,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "retry": Retry(ExponentialWithJitterBackoff(**FAILOVER_BACKOFF_S), FAILOVER_RETRIES),
    }
    if parsed.username:
        conn["username"] = parsed.username
    if parsed.password is not None:
        conn["password"] = parsed.password
    conn.update(pool_opts)
    manager = Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs)
    pool_class, blocking_class = _sentinel_pool_classes()
    return (blocking_class if blocking else pool_class)(parsed.master, manager, is_master=True, **conn)


def connect(url: str, *, blocking: bool = False, **pool_opts: Any) -> Any:
    """A `redis.asyncio.Redis` for `url`: a plain Redis URL, or a `redis+sentinel://` URL whose client follows the
    master through failovers (the client redis-py's `Sentinel.master_for` builds). Closing the client closes its
    pool (and the sentinel connections). Options as for `connection_pool`."""
    from redis.asyncio import Redis

    return Redis.from_pool(connection_pool(url, blocking=blocking, **pool_opts))
