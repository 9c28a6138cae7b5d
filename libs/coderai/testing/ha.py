"""Three heads and workers in network namespaces (`netns.Lab`), for the HA tests: `three_heads` starts them and
tears every process and namespace down whatever the test did; `Cluster` reads and breaks them; `SdkLoad` keeps real
SDK clients (openai chat, streamed chat and embeddings; anthropic messages) busy on every surviving gateway and
records every HTTP answer they got, the SDK's own retries included."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from coderai.testing.netns import Lab
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.stack import clean_env, node_up, write_models_file

if TYPE_CHECKING:
    import anthropic
    import openai

    from coderai.testing.fake_runpod import FakeRunPod

TOKEN = "correct horse battery staple ha"
HEADS = ("h1", "h2", "h3")
WORKERS = ("w1", "w2")
MODEL = "coderai-tiny"
EMBED_MODEL = "coderai-tiny-embed"


class Cluster:
    """The heads and workers of one lab: their processes, data dirs and logs under `root`."""

    def __init__(self, lab: Lab, root: Path, env: dict[str, str], models: Path) -> None:
        self.lab, self.root, self.env, self.models = lab, root, env, models
        self.procs: dict[str, ServiceProcess] = {}
        self.admin = ""
        self.placed: dict[str, list[str]] = {}  # what the workers were given once the cluster was up
        self.fake: FakeRunPod | None = None  # the RunPod API its pod brokers talk to, where a test runs one

    def head(self, name: str, *extra: str, ready: bool = True) -> ServiceProcess:
        """`coderai up --head` on `name` (started; `ready`: waited for): the control plane only, its gateway on port
        8000."""
        ip = self.lab[name].ip
        p = ServiceProcess(
            f"up-{name}",
            "coderai.cli",
            [
                "up",
                "--head",
                "--address",
                ip,
                "--data-dir",
                str(self.root / name),
                "--node-id",
                name,
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--metrics-port",
                "9464",
                "--cluster-token",
                TOKEN,
                "--no-worker",
                "--models-file",
                str(self.models),
                "--runpod-key-file",
                str(self.root / "runpod.key"),
                *extra,
            ],
            self.env,
            self.root / "logs",
            prefix=self.lab[name].prefix(),
        )
        self.procs[name] = p.start()
        if ready:
            p.wait_log("\nready", 180)
        return p

    def invite(self, name: str) -> Path:
        """An invite for a head on `name`, made on h1 (once h1 has made its CA and secrets)."""
        out = self.root / f"invite-{name}.json"

        def make():
            r = self.lab.run(
                "h1",
                [
                    sys.executable,
                    "-m",
                    "coderai.cli",
                    "heads",
                    "invite",
                    "--data-dir",
                    str(self.root / "h1"),
                    "--address",
                    self.lab[name].ip,
                    "--out",
                    str(out),
                ],
                env=self.env,
            )
            assert "not a head's data dir" in r.stderr or r.returncode == 0, r.stdout + r.stderr
            return r.returncode == 0

        wait_until(make, 60, f"an invite for {name}")
        return out

    def base(self, name: str) -> str:
        return f"http://{self.lab[name].ip}:8000"

    def get(self, name: str, path: str, **params) -> dict:
        r = httpx.get(
            f"{self.base(name)}{path}", params=params, timeout=10, headers={"Authorization": f"Bearer {self.admin}"}
        )
        r.raise_for_status()
        return r.json()

    def leaders(self, name: str) -> dict[str, dict]:
        return {x["role"]: x for x in self.get(name, "/admin/cluster")["leaders"]}

    def leader(self, role: str = "scheduler") -> str:
        """The head holding `role`'s lease, as the first head that answers says."""
        for h in HEADS:
            with contextlib.suppress(httpx.HTTPError, KeyError):
                if holder := self.leaders(h)[role].get("holder"):
                    return holder
        raise AssertionError(f"no head names a {role} leader")

    def lead_from(self, target: str, roles: tuple[str, ...] = ("scheduler", "pod-broker")) -> None:
        """Have `target` hold `roles`' leases: SIGTERM the process that holds one elsewhere (it steps down, its
        supervisor starts it again as a standby) until `target`'s candidate wins. Which head wins first is a race
        between heads that start together; the test wants the one with the Redis master and the workers' joins."""
        modules = {"scheduler": "coderai.scheduler", "pod-broker": "coderai.pod_broker"}
        for _ in range(20):
            held = self.leaders(target)
            elsewhere = {r: held[r].get("holder", "") for r in roles if held[r].get("holder") != target}
            if not elsewhere:
                return
            for role, holder in elsewhere.items():
                for pid in self.lab.pids(holder) if holder else []:
                    with contextlib.suppress(OSError):
                        if modules[role].encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                            os.kill(pid, signal.SIGTERM)
            wait_until(
                lambda: all(self.leaders(target)[r].get("holder") not in ("", h) for r, h in elsewhere.items()),
                30,
                f"{', '.join(elsewhere)} led again after a step-down",
            )
        raise AssertionError(f"{target} did not come to lead {roles}")

    def pid_of(self, host: str, needle: str) -> int | None:
        """The process on `host` whose command line (or title: Redis rewrites its own) holds `needle`."""
        for pid in self.lab.pids(host):
            with contextlib.suppress(OSError):
                if needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                    return pid
        return None

    def redis_master(self) -> str:
        """The head whose Redis the sentinels name master."""
        from coderai.heads import Head, sentinel_master

        master = wait_until(lambda: sentinel_master([Head(n, self.lab[n].ip) for n in HEADS]), 30, "a Redis master")
        return next(h for h in HEADS if master.startswith(self.lab[h].ip + ":"))

    def serving(self, name: str, key: str) -> bool:
        """Whether head `name`'s gateway answers a chat now."""
        try:
            r = httpx.post(
                f"{self.base(name)}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                timeout=30,
                json={"model": MODEL, "messages": [{"role": "user", "content": "up?"}], "max_tokens": 2},
            )
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def nats_url(self, name: str) -> str:
        from coderai.runtime.cluster import with_user

        password = (self.root / "h1" / "secrets" / "nats-service.password").read_text().strip()
        return with_user(f"nats://{self.lab[name].ip}:4222", "service", password)

    def redis_url(self) -> str:
        from coderai.heads import Head, sentinel_url

        password = (self.root / "h1" / "secrets" / "redis.password").read_text().strip()
        return sentinel_url([Head(n, self.lab[n].ip) for n in HEADS], password)

    async def buckets(self, via: str) -> tuple[dict, set]:
        """(each node's assigned models, the affinity keys), read from the replicated buckets through head `via`."""
        from coderai.contracts import Assignment
        from coderai.contracts.topology import AFFINITY, ASSIGNMENTS
        from coderai.runtime.bus import Bus
        from coderai.runtime.kv import list_keys, read_all
        from coderai.runtime.tls import client_context

        ca = (self.root / "h1" / "nats" / "tls" / "ca.pem").read_text()
        bus = await Bus.connect(self.nats_url(via), "test", connect_timeout_s=10, tls=client_context(ca))
        try:
            assigned = await read_all(await bus.kv(ASSIGNMENTS), Assignment)
            return (
                {k: sorted(m.name for m in a.models) for k, a in assigned.items()},
                set(await list_keys(await bus.kv(AFFINITY))),
            )
        finally:
            await bus.close()

    def diagnose(self, names: list[str]) -> str:
        """What each head's JetStream says of the leaders' bucket (its RAFT leader, each replica current or not) and
        the ends of its NATS and gateway logs: printed when a wait on the heads times out."""
        from coderai.runtime.bus import Bus
        from coderai.runtime.tls import client_context

        async def stream(name: str) -> str:
            ca = (self.root / "h1" / "nats" / "tls" / "ca.pem").read_text()
            try:
                bus = await Bus.connect(self.nats_url(name), "test", connect_timeout_s=5, tls=client_context(ca))
            except Exception as exc:  # a diagnosis reports what it cannot reach
                return f"not reached: {exc!r}"
            try:
                info = await bus.js.stream_info("KV_coderai_leaders")
                if info.cluster is None:
                    return f"no cluster info, replicas {info.config.num_replicas}"
                peers = [(r.name, r.current, r.lag, r.active) for r in info.cluster.replicas or []]
                return f"leader {info.cluster.leader}, replicas {info.config.num_replicas}, others {peers}"
            except Exception as exc:
                return f"no stream info: {exc!r}"
            finally:
                await bus.close()

        out = []
        for name in names:
            out.append(f"--- {name}: KV_coderai_leaders: {asyncio.run(stream(name))}")
            for log in ("nats", "gateway", "scheduler"):
                path = self.root / name / "logs" / f"{log}.log"
                lines = path.read_text(errors="replace").splitlines()[-25:] if path.exists() else []
                out += [f"{name}/{log}: {line[:300]}" for line in lines]
        return "\n".join(out)

    async def money(self, write: bool = False) -> tuple[list, float, float]:
        """(the pod ledger, the pods' spend today, the loader key's spend today) through the sentinels."""
        from coderai.accounts.limits import period_id
        from coderai.accounts.pod_money import Caps, PodMoney
        from coderai.runtime.redis_client import connect

        r = connect(self.redis_url())
        try:
            money = PodMoney(r)
            if write:  # what the broker leaves of a pod it rented and reaped
                now = time.time()
                await money.reserve("big", "pod-ha", 1.2, 0.5, Caps(), now - 600)
                await money.open_pod("pod-ha", "H100", now - 600)
                await money.book("pod-ha", "big", "H100", 1.2, now - 600, now - 300, now)
            spent = float(await r.get(f"coderai:spend:loader:{period_id('day', time.time())[0]}") or 0)
            return [(e.pod_id, e.usd_micro) for e in await money.ledger()], await money.spend("big"), spent
        finally:
            await r.aclose()

    def wait_placed(self) -> None:
        wait_until(lambda: asyncio.run(self.buckets("h2"))[0] == self.placed, 120, "the models placed on both workers")

    def restore(self, key: str = "") -> None:
        """Bring the cluster back to whole after whatever a test did: every link up, every head and worker running
        (what is left of a dead one's processes killed first) and the models on both workers; with `key`, every
        gateway serving a chat too. A test that failed midway leaves the next one this."""
        for name in (*HEADS, *WORKERS):
            self.lab.heal(name)
        broken = [name for name in (*HEADS, *WORKERS) if not self.procs[name].alive()]
        for name in broken:
            self.lab.kill_all(name)
            if name in HEADS:
                self.head(name)
            else:
                self.procs[name] = node_up(self.lab[name], name, self.lab["h1"].ip, self.root, TOKEN, self.env).start()
        if broken:
            self.wait_placed()
        for name in HEADS if key else ():
            wait_until(lambda: self.serving(name, key), 120, f"{name}'s gateway to serve")


