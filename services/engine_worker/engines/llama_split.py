"""A llama.cpp model split over this node's CPU and other nodes' RPC servers, run in a child process.

The scheduler hands the serving node a `SplitPlan` (inside the model's config). The model is loaded in a
child process, never in the worker itself, for two reasons:
- ggml registers RPC devices process-wide and cannot forget one, so a re-placed model needs a fresh process;
- when an RPC server goes away mid-computation, ggml aborts the whole process: the worker must survive that.

The child runs the ordinary `LlamaEngine` (chat templates, prompt cache, cancel, usage: all the same), with
the remote devices registered first and these llama.cpp parameters added:
- layer split: the first blocks stay on the local CPU; `n_gpu_layers` = the blocks the remote devices hold
  (llama.cpp offloads the last N), shared between them by `tensor_split`;
- row split: `split_mode = row` over the devices. llama.cpp's RPC backend offers no split buffers (it refuses
  a row split with "device RPC0 does not support split buffers"); the child then loads a layer split and says
  so, and the worker logs it.
Parent and child talk over stdin/stdout in length-prefixed msgpack frames. A watchdog thread connects to each
remote endpoint every `PROBE_S`; two failures in a row (or the child dying) mark the engine lost at once, so
the model stops taking requests (callers get a clear 503) and the scheduler re-places it. If the RPC servers
answer again before that (a node that restarted within the heartbeat TTL keeps its plan), the engine loads the
model again by itself and serves again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
from typing import IO, Any

import msgspec

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, Usage, decode, encode
from coderai.contracts.split import SplitPlan
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError, EngineLost

log = logging.getLogger("coderai.engine_worker.split")

PROBE_S = 1.0
FAST_LINK_GBPS = 10.0
ROW_REFUSED = "split buffers"
_DEAD = object()
_JOBS = {"chat": ChatJob, "complete": CompletionJob}
LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_ROW = 1, 2


def _write(out: IO[bytes], lock: threading.Lock, msg: dict) -> None:
    data = msgspec.msgpack.encode(msg)
    with lock:
        out.write(struct.pack(">I", len(data)) + data)
        out.flush()


def _read(inp: IO[bytes]) -> dict | None:
    head = inp.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    data = inp.read(n)
    return msgspec.msgpack.decode(data) if len(data) == n else None


def split_params(plan: SplitPlan, n_layers: int, row: bool) -> dict[str, Any]:
    """llama.cpp load parameters for `plan` on a model of `n_layers` blocks (remote devices registered in
    plan order, so llama.cpp's device i is `plan.remote()[i]`)."""
    remote = plan.remote()
    shares = [d.share for d in remote]
    total = sum(shares) or 1.0
    tensor_split = [s / total for s in shares]
    if row:
        return {"n_gpu_layers": -1, "split_mode": LLAMA_SPLIT_MODE_ROW, "tensor_split": tensor_split}
    if all(d.layers for d in remote) and sum(len(d.layers) for d in plan.devices) == n_layers:
        offloaded = sum(len(d.layers) for d in remote)
    else:
        offloaded = round(n_layers * sum(shares) / (sum(d.share for d in plan.devices) or 1.0))
    offloaded = max(1, min(n_layers, offloaded))
    return {"n_gpu_layers": offloaded, "split_mode": LLAMA_SPLIT_MODE_LAYER, "tensor_split": tensor_split}


class SplitLlamaEngine(Engine):
    """The worker's side: starts the child, forwards jobs and cancels, watches the remote devices."""

    family = "llama"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.shards is None:
            raise EngineLoadError(f"{config.name} has no split plan")
        self.plan: SplitPlan = config.shards
        self.proc: subprocess.Popen[bytes] | None = None
        self.lost: str | None = None
        self.note = ""
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, queue.Queue] = {}
        self._closed = threading.Event()
        self._stats: dict[str, int] = {}

    def load(self) -> None:
        from coderai.engine_worker.rpc import link_gbps

        self.warning = self._link_warning(link_gbps)
        self._start_child()
        # the supervisor outlives every child it restarts: a child dies with the thread that forked it
        threading.Thread(target=self._supervise, name=f"split-watch-{self.config.name}", daemon=True).start()

    def _start_child(self) -> None:
        """Start the child, wait until it has loaded the model over the RPC servers, then read its frames."""
        from coderai.runtime.embedded import die_with_parent

        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # an abort must not wait for gdb to print a backtrace
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coderai.engine_worker.engines.llama_split"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent(),
        )
        _write(self._stdin(), self._lock, {"config": encode(self.config)})
        ready = _read(_stdout(self.proc))
        if not ready or "error" in ready:
            self._stop_child()
            raise EngineLoadError(
                (ready or {}).get("error") or f"the split model's process exited ({self.proc.wait()})"
            )
        self.note = ready.get("note", "")
        if self.note and self.note not in self.warning:
            log.warning("%s: %s", self.config.name, self.note)
            self.warning = "; ".join(w for w in (self.warning, self.note) if w)
        log.info(
            "%s split over %s",
            self.config.name,
            ", ".join(
                f"{d.node_id}{'@' + d.endpoint if d.endpoint else ' (local)'} {d.share:.0%}" for d in self.plan.devices
            ),
        )
        threading.Thread(target=self._reader, args=(self.proc,), name=f"split-{self.config.name}", daemon=True).start()

    def _link_warning(self, probe: Any) -> str:
        """Measure the link to every remote device (a short probe through its gate) and, for a row split, warn
        about any below 10 GbE: row split moves activations at every layer."""
        slow = []
        for d in self.plan.remote():
            gbps = probe(d.endpoint)
            log.info("%s: link to %s (%s) measured at %.2f Gb/s", self.config.name, d.node_id, d.endpoint, gbps)
            if self.plan.mode == "row" and gbps < FAST_LINK_GBPS:
                slow.append(f"{d.node_id} {gbps:.2f} Gb/s")
        if not slow:
            return ""
        why = f"row split over links slower than 10 GbE (measured: {', '.join(slow)}): expect it to be slower than a layer split"
        log.warning("%s: %s", self.config.name, why)
        return why

    # --- jobs ------------------------------------------------------------------------------------

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Any) -> tuple[list[Choice], Usage]:
        return self._call("chat", job, cancel, emit)

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Any) -> tuple[list[Choice], Usage]:
        return self._call("complete", job, cancel, emit)

    def _call(self, op: str, job: Any, cancel: CancelFlag, emit: Any) -> tuple[list[Choice], Usage]:
        if self.lost:
            raise EngineLost(self.lost)
        jid = next(self._ids)
        q: queue.Queue = queue.Queue()
        self._waiting[jid] = q
        cancelled = False
        try:
            _write(self._stdin(), self._lock, {"id": jid, "op": op, "job": encode(job)})
            while True:
                try:
                    msg = q.get(timeout=0.1)
                except queue.Empty:
                    if cancel and not cancelled:
                        cancelled = True
                        _write(self._stdin(), self._lock, {"cancel": jid})
                    continue
                if msg is _DEAD:
                    raise EngineLost(self.lost or "the split model's process ended")
                if "emit" in msg:
                    if emit is not None:
                        emit(*msg["emit"])
                    continue
                if "error" in msg:
                    raise (BadInput if msg.get("bad") else RuntimeError)(msg["error"])
                self._stats = msg.get("stats") or self._stats
                return decode(msg["choices"], list[Choice]), decode(msg["usage"], Usage)
        except (BrokenPipeError, OSError) as exc:
            raise EngineLost(self.lost or f"the split model's process is gone: {exc}") from None
        finally:
            self._waiting.pop(jid, None)

    def _stdin(self) -> IO[bytes]:
        """The child's input; EngineLost when there is no child."""
        if self.proc is None or self.proc.stdin is None:
            raise EngineLost(self.lost or "the split model's process is gone")
        return self.proc.stdin

    def _reader(self, proc: subprocess.Popen[bytes]) -> None:
        while (msg := _read(_stdout(proc))) is not None:
            q = self._waiting.get(msg.get("id", -1))
            if q is not None:
                q.put(msg)
        if not self._closed.is_set():  # ggml aborts the process when an RPC server vanishes: say which one
            code = proc.wait()
            self._lose(self._unreachable(timeout_s=0.5) or f"the split model's process exited ({code})")
        for q in list(self._waiting.values()):
            q.put(_DEAD)

    # --- liveness --------------------------------------------------------------------------------

    def _unreachable(self, timeout_s: float = PROBE_S, only: list[Any] | None = None) -> str:
        """Why the model lost its layers ("" while every remote device answers a connect)."""
        for d in only if only is not None else self.plan.remote():
            host, _, port = d.endpoint.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
            except OSError:
                return f"RPC server {d.endpoint} on node {d.node_id} is unreachable: the model's layers there are gone"
        return ""

    def _supervise(self) -> None:
        """Probe the remote devices every `PROBE_S`: two failures in a row lose the engine. Once lost, wait
        until every RPC server answers again (an RPC node that restarted quickly is never re-placed, its plan
        stays), load the model again, and tell the worker it serves again."""
        fails = {d.endpoint: 0 for d in self.plan.remote()}
        while not self._closed.wait(PROBE_S):
            if self.lost is None:
                for d in self.plan.remote():
                    why = self._unreachable(only=[d])
                    fails[d.endpoint] = fails[d.endpoint] + 1 if why else 0
                    if fails[d.endpoint] >= 2:
                        self._lose(why)
                        break
                continue
            if self._unreachable():
                continue
            try:
                self._start_child()
            except EngineLoadError as exc:  # e.g. the node's gate does not admit us yet: try again
                log.warning("%s: the RPC servers answer again but the model did not load: %s", self.config.name, exc)
                continue
            fails = dict.fromkeys(fails, 0)
            self.lost = None
            log.info("%s: every RPC server answers again; serving", self.config.name)
            if self.on_back is not None:
                self.on_back()

    def _lose(self, why: str) -> None:
        if self.lost or self._closed.is_set() or not why:
            return
        self.lost = why
        log.error("%s: %s", self.config.name, why)
        self._stop_child()
        if self.on_lost is not None:
            self.on_lost(why)

    def _stop_child(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def close(self) -> None:
        self._closed.set()
        if self.proc is not None:
            with contextlib.suppress(OSError):
                if self.proc.stdin is not None:  # the child's end of input: it finishes and exits
                    self.proc.stdin.close()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the child ------------------------------------------------------------------------------------


def _register(endpoints: list[str]) -> None:
    import ctypes

    from coderai.engine_worker.rpc_child import libraries

    ggml, rpc = libraries()
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    for ep in endpoints:
        reg = rpc.ggml_backend_rpc_add_server(ep.encode())
        if not reg:
            raise EngineLoadError(f"cannot add RPC server {ep}")
        ggml.ggml_backend_register(reg)


def _load(cfg: ModelConfig) -> tuple[Any, str]:
    from coderai.engine_worker.engines.llama import LlamaEngine
    from coderai.runtime.gguf_meta import block_count

    plan = cfg.shards
    assert plan is not None
    path = os.path.expanduser(cfg.path)
    n_layers = plan.n_layers or block_count(path)
    if n_layers <= 0:
        raise EngineLoadError(f"cannot read the block count of {path}")
    _register([d.endpoint for d in plan.remote()])
    note = ""

    def engine(row: bool) -> LlamaEngine:
        params = {**cfg.params, **split_params(plan, n_layers, row)}
        e = LlamaEngine(msgspec.structs.replace(cfg, params=params, shards=None))
        e.load()
        return e

    if plan.mode == "row":
        try:
            return engine(True), ""
        except EngineLoadError:
            note = (
                "llama.cpp's RPC backend cannot split rows (its devices offer no split buffers): "
                "serving a layer split instead"
            )
    return engine(False), note


def _stdout(proc: subprocess.Popen[bytes]) -> IO[bytes]:
    """The child's output, a pipe: `_start_child` starts it with stdout=PIPE."""
    assert proc.stdout is not None, "started with stdout=PIPE"
    return proc.stdout


def child_main() -> int:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the libraries print goes to stderr, never into the frames
    inp = sys.stdin.buffer
    lock = threading.Lock()
    init = _read(inp)
    if init is None:
        return 2
    cfg = decode(init["config"], ModelConfig)
    try:
        eng, note = _load(cfg)
    except Exception as exc:  # reported to the worker, which fails the load with it
        _write(out, lock, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _write(out, lock, {"ready": True, "note": note})
    jobs: queue.Queue = queue.Queue()
    flags: dict[int, CancelFlag] = {}

    def read_loop() -> None:
        while (msg := _read(inp)) is not None:
            if "cancel" in msg:
                if (f := flags.get(msg["cancel"])) is not None:
                    f.set()
            else:
                flags[msg["id"]] = CancelFlag()
                jobs.put(msg)
        jobs.put(None)

    threading.Thread(target=read_loop, daemon=True).start()
    while (msg := jobs.get()) is not None:
        jid = msg["id"]
        job = decode(msg["job"], _JOBS[msg["op"]])
        emit = (lambda d, t, f, jid=jid: _write(out, lock, {"id": jid, "emit": [d, t, f]})) if job.stream else None
        try:
            choices, usage = getattr(eng, msg["op"])(job, flags[jid], emit)
            _write(out, lock, {"id": jid, "choices": encode(choices), "usage": encode(usage), "stats": eng.stats()})
        except ValueError as exc:
            _write(out, lock, {"id": jid, "error": str(exc), "bad": True})
        except Exception as exc:  # one job's failure is that job's answer
            _write(out, lock, {"id": jid, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            flags.pop(jid, None)
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
