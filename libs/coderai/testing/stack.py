"""A whole coderai stack as real processes over a real NATS (and Redis), for integration tests and benches."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx

from coderai.contracts import decode
from coderai.contracts.routing import AffinityEntry
from coderai.contracts.topology import AFFINITY
from coderai.models_file import write_models_file as write_models_file  # tests and benches take it from here too
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer, free_port
from coderai.testing.procs import ProcessDied, ServiceProcess, wait_until


SERVICE_MODULES = {
    "coderai.gateway": "gateway",
    "coderai.router": "router",
    "coderai.scheduler": "scheduler",
    "coderai.pod_broker": "pod-broker",
    "coderai.metrics": "metrics",
}
"""Each head service's module and its role (members.SERVICE_ROLES)."""


class Stack:
    """Services started one by one; `stop()` ends them all. Env vars in `extra_env` reach every service."""

    def __init__(
        self, root: Path, nats_url: str, redis_url: str = "", extra_env: dict[str, str] | None = None, python: str = ""
    ) -> None:
        self.root = Path(root)
        self.python = python  # empty: this interpreter
        self.nats_url = nats_url
        self.redis_url = redis_url
        self.procs: dict[str, ServiceProcess] = {}
        self.env = {
            **os.environ,
            "CODERAI_NATS_URL": nats_url,
            "CODERAI_DATA_DIR": str(self.root / "data"),
            "CODERAI_LOG_FORMAT": "json",
            **(extra_env or {}),
        }
        self.gateway_port = 0
        self.metrics_port = 0
        self.nats: NatsServer | None = None  # the server, where the test made it (running_stack does)

    def start(
        self,
        name: str,
        module: str,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        ready: str | None = '"msg": "ready"',
        timeout_s: float = 60.0,
    ) -> ServiceProcess:
        """Start `module` as `name`. On a secured NATS (`stack.nats`, NatsServer.secured) a head service logs in
        as its own user with its own rights, as under `coderai up`, unless `env` names a NATS URL of its own."""
        role = SERVICE_MODULES.get(module, "")
        nats = self.nats
        if role and nats is not None and nats.service_passwords and "CODERAI_NATS_URL" not in (env or {}):
            env = {**(env or {}), "CODERAI_NATS_URL": nats.role_url(role)}
        p = ServiceProcess(
            name, module, args or [], {**self.env, **(env or {})}, self.root / "logs", python=self.python
        ).start()
        self.procs[name] = p
        if ready:
            p.wait_log(ready, timeout_s)
        return p

    def start_core(self, models_file: Path) -> None:
        """Router, scheduler and metrics: everything but workers and the gateway."""
        self.start("router", "coderai.router")
        nats = self.nats
        members = (
            {
                "CODERAI_SCHEDULER_MEMBERS_FILE": str(nats.members_file),
                "CODERAI_SCHEDULER_NATS_USERS_FILE": str(nats.users_file),
                "CODERAI_SCHEDULER_NATS_PID_FILE": str(nats.pid_file),
            }
            if nats is not None and nats.members_file is not None
            else {}
        )
        self.start("scheduler", "coderai.scheduler", ["--models-file", str(models_file)], env=members)
        self.metrics_port = free_port()
        env = {"CODERAI_METRICS_PORT": str(self.metrics_port)}
        if self.redis_url:
            env["CODERAI_METRICS_REDIS_URL"] = self.redis_url
        self.start("metrics", "coderai.metrics", env=env)

    def start_worker(self, node_id: str) -> ServiceProcess:
        """A worker; on a secured NATS (NatsServer.secured) it logs in as a node of its own, as a joined one does."""
        env = {"CODERAI_DATA_DIR": str(self.root / node_id)}
        nats = self.nats
        if nats is not None and nats.members_file is not None:
            env["CODERAI_NATS_URL"] = nats.add_node(node_id)
        return self.start(f"worker-{node_id}", "coderai.engine_worker", ["--node-id", node_id], env=env)

    def start_gateway(self, *args: str, env: dict[str, str] | None = None) -> ServiceProcess:
        self.gateway_port = free_port()
        p = self.start("gateway", "coderai.gateway", ["--port", str(self.gateway_port), *args], env=env, ready=None)
        wait_until(
            lambda: (
                p.alive() and httpx.get(f"{self.http_url}/healthz", timeout=1).status_code == 200 or (_raise_if_dead(p))
            ),
            60,
            "gateway /healthz",
        )
        return p

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    @property
    def base_url(self) -> str:
        return self.http_url + "/v1"

    def wait_model_ready(self, model: str, headers: dict[str, str] | None = None, timeout_s: float = 60) -> None:
        """A one-token chat through the gateway answers 200: the model is placed, loaded and routable."""
        body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        wait_until(
            lambda: (
                httpx.post(f"{self.base_url}/chat/completions", json=body, headers=headers, timeout=10).status_code
                == 200
            ),
            timeout_s,
            f"model {model} to answer",
        )

    def wait_engines_ready(
        self, models: list[str], headers: dict[str, str] | None = None, timeout_s: float = 120
    ) -> None:
        """Every model in `models` has a ready engine on some node (any op: no request is sent). Needs an admin
        key in `headers`, or a gateway started with --no-auth."""

        def ready() -> bool:
            nodes = httpx.get(f"{self.http_url}/admin/nodes", headers=headers, timeout=5).json()["nodes"]
            up = {e["model"] for n in nodes for e in n["heartbeat"].get("engines", []) if e.get("state") == "ready"}
            failed = {
                e["model"]: e.get("error")
                for n in nodes
                for e in n["heartbeat"].get("engines", [])
                if e.get("state") == "failed"
            }
            if failed:
                raise ProcessDied(f"engines failed to load: {failed}")
            return set(models) <= up

        wait_until(ready, timeout_s, f"engines of {models} to be ready")

    def stop(self) -> None:
        """Every service at once (each drains by itself; one after another cost seconds per stack), then reaped."""
        procs = list(reversed(list(self.procs.values())))
        for p in procs:
            p.terminate()
        for p in procs:
            p.reap()


