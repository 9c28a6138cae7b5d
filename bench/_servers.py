"""The servers the overhead bench compares, each started on 127.0.0.1 with readiness polled, never slept for.

- bare: `python -m llama_cpp.server` serving the tiny GGUF (the real-engine baseline)
- litellm: LiteLLM proxy from its own venv, `tiny` forwarded to the bare server, `echo` answered by `mock_response`
- coderai: nats + redis + router, scheduler, metrics, a llama worker, an echo worker and the gateway with API keys
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from coderai.runtime.embedded import NatsServer, free_port
from coderai.runtime.embedded_redis import RedisServer
from coderai.testing.procs import wait_until
from coderai.testing.stack import Stack, write_models_file

BENCH_KEY = "sk-bench-0123456789abcdef"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Target:
    """One way of serving a model: where to send requests and which process trees to charge for CPU."""

    name: str
    base_url: str  # ends in /v1
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    extra_body: dict = field(default_factory=dict)  # sent with every request

    @property
    def chat_url(self) -> str:
        return self.base_url + "/chat/completions"


class Proc:
    """Any command as a child in its own process group, output to a log file; `stop()` ends the group."""

    def __init__(self, name: str, cmd: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def check(self) -> None:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")

    def wait_http(self, url: str, timeout_s: float) -> None:
        def up() -> bool:
            self.check()
            return httpx.get(url, timeout=2).status_code == 200

        wait_until(up, timeout_s, f"{self.name} at {url}")

    def stop(self, timeout_s: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm)" (comm may hold spaces), or None for a process gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def own_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` itself (all its threads), without its children."""
    rest = _stat(pid)
    return (int(rest[11]) + int(rest[12])) / CLK_TCK if rest else 0.0


def tree_cpu_s(roots: list[int]) -> float:
    """User + system CPU seconds of the processes `roots` and all their descendants (reaped children included)."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or (rest := _stat(entry.name)) is None:
            continue
        pid = int(entry.name)
        parent[pid] = int(rest[1])
        ticks[pid] = int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])  # utime stime cutime cstime
    wanted = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in wanted and pid not in wanted:
                wanted.add(pid)
                grew = True
    return sum(ticks.get(p, 0) for p in wanted) / CLK_TCK


def start_bare(root: Path, gguf: Path, n_threads: int, n_ctx: int) -> tuple[Proc, Target]:
    """llama-cpp-python's own OpenAI server: what coderai and LiteLLM are measured against."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        str(n_threads),
        "--n_threads_batch",
        str(n_threads),
        "--verbose",
        "False",
        # on by default: a new request would cut a running stream short, which no other path does
        "--interrupt_requests",
        "False",
    ]
    proc = Proc("bare", cmd, root / "logs")
    base = f"http://127.0.0.1:{port}/v1"
    proc.wait_http(base + "/models", 120)
    return proc, Target("bare", base, "tiny", pids=[proc.pid])


def start_litellm(root: Path, exe: Path, bare_base: str | None, mock_reply: str) -> tuple[Proc, Target]:
    """LiteLLM proxy, one worker, a master key: `tiny` goes to the bare server, `echo` is its `mock_response`."""
    port = free_port()
    master = "sk-bench-litellm-master"
    models = [("echo", f'      model: openai/echo\n      api_key: none\n      mock_response: "{mock_reply}"\n')]
    if bare_base:
        models.append(("tiny", f"      model: openai/tiny\n      api_base: {bare_base}\n      api_key: none\n"))
    text = "model_list:\n" + "".join(f"  - model_name: {n}\n    litellm_params:\n{p}" for n, p in models)
    text += f"general_settings:\n  master_key: {master}\nlitellm_settings:\n  telemetry: false\n"
    cfg = root / "litellm.yaml"
    cfg.write_text(text)
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "NO_DOCS": "True", "PYTHONUNBUFFERED": "1"}
    cmd = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    proc = Proc("litellm", cmd, root / "logs", env)
    proc.wait_http(f"http://127.0.0.1:{port}/health/liveliness", 180)
    return proc, Target(
        "litellm", f"http://127.0.0.1:{port}/v1", "tiny", {"Authorization": f"Bearer {master}"}, [proc.pid]
    )


