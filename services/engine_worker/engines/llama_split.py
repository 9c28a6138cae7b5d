"""A GGUF model split over this node's CPU and other nodes' RPC servers: `llama-server --rpc`.

The scheduler hands the serving node a `SplitPlan` (inside the model's config). The model runs on the ordinary
supervised `llama-server` (slots, continuous batching, chat templates, prompt cache, cancel, usage: all the same),
started with the plan's RPC servers and these flags:
- layer split: the first blocks stay on the local CPU; `--n-gpu-layers` = the blocks the remote devices hold
  (llama.cpp offloads the last N), shared between them by `--tensor-split`;
- row split: `--split-mode row` over the devices. llama.cpp's RPC backend offers no split buffers (the server
  refuses a row split with "device RPC0 does not support split buffers"); the engine then starts a layer split
  and says so, and the worker logs it.
Each remote server runs only while its node admits this one (rpc.RpcService). The supervisor connects to each
remote endpoint on every poll; two failures in a row stop the server at once and mark the engine lost, naming
the node, so the model stops taking requests (callers get a clear 503) and the scheduler re-places it. When an
RPC server goes away mid-computation, ggml aborts the server, with the same outcome. If the RPC servers answer
again before the model is re-placed (a node that restarted within the heartbeat TTL keeps its plan), the
supervisor's restart loads the model again by itself and the engine serves again.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, Usage
from coderai.contracts.split import SplitDevice, SplitPlan
from coderai.engine_worker.engines.base import CancelFlag, EngineLoadError, EngineLost
from coderai.engine_worker.engines.child_server import EXIT_TAIL_CHARS
from coderai.engine_worker.engines.llama_server import LlamaServerEngine
from coderai.engine_worker.engines.openai_server import Emit

log = logging.getLogger("coderai.engine_worker.split")

PROBE_S = 1.0
ADMIT_WAIT_S = 30.0
FAST_LINK_GBPS = 10.0
ROW_REFUSED = "split buffers"
# what the in-process engine's params mean on the server, for a split model whose models file says engine "llama"
IN_PROCESS_ONLY = frozenset(
    {"chat_format", "use_mmap", "use_mlock", "offload_kqv", "type_k", "type_v", "verbose", "logits_all",
     "pooling_type", "split_mode", "tensor_split", "n_gpu_layers"}
)  # fmt: skip


def split_params(plan: SplitPlan, n_layers: int, row: bool) -> dict[str, Any]:
    """llama-server's params for `plan` on a model of `n_layers` blocks (remote devices given to `--rpc` in plan
    order, so the server's device i is `plan.remote()[i]`)."""
    remote = plan.remote()
    shares = [d.share for d in remote]
    total = sum(shares) or 1.0
    tensor_split = ",".join(f"{s / total:.6g}" for s in shares)
    if row:
        return {"n_gpu_layers": -1, "split_mode": "row", "tensor_split": tensor_split}
    if all(d.layers for d in remote) and sum(len(d.layers) for d in plan.devices) == n_layers:
        offloaded = sum(len(d.layers) for d in remote)
    else:
        offloaded = round(n_layers * sum(shares) / (sum(d.share for d in plan.devices) or 1.0))
    offloaded = max(1, min(n_layers, offloaded))
    return {"n_gpu_layers": offloaded, "split_mode": "layer", "tensor_split": tensor_split}


def on_server(config: ModelConfig) -> ModelConfig:
    """A split model as llama-server runs it: one whose models file says the in-process engine ("llama") keeps
    the params both take."""
    if config.engine == "llama-server":
        return config
    dropped = sorted(k for k in config.params if k in IN_PROCESS_ONLY)
    if dropped:
        log.warning("%s: a split model runs on llama-server, which does not take %s", config.name, ", ".join(dropped))
    params = {k: v for k, v in config.params.items() if k not in IN_PROCESS_ONLY}
    return msgspec.structs.replace(config, engine="llama-server", params=params)


