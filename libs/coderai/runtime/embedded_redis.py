"""Embedded `redis-server` (from Debian's package) for one box and for tests: a server, optionally durable or a
replica, and a Sentinel watching a master. Readiness is read from the server itself, never guessed with a sleep."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from coderai.runtime.embedded import EmbeddedServerError, _find, _Server, die_with_parent, free_port, open_log

if TYPE_CHECKING:
    import redis


class RedisServer(_Server):
    """A private `redis-server` on loopback. `durable=True` (what `coderai up` runs) keeps an append-only file
    in `data_dir`, fsynced every second, so keys, budgets and spend survive a restart or a crash of the process;
    without it (tests, benchmarks) nothing is written to disk. `replicaof` ("host:port") starts it as a replica of
    that master (with `password` also the master's: a replica may be promoted, and a master demoted, by Sentinel)."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        port: int | None = None,
        host: str = "127.0.0.1",
        durable: bool = False,
        password: str = "",
        replicaof: str = "",
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.host = host
        self.durable = durable
        self.password = password  # required of every client (`requirepass`, from a 0600 config file: not in argv)
        self.replicaof = replicaof
        self.binary = _find("redis-server", "install Debian's package: apt-get install redis-server")

    def start(self, timeout_s: float = 15.0, log_file: str | os.PathLike | None = None) -> "RedisServer":
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # its append-only file holds key names and hashes, usage and budgets
        self.port = self.port or free_port(self.host)
        persistence = ["--appendonly", "yes", "--appendfsync", "everysec"] if self.durable else ["--appendonly", "no"]
        cmd = [self.binary]
        if self.password:
            conf = self.data_dir / "redis.conf"
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f'requirepass "{self.password}"\n')
                fh.write(f'masterauth "{self.password}"\n')  # as a replica, now or after a failover
            cmd.append(str(conf))
        # a replica gets its first copy at once (a master waits 5 s by default, for more replicas to share one)
        cmd += [
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            *persistence,
            "--repl-diskless-sync-delay",
            "0",
            "--dir",
            str(self.data_dir),
            "--protected-mode",
            "yes",
        ]
        if self.replicaof:
            master_host, _, master_port = self.replicaof.rpartition(":")
            cmd += ["--replicaof", master_host, master_port]
        out = open_log(log_file)
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent()
        )
        if not isinstance(out, int):  # not DEVNULL: the child has its own copy
            out.close()
        self.url = f"redis://{self.host}:{self.port}/0"
        _await_pong(self, "redis-server", timeout_s)
        return self

    def wait_synced(self, timeout_s: float = 60.0, check_s: float = 2.0) -> None:
        """As a replica: return once it holds the master's data and follows it (`master_link_status:up`).
        EmbeddedServerError once `timeout_s` passes, or as soon as the server it was named is no master to copy
        (itself a replica, or not answering, for `check_s` on end): a stale name the sentinels gave during a
        failover, which they correct by pointing this replica at the new master; waiting would only delay it."""
        import redis

        if self.port is None:
            raise EmbeddedServerError("redis-server is not started")
        deadline = time.monotonic() + timeout_s
        host, _, port = self.replicaof.rpartition(":")
        not_master_since: float | None = None
        next_check = time.monotonic() + check_s
        with redis.Redis(
            host=self.host, port=self.port, password=self.password or None, socket_timeout=2, decode_responses=True
        ) as r:
            while r.info("replication").get("master_link_status") != "up":
                now = time.monotonic()
                if now > deadline:
                    raise EmbeddedServerError(
                        f"redis-server did not copy its master {self.replicaof} within {timeout_s}s"
                    )
                if host and now >= next_check:
                    next_check = now + 0.5
                    if _is_master(host, int(port), self.password):
                        not_master_since = None
                    elif not_master_since is None:
                        not_master_since = now
                    elif now - not_master_since >= check_s:
                        raise EmbeddedServerError(
                            f"redis-server's master {self.replicaof} is no master (a replica, or not answering)"
                        )
                time.sleep(0.05)


def _is_master(host: str, port: int, password: str) -> bool:
    """Whether the redis-server at host:port answers as a master."""
    import redis

    try:
        with redis.Redis(
            host=host,
            port=port,
            password=password or None,
            socket_timeout=1,
            socket_connect_timeout=1,
            decode_responses=True,
        ) as m:
            return m.info("replication").get("role") == "master"
    except redis.RedisError:
        return False


