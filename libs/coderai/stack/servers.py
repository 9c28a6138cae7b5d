"""The servers `coderai up` runs itself, beside its supervised services: nats-server, redis-server and, on a head,
a Redis Sentinel; `keep_up` starts one again when it dies."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from coderai.runtime import members
from coderai.runtime.cluster import with_user
from coderai.runtime.embedded import EmbeddedServerError, NatsServer
from coderai.runtime.embedded_redis import RedisSentinel, RedisServer
from coderai.runtime.store_watch import StoreWatch
from coderai.stack import ha, heads
from coderai.stack.plan import Plan, StackError


class Servers:
    """This machine's nats-server, redis-server and sentinel, and the heads known once its NATS is up."""

    def __init__(self, data: Path) -> None:
        self.logs = data / "logs"
        self.nats: NatsServer | None = None
        self.redis: RedisServer | None = None
        self.sentinel: RedisSentinel | None = None
        self.known: list[heads.Head] = []  # with --head: the cluster's heads, this one included
        self.service_url = ""  # NATS as `service`: this process's own bootstrap only, never a child's

    def start(self, plan: Plan) -> None:
        """Start NATS, then (a head taking its place among the others first) Redis and a head's sentinel; a server
        that does not start is a `StackError`."""
        data = plan.data
        try:
            self.nats = NatsServer(
                data / "nats",
                port=plan.nats_port,
                host=plan.nats_host,
                users_file=data / "nats" / "users.conf",
                tls=plan.tls,
                cluster=plan.cluster,
            ).start(log_file=self.logs / "nats.log")
        except EmbeddedServerError as exc:
            raise StackError(str(exc)) from None
        self.service_url = with_user(self.nats.url, members.SERVICE_USER, plan.service_password)
        self.known = plan.known
        if plan.me is not None:
            redis = self._head_redis(plan, plan.me)
        else:
            redis = RedisServer(
                data / "redis", port=plan.args.redis_port or None, durable=True, password=plan.redis_password
            )
        self.redis = redis
        try:
            redis.start(log_file=self.logs / "redis.log")
            if redis.replicaof:  # its services start once it holds the master's data, so a failover finds it current
                try:
                    redis.wait_synced()
                except EmbeddedServerError as exc:
                    # the master the sentinels named may have moved on (a failover while this head was down): the
                    # sentinels, this head's among them, point this replica at the master there is; the services
                    # reach the master through the sentinels whatever this replica holds, so the head starts
                    print(
                        f"coderai up: {exc}; starting anyway: the sentinels point it at the current master",
                        file=sys.stderr,
                        flush=True,
                    )
            if self.sentinel is not None:
                self.sentinel.start(log_file=self.logs / "sentinel.log")
                ha.set_quorum(self.known, plan.worker_id)
        except EmbeddedServerError as exc:
            raise StackError(str(exc)) from None

    def _head_redis(self, plan: Plan, me: heads.Head) -> RedisServer:
        """A head's Redis (the master's replica when another head has it), returned, and its sentinel, once the head
        took its place among the others."""
        self.known = asyncio.run(ha.take_place(self.service_url, plan.tls, me, plan.data))
        if plan.invite is not None:
            members.write_secret(plan.data / "secrets" / "joined", plan.args.join)
        master = ha.sentinel_master(self.known, exclude=plan.worker_id)
        if master is None and plan.joined:  # no sentinel answers: the heads the invite named have the master
            master = next((h.redis for h in self.known if h.node_id != plan.worker_id), None)
        replicaof = master if master and master != me.redis else ""
        redis = RedisServer(
            plan.data / "redis",
            port=me.redis_port,
            host=me.address,
            durable=True,
            password=plan.redis_password,
            replicaof=replicaof,
        )
        self.sentinel = ha.sentinel_for(plan.data, self.known, master or me.redis, me, plan.redis_password)
        return redis

    @property
    def started_nats(self) -> NatsServer:
        """The nats-server `start` made (a StackError before it did)."""
        if self.nats is None:
            raise StackError("nats-server is not started")
        return self.nats

    @property
    def started_redis(self) -> RedisServer:
        """The redis-server `start` made (a StackError before it did)."""
        if self.redis is None:
            raise StackError("redis-server is not started")
        return self.redis

    def redis_url(self, password: str) -> str:
        """The Redis URL the services use, with `password` (a head's: every head's sentinel; "": none in it)."""
        url = (
            heads.sentinel_url(self.known, password)
            if self.sentinel is not None
            else self.started_redis.url.replace("redis://", f"redis://:{password}@", 1)
        )
        return url if password else url.replace(":@", "", 1)

    def pids(self) -> dict[str, int]:
        """The servers' process ids, by name."""
        servers = {"nats": self.nats, "redis": self.redis, "sentinel": self.sentinel}
        return {name: server.proc.pid for name, server in servers.items() if server and server.proc}

    def keep_up(self, store: StoreWatch) -> None:
        """`keep_up` on these servers."""
        keep_up(self.started_nats, self.started_redis, store, self.logs, self.sentinel)

    def stop(self) -> None:
        """Stop whichever servers started: the sentinel, Redis, then NATS."""
        for server in (self.sentinel, self.redis, self.nats):
            if server:
                server.stop()


def keep_up(
    nats: NatsServer, redis: RedisServer, store: StoreWatch, logs: Path, sentinel: RedisSentinel | None = None
) -> None:
    """Start nats-server, redis-server or a head's sentinel again on its port if it died, and nats-server once its
    JetStream store failed on a full disk that has room again (`StoreWatch`): the services reconnect by themselves.
    A head's Redis comes back as it was configured; if another head's was promoted meanwhile, the sentinels make
    this one its replica."""
    for name, server, log in (
        ("nats-server", nats, "nats"),
        ("redis-server", redis, "redis"),
        ("redis-sentinel", sentinel, "sentinel"),
    ):
        if server is None:
            continue
        if server.proc is not None and server.proc.poll() is not None:
            print(f"{name} exited with {server.proc.returncode}; starting it again", file=sys.stderr, flush=True)
            try:
                server.start(log_file=logs / f"{log}.log")
            except EmbeddedServerError as exc:
                print(f"{name} did not start again: {exc}", file=sys.stderr, flush=True)
    if store.due():
        nats.stop()
        nats.start(log_file=logs / "nats.log")
        store.restarted()