class SplitServerEngine(LlamaServerEngine):
    """llama-server with the plan's RPC servers; lost when one stops answering, back when they all answer."""

    label = "llama-server (split)"

    def __init__(self, config: ModelConfig) -> None:
        if config.shards is None:
            raise EngineLoadError(f"{config.name} has no split plan")
        self.plan: SplitPlan = config.shards
        self.row = self.plan.mode == "row"
        self.note = ""
        self.n_layers = self.plan.n_layers
        self._fails: dict[str, int] = {}
        self._gone = ""  # why the supervisor stopped the server (an RPC server that stopped answering)
        super().__init__(on_server(config))

    def server_config(self) -> ModelConfig:
        own = super().server_config()  # a fine-tuned model's base GGUF
        params = {**own.params, **split_params(self.plan, self.n_layers, self.row)}
        return msgspec.structs.replace(own, params=params, shards=None)

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        cmd, env = super().command(port)
        # an abort (an RPC server gone mid-computation) must not wait for gdb to print a backtrace
        return [*cmd, "--rpc", ",".join(d.endpoint for d in self.plan.remote())], {**env, "GGML_NO_BACKTRACE": "1"}

    def load(self) -> None:
        from coderai.engine_worker.rpc import link_gbps
        from coderai.runtime.gguf_meta import block_count

        path = self.model_file()
        self.n_layers = self.n_layers or block_count(path)
        if self.n_layers <= 0:
            raise EngineLoadError(f"cannot read the block count of {path}")
        self.warning = link_warning(self.config.name, self.plan, link_gbps)
        try:
            self._start()
        except EngineLoadError as exc:
            if not self.row or ROW_REFUSED not in str(exc):
                raise
            self.row = False
            self.note = (
                "llama.cpp's RPC backend cannot split rows (its devices offer no split buffers): "
                "serving a layer split instead"
            )
            log.warning("%s: %s", self.config.name, self.note)
            self.warning = "; ".join(w for w in (self.warning, self.note) if w)
            self._start()
        log.info(
            "%s split over %s",
            self.config.name,
            ", ".join(
                f"{d.node_id}{'@' + d.endpoint if d.endpoint else ' (local)'} {d.share:.0%}" for d in self.plan.devices
            ),
        )

    def _start(self) -> None:
        """Start the server. The nodes read the same assignment each on its own, so an RPC node may not have let
        this one in yet (its gate refuses, and ggml aborts the load): that is tried again for up to
        `ADMIT_WAIT_S`, anything else fails at once."""
        end, pause = time.monotonic() + ADMIT_WAIT_S, 0.25
        while True:
            try:
                return super().load()
            except EngineLoadError as exc:
                if "ggml-rpc" not in str(exc) or time.monotonic() + pause > end:
                    raise
                log.info("%s: not let in by an RPC server yet; trying again", self.config.name)
            time.sleep(pause)  # the engine's own thread, loading
            pause = min(2.0, pause * 2)

    def supervise(self, on_alive: Callable[[httpx.Client], None] | None = None) -> None:
        def alive(probe: httpx.Client) -> None:
            self._watch_rpc()
            if on_alive is not None:
                on_alive(probe)

        super().supervise(on_alive=alive)

    def _watch_rpc(self) -> None:
        """Two failed connects in a row to a remote device stop the server: its layers there are gone."""
        for d in self.plan.remote():
            why = unreachable(d)
            self._fails[d.endpoint] = self._fails.get(d.endpoint, 0) + 1 if why else 0
            if self._fails[d.endpoint] >= 2:
                self._gone = why
                self._fails.clear()
                proc = self.child.proc
                if proc is not None and proc.poll() is None:
                    proc.kill()
                return

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        try:
            return super().chat(job, cancel, emit)
        except EngineLost as exc:
            raise EngineLost(self._rpc_gone() or str(exc)) from exc

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        try:
            return super().complete(job, cancel, emit)
        except EngineLost as exc:
            raise EngineLost(self._rpc_gone() or str(exc)) from exc

    def _rpc_gone(self) -> str:
        """Which RPC server took the server down, from what ggml said before it aborted ("" if not one)."""
        tail = self.child.log_tail(EXIT_TAIL_CHARS)
        if "ggml-rpc" not in tail:
            return ""
        remote = self.plan.remote()
        named = [d for d in remote if f"connect to {d.endpoint}" in tail]
        if not named:  # "Remote RPC server crashed": the one that no longer answers, or the only one
            named = [d for d in remote if unreachable(d, timeout_s=0.5)] or (remote if len(remote) == 1 else [])
        return gone(named[0]) if named else "an RPC server of the split is gone: the model's layers there are gone"

    def _lost(self, why: str) -> None:
        reason, self._gone = self._gone or self._rpc_gone(), ""
        super()._lost(f"{reason} ({why.splitlines()[0]})" if reason else why)


def unreachable(d: SplitDevice, timeout_s: float = PROBE_S) -> str:
    """Why the model lost its layers on `d` ("" while it answers a connect)."""
    host, _, port = d.endpoint.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError:
        return gone(d)
    return ""


def gone(d: SplitDevice) -> str:
    return f"RPC server {d.endpoint} on node {d.node_id} is unreachable: the model's layers there are gone"


def link_warning(name: str, plan: SplitPlan, probe: Callable[[str], float]) -> str:
    """Measure the link to every remote device (a short probe through its gate) and, for a row split, warn about
    any below 10 GbE: row split moves activations at every layer."""
    slow = []
    for d in plan.remote():
        gbps = probe(d.endpoint)
        log.info("%s: link to %s (%s) measured at %.2f Gb/s", name, d.node_id, d.endpoint, gbps)
        if plan.mode == "row" and gbps < FAST_LINK_GBPS:
            slow.append(f"{d.node_id} {gbps:.2f} Gb/s")
    if not slow:
        return ""
    why = f"row split over links slower than 10 GbE (measured: {', '.join(slow)}): expect it to be slower than a layer split"
    log.warning("%s: %s", name, why)
    return why