@contextlib.contextmanager
def running_stack(
    root: Path,
    models: list[dict],
    *,
    workers: tuple[str, ...] = ("w1",),
    gateway_args: tuple[str, ...] = (),
    redis_url: str = "",
    extra_env: dict[str, str] | None = None,
    nats_port: int | None = None,
    ready_model: str = "",
    headers: dict[str, str] | None = None,
) -> Iterator[Stack]:
    """A NATS server of its own, core services, workers and a gateway; `ready_model` answers before it yields.
    `stack.nats` is the server, for tests that kill and restart it (give `nats_port` so it comes back there)."""
    # every worker a node with a node's rights; the server's log beside the services'
    nats = NatsServer.secured(root / "nats", port=nats_port).start(log_file=root / "logs" / "nats.log")
    stack = Stack(root, nats.service_url, redis_url, extra_env)
    stack.nats = nats
    try:
        stack.start_core(write_models_file(root / "models.toml", models))
        for w in workers:
            stack.start_worker(w)
        stack.start_gateway(*gateway_args)
        stack.wait_model_ready(ready_model or models[0]["name"], headers=headers)
        yield stack
    finally:
        stack.stop()
        nats.stop()


def _raise_if_dead(p: ServiceProcess) -> bool:
    if not p.alive():
        raise ProcessDied(f"{p.name} died:\n{p.log_text()[-3000:]}")
    return False


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any `CODERAI_*` setting, with JSON logs, plus `extra`: what a test
    hands the processes of a cluster it starts, so the developer's own settings leak into none of them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CODERAI_")}
    return env | {"CODERAI_LOG_FORMAT": "json"} | extra


def head_up(host, root: Path, models: Path, token: str, env: dict[str, str], port: int = 8000) -> ServiceProcess:
    """`coderai up` as the head of a cluster on a test host (a `netns.Host`), node id "head", data under
    `root/head`, logs under `root/logs`, mDNS on the host's address only. Returned unstarted."""
    return ServiceProcess(
        "up",
        "coderai.cli",
        [
            "up",
            "--data-dir",
            str(root / "head"),
            "--port",
            str(port),
            "--cluster-token",
            token,
            "--mdns-interface",
            host.ip,
            "--node-id",
            "head",
            "--models-file",
            str(models),
        ],
        env,
        root / "logs",
        prefix=host.prefix(),
    )


def node_up(
    host,
    node_id: str,
    head_ip: str,
    root: Path,
    token: str,
    env: dict[str, str],
    *extra: str,
    wrap: list[str] | None = None,
) -> ServiceProcess:
    """A worker `node_id` on a test host (a `netns.Host`), joining the head at `head_ip` by URL (no mDNS), data
    under `root/<node_id>`. `wrap` goes between the namespace prefix and the command (e.g. a mount namespace).
    Returned unstarted."""
    return ServiceProcess(
        f"worker-{node_id}",
        "coderai.engine_worker",
        [
            "--cluster-token",
            token,
            "--nats-url",
            f"nats://{head_ip}:4222",
            "--no-mdns",
            "--node-id",
            node_id,
            "--data-dir",
            str(root / node_id),
            *extra,
        ],
        env,
        root / "logs",
        prefix=host.prefix() + (wrap or []),
    )


def affinity(nats_url: str) -> dict[str, str]:
    """The `coderai_affinity` bucket on that NATS, read once: key -> the engine id it names."""

    async def read() -> dict[str, str]:
        bus = await Bus.connect(nats_url, "test-reader")
        try:
            kv = await bus.kv(AFFINITY)
            try:
                keys = await kv.keys()
            except Exception:  # nats-py: no keys yet
                return {}
            out = {}
            for k in keys:
                try:
                    value = (await kv.get(k)).value
                except Exception:  # deleted between the listing and the read
                    continue
                if value:
                    out[k] = decode(value, AffinityEntry).engine_id
            return out
        finally:
            await bus.close()

    return asyncio.run(read())