@contextlib.contextmanager
def three_heads(root: Path, tiny_gguf: Path, embed: bool = True) -> Iterator[Cluster]:
    """Three heads (h1..h3) and two workers (w1, w2), each in its own network namespace, serving `MODEL` (chat) and,
    with `embed`, `EMBED_MODEL` (embeddings) on both workers, pods against a fake RunPod. Everything it started is
    killed and every namespace removed on exit, whatever the tests did and however far its own set-up got."""
    from coderai.testing.fake_runpod import FakeRunPod

    lab = Lab([*HEADS, *WORKERS], reach=True)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(lab.close)
        models = [
            {
                "name": MODEL,
                "engine": "llama",
                "path": str(tiny_gguf),
                "params": {"n_ctx": 512},
                "nodes": list(WORKERS),
                "replicas": 2,
                "price_completion_per_mtok": 1000.0,
            }
        ]
        if embed:
            copy = root / "embed.gguf"
            copy.write_bytes(Path(tiny_gguf).read_bytes())
            models.append(
                {
                    "name": EMBED_MODEL,
                    "engine": "llama",
                    "path": str(copy),
                    "ops": ["embed"],
                    "params": {"n_ctx": 512, "embedding": True},
                    "nodes": list(WORKERS),
                    "replicas": 2,
                }
            )
        fake = FakeRunPod(host=lab.root_ip).start()  # every head's broker leads against it in turn; no pod is rented
        cleanup.callback(fake.close)
        (root / "runpod.key").write_text(fake.api_key + "\n")
        env = clean_env(CODERAI_POD_BROKER_RUNPOD_API_BASE=fake.base_url)
        c = Cluster(lab, root, env, write_models_file(root / "models.toml", models))
        c.fake = fake
        cleanup.callback(lambda: [p.kill() for p in c.procs.values()])
        first = c.head("h1", ready=False)  # its JetStream answers once a second head is in
        c.head("h2", "--join", str(c.invite("h2")))
        first.wait_log("\nready", 180)
        c.admin = (root / "h1" / "admin.key").read_text().strip()
        c.head("h3", "--join", str(c.invite("h3")))
        for w in WORKERS:
            c.procs[w] = node_up(lab[w], w, lab["h1"].ip, root, TOKEN, env).start()
        c.placed = {w: sorted(m["name"] for m in models) for w in WORKERS}
        c.wait_placed()
        yield c