class Coderai:
    """The whole coderai stack as in production: API keys, metrics with Redis, JSON logs at INFO."""

    def __init__(self, root: Path, python: str = "", extra_env: dict[str, str] | None = None) -> None:
        self.root = root
        self.extra_env = extra_env or {}  # every service's environment (a worker's children inherit it)
        self.python = python  # another checkout's venv python: that checkout's services (a baseline)
        self.nats: NatsServer | None = None
        self.redis: RedisServer | None = None
        self.stack: Stack | None = None
        self.headers = {"Authorization": f"Bearer {BENCH_KEY}"}

    def start(
        self,
        gguf: Path | None,
        n_threads: int,
        n_ctx: int,
        gateway_workers: int,
        ls_params: dict | None = None,
        ls_gguf: Path | None = None,
    ) -> None:
        """`echo` on an echo worker, `tiny` (in process) on worker `llama` when `gguf` is given, and with
        `ls_params` `tiny-ls` on the llama-server engine on workers `ls1` and `ls2` (the routers part)."""
        models = [{"name": "echo", "engine": "echo", "path": "-", "nodes": ["echo"]}]
        workers = []
        if gguf is not None:
            models.append(
                {
                    "name": "tiny",
                    "engine": "llama",
                    "path": str(gguf),
                    "nodes": ["llama"],
                    "params": {"n_ctx": n_ctx, "n_threads": n_threads, "n_threads_batch": n_threads},
                }
            )
            workers.append("llama")
        if ls_params is not None:
            models.append(
                {
                    "name": "tiny-ls",
                    "engine": "llama-server",
                    "path": str(ls_gguf or gguf),
                    "nodes": ["ls1", "ls2"],
                    "params": ls_params,
                }
            )
            workers += ["ls1", "ls2"]
        self.start_models(models, workers, gateway_workers, echo=True)

    def start_models(
        self,
        models: list[dict],
        workers: list[str],
        gateway_workers: int = 1,
        echo: bool = False,
        ready_timeout_s: float = 120,
    ) -> None:
        """NATS, Redis (if it starts), the core services with `models`, `workers` and the gateway with the bench
        key; `echo` adds a worker that offers the echo engine. Returns once every model answers."""
        from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys

        self.nats = NatsServer(self.root / "nats").start(log_file=self.root / "logs" / "nats.log")
        redis_url = ""
        try:
            self.redis = RedisServer(self.root / "redis").start()
            redis_url = self.redis.url
        except Exception as exc:  # usage counters are optional; say so and go on
            print(f"[bench] coderai runs without Redis: {exc}", file=sys.stderr)
        keys = self.root / "keys.toml"
        write_keys(str(keys), [KeyRecord(name="bench", sha256=hash_key(BENCH_KEY), scopes=["inference"])])
        self.stack = Stack(
            self.root,
            self.nats.url,
            redis_url,
            extra_env={"CODERAI_LOG_LEVEL": "INFO", **self.extra_env},
            python=self.python,
        )
        self.stack.start_core(write_models_file(self.root / "models.toml", models))
        for w in workers:
            self.stack.start_worker(w)
        if echo:
            self.stack.start(
                "worker-echo",
                "coderai.engine_worker",
                ["--node-id", "echo"],
                env={"CODERAI_DATA_DIR": str(self.root / "echo"), "CODERAI_WORKER_FAMILIES": "echo"},
            )
        self.stack.start_gateway("--api-keys-file", str(keys), "--workers", str(gateway_workers))
        for m in models:
            self.stack.wait_model_ready(m["name"], headers=self.headers, timeout_s=ready_timeout_s)

    def target(self, name: str, model: str) -> Target:
        assert self.stack is not None and self.nats is not None
        pids = [p.proc.pid for p in self.stack.procs.values() if p.proc is not None]
        pids += [s.proc.pid for s in (self.nats, self.redis) if s is not None and s.proc is not None]
        return Target(name, self.stack.base_url, model, dict(self.headers), pids)

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
        for s in (self.redis, self.nats):
            if s is not None:
                s.stop()


def start_llama_replica(
    root: Path,
    binary: str,
    gguf: Path,
    name: str,
    threads: int,
    slots: int,
    n_ctx: int,
    cache_mb: int,
    alias: str = "bench",
    metrics: bool = True,
) -> tuple[Proc, Target]:
    """A bare `llama-server` replica, as the Rust routers are put in front of: the same flags coderai's
    llama-server engine gives it (slots, context per slot, threads, host prompt cache), serving the model as
    `alias`; `metrics=False` leaves its Prometheus endpoint off."""
    port = free_port()
    cmd = [
        binary,
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--alias",
        alias,
        "--parallel",
        str(slots),
        "--ctx-size",
        str(n_ctx * slots),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--cache-ram",
        str(cache_mb),
        "--jinja",
        *(["--metrics"] if metrics else []),
        "--no-webui",
    ]
    proc = Proc(name, cmd, root / "logs")
    proc.wait_http(f"http://127.0.0.1:{port}/health", 120)
    return proc, Target(name, f"http://127.0.0.1:{port}/v1", alias, pids=[proc.pid])


def start_vllm_replica(
    root: Path, python: str, hf: Path, name: str, params: dict, env: dict[str, str], alias: str = "bench"
) -> tuple[Proc, Target]:
    """vLLM's OpenAI server with exactly the command line coderai's `vllm` engine makes from the same params,
    serving the model as `alias`."""
    from coderai.engine_worker.engines.vllm import server_command

    port = free_port()
    proc = Proc(name, server_command(python, str(hf), alias, port, params), root / "logs", env=env)
    proc.wait_http(f"http://127.0.0.1:{port}/health", 600)
    return proc, Target(name, f"http://127.0.0.1:{port}/v1", alias, pids=[proc.pid])


def start_router(
    root: Path, exe: Path, name: str, policy: str, replicas: list[Target], retries: bool = True
) -> tuple[Proc, Target]:
    """`sglang-router launch` or `vllm-router` with `policy` in front of `replicas`, its Prometheus exporter on a
    free port. `retries=False` (bench/overhead.py) turns their retries off, as coderai's gateway does not retry a
    request that reached an engine: a failed send is then an error wrk counts. With retries on (their default)
    a send on a connection the replica had closed is sent again, as people run them."""
    port = free_port()
    urls = [r.base_url.removesuffix("/v1") for r in replicas]
    sub = ["launch"] if exe.name == "sglang-router" else []
    cmd = [
        str(exe),
        *sub,
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warn" if sub else "warning",
        *([] if retries else ["--disable-retries"]),  # both retry a failed send 5 times by default
    ]
    proc = Proc(name, cmd, root / "logs")
    base = f"http://127.0.0.1:{port}/v1"

    def answers() -> bool:
        proc.check()
        r = httpx.post(
            base + "/chat/completions",
            timeout=10,
            json={"model": "bench", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1},
        )
        return r.status_code == 200

    wait_until(answers, 60, f"{name} to route a request")
    return proc, Target(name, base, "bench", pids=[proc.pid])