def _await_pong(server: "_Server", what: str, timeout_s: float) -> None:
    """Poll `server` (a started redis-server or sentinel) until it answers PING (a NOAUTH asking for the password
    counts: it is up); stopped and EmbeddedServerError if it exits or does not answer within `timeout_s`."""
    proc, port = server.proc, server.port
    if proc is None or port is None:
        raise EmbeddedServerError(f"{what} is not started")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EmbeddedServerError(f"{what} exited with {proc.returncode} (port {port} taken?)")
        try:
            with socket.create_connection((server.host, port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                answer = s.recv(64)
                if answer.startswith(b"+PONG") or b"NOAUTH" in answer:
                    return
        except OSError:
            pass
        time.sleep(0.02)
    server.stop()
    raise EmbeddedServerError(f"{what} did not answer PING within {timeout_s}s")


class RedisSentinel(_Server):
    """A private `redis-server --sentinel` on loopback watching one master (`master`, "host:port") under `name`:
    with `quorum` 1 one sentinel alone may declare it down (after `down_after_ms` without an answer) and promote
    one of its replicas. `password` is the master's (and its replicas'), for the sentinel to log in to them; the
    sentinel itself asks none. Sentinel rewrites its own config file (in `data_dir`, 0600) as it learns the
    replicas and the current master. `url` is the Sentinel URL a client connects with (runtime/redis_client)."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        master: str,
        name: str = "coderai",
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str = "",
        quorum: int = 1,
        down_after_ms: int = 300,
        failover_timeout_ms: int = 2000,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.master = master
        self.name = name
        self.port = port
        self.host = host
        self.password = password
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.binary = _find("redis-server", "install Debian's package: apt-get install redis-server")

    def start(self, timeout_s: float = 15.0, log_file: str | os.PathLike | None = None) -> "RedisSentinel":
        """Write its config and start it; returns once it answers PING (it knows the master from its config)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port(self.host)
        master_host, _, master_port = self.master.rpartition(":")
        lines = [
            f"port {self.port}",
            f"bind {self.host}",
            f"dir {json.dumps(str(self.data_dir))}",
            f"sentinel monitor {self.name} {master_host} {master_port} {self.quorum}",
            f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}",
            f"sentinel failover-timeout {self.name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {self.name} 1",
            f"sentinel myid {self._myid()}",
        ]
        if self.password:
            lines.append(f'sentinel auth-pass {self.name} "{self.password}"')
        conf = self.data_dir / "sentinel.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold the master's password
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        out = open_log(log_file)
        self.proc = subprocess.Popen(
            [self.binary, str(conf), "--sentinel"],
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
        if not isinstance(out, int):  # not DEVNULL: the child has its own copy
            out.close()
        self.url = f"redis+sentinel://{self.host}:{self.port}/{self.name}"
        _await_pong(self, "redis sentinel", timeout_s)
        return self

    def _myid(self) -> str:
        """This sentinel's id, made once and kept in its data dir. Sentinels never forget a sentinel they have seen:
        one started again under a new id is one more voter that never answers, until the survivors of a dead head
        are no majority of the sentinels they know and a Redis failover waits (over 15 s after a few restarts in
        tests/ha/test_failover_clients)."""
        path = self.data_dir / "myid"
        try:
            myid = path.read_text().strip()
        except FileNotFoundError:
            myid = ""
        if len(myid) != 40:
            myid = secrets.token_hex(20)
            path.write_text(myid + "\n")
        return myid

    def _client(self) -> "redis.Redis":
        import redis

        if self.port is None:
            raise EmbeddedServerError("redis sentinel is not started")
        return redis.Redis(host=self.host, port=self.port, socket_timeout=2, decode_responses=True)

    def master_address(self) -> str | None:
        """Where the sentinel says the master is now ("host:port"), or None when it knows none."""
        with self._client() as r:
            addr = r.sentinel_get_master_addr_by_name(self.name, return_responses=True)
        # (host, port), or None: the bool of redis-py's annotation is for a Sentinel pool's command, not one client's
        return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else None

    def wait_replicas(self, count: int, timeout_s: float = 15.0) -> None:
        """Wait until the sentinel has found `count` replicas of the master that are up (it asks the master for
        them every 10 s, and at once when it starts: start it after the replicas have connected)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._client() as r:
                replicas = r.sentinel_slaves(self.name)
            up = [x for x in replicas if not (x.get("is_sdown") or x.get("is_odown") or x.get("is_disconnected"))]
            if len(up) >= count:
                return
            if time.monotonic() > deadline:
                raise EmbeddedServerError(f"sentinel found {len(up)} of {count} replicas within {timeout_s}s")
            time.sleep(0.05)