@dataclass
class Answer:
    """One HTTP answer a client got (an SDK retry is another one)."""

    head: str
    kind: str
    at: float
    status: int
    retry_after: str | None
    said: str = ""  # the body of an answer that was not a success


@dataclass
class Call:
    """One SDK call, from start to its outcome (after the SDK's own retries)."""

    head: str
    kind: str
    start: float
    end: float
    ok: bool
    error: str = ""
    first_token: float | None = None  # a streamed call's first content
    refused: int = 0  # answers that were not a success before its outcome (what the SDK retried)


@dataclass
class SdkLoad:
    """`clients` threads calling through `heads` in turn with the official SDKs, each kind in turn (chat, streamed
    chat, embeddings, anthropic messages), with the SDKs' own retries (`max_retries`); every HTTP answer and every
    call's outcome recorded. `avoid` takes a head out, as a load balancer's failed health check would."""

    cluster: Cluster
    key: str
    heads: tuple[str, ...] = HEADS
    clients: int = 8
    max_retries: int = 4
    kinds: tuple[str, ...] = ("chat", "stream", "embed", "anthropic")
    answers: list[Answer] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    avoid: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __enter__(self) -> "SdkLoad":
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.clients)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def ok(self, since: float = 0.0, head: str | None = None) -> int:
        with self.lock:
            return sum(1 for c in self.calls if c.ok and c.start >= since and head in (None, c.head))

    def hopeless(self) -> bool:
        """Raise when the clients fail whatever they try (a broken test, not a failover): waits end at once."""
        with self.lock:
            if len(self.calls) >= 24 and not any(c.ok for c in self.calls):
                raise AssertionError(f"no call succeeded: {[c.error for c in self.calls[:4]]}")
        return False

    def _clients(self, head: str, kind: str, current: list[Call]) -> openai.OpenAI | anthropic.Anthropic:
        import anthropic
        import httpx2
        import openai

        def seen(response: httpx2.Response) -> None:
            said = ""
            if response.status_code != 200:
                with contextlib.suppress(Exception):
                    said = response.read().decode(errors="replace")[:200]
            with self.lock:
                self.answers.append(
                    Answer(
                        head, kind, time.monotonic(), response.status_code, response.headers.get("retry-after"), said
                    )
                )
                if response.status_code != 200 and current:
                    current[0].refused += 1

        if kind == "anthropic":  # the SDKs run on httpx2, a fork with httpx's hooks
            return anthropic.Anthropic(
                base_url=self.cluster.base(head),
                api_key=self.key,
                max_retries=self.max_retries,
                http_client=httpx2.Client(timeout=60, event_hooks={"response": [seen]}),
            )
        return openai.OpenAI(
            base_url=f"{self.cluster.base(head)}/v1",
            api_key=self.key,
            max_retries=self.max_retries,
            http_client=httpx2.Client(timeout=60, event_hooks={"response": [seen]}),
        )

    def _run(self, i: int) -> None:
        import anthropic

        sdks: dict[tuple[str, str], openai.OpenAI | anthropic.Anthropic] = {}
        current: list[Call] = []  # the call this thread makes now, for the answers its SDK gets
        n = 0
        while not self.stop.is_set():
            head, kind = self.heads[(i + n) % len(self.heads)], self.kinds[(i + n // len(self.heads)) % len(self.kinds)]
            n += 1
            if head in self.avoid:
                continue
            call = Call(head, kind, time.monotonic(), 0.0, False)
            current[:] = [call]
            tag = {"X-Client-Request-Id": f"ha-{i}-{n}-{uuid.uuid4().hex[:6]}"}
            try:
                sdk = sdks.get((head, kind)) or sdks.setdefault((head, kind), self._clients(head, kind, current))
                if isinstance(sdk, anthropic.Anthropic):  # kind "anthropic"
                    r = sdk.messages.create(
                        model=MODEL,
                        max_tokens=4,
                        messages=[{"role": "user", "content": f"hi {i} {n}"}],
                        extra_headers=tag,
                    )
                    assert r.content is not None, r
                elif kind == "chat":
                    r = sdk.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"hello {i} {n}"}],
                        max_tokens=4,
                        extra_headers=tag,
                    )
                    assert r.choices, r
                elif kind == "stream":
                    for chunk in sdk.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": f"stream {i} {n}"}],
                        max_tokens=4,
                        stream=True,
                        extra_headers=tag,
                    ):
                        if call.first_token is None and chunk.choices:
                            call.first_token = time.monotonic()
                else:  # embed
                    r = sdk.embeddings.create(
                        model=EMBED_MODEL,
                        input=[f"a {n}", f"b {n}", f"c {n}"],
                        extra_headers=tag,
                    )
                    assert len(r.data) == 3, r
                call.ok = True
            except Exception as exc:  # every failure is an outcome the test judges
                call.error = f"{type(exc).__name__}: {exc}"[:300]
            call.end = time.monotonic()
            with self.lock:
                self.calls.append(call)
