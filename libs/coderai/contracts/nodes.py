"""Node liveness and desired placement: heartbeats, node records, assignments."""

from __future__ import annotations

from typing import Literal

from coderai.contracts.base import Message
from coderai.contracts.jobs import Op
from coderai.contracts.models import ModelConfig
from coderai.contracts.split import RpcServer

EVICTED_MAX = 256
"""Affinity keys one engine's heartbeat may say its cache dropped; the router reads no more than these."""

EngineState = Literal["loading", "ready", "failed", "unloading", "draining"]


class EngineStatus(Message, frozen=True, kw_only=True):
    """One engine on a node: a loaded (or loading) model and how busy it is."""

    engine_id: str
    model: str
    engine: str
    ops: list[Op]
    state: EngineState
    in_flight: int = 0
    served: int = 0
    error: str | None = None
    warning: str = ""  # how it runs is not as good as asked (e.g. a row split over a slow link)
    prompt_tokens: int = 0  # prompt tokens received since load
    cached_tokens: int = 0  # of those, tokens whose KV came from the cache instead of being computed
    prefix_hits: int = 0  # requests that reused a cached prefix
    cache_bytes: int = 0  # memory the prompt cache holds now
    head_saves: int = 0  # prompt heads saved as snapshots (llama-server, prompt_heads)
    head_restores: int = 0  # requests that had a head snapshot restored into their slot instead of prefilling it
    slots: int = 0  # requests the engine runs at once (llama-server's --parallel); 0: not reported
    slots_busy: int = 0  # of those, running now
    queued: int = 0  # requests the engine holds waiting for a slot
    kv_used: float = 0.0  # share of its KV cache its running requests hold (0..1), as the server says; 0: not known
    backend: str = ""  # where its layers run: "cpu", "cuda", ... ("" not reported)
    gpu_layers: int = 0  # layers offloaded to the GPU
    idle_s: float = 0.0  # seconds since its last job ended (or since it loaded); 0 while a job runs
    keep_alive_s: float | None = (
        None  # idle seconds before it may be unloaded, as the last request set it (None: the model's)
    )
    memory: int = 0  # bytes this copy was placed for (the scheduler's estimate)
    devices: list[int] = []  # the GPUs it was started on (indices on the node); [] the engine's default or the CPU
    # affinity keys (a job's cache_keys) whose prompt the engine's cache dropped since the last heartbeat, as its
    # server reports its cache (vLLM's KV events): the router forgets them for this engine (it reads EVICTED_MAX)
    evicted: list[str] = []


class GpuMemory(Message, frozen=True, kw_only=True):
    """One GPU's memory, in bytes."""

    total: int
    free: int


class Heartbeat(Message, frozen=True, kw_only=True):
    """Published by every worker every ~2 s; also what the scheduler stores in `coderai_nodes`."""

    node_id: str
    version: str
    seq: int
    ts: float
    host: str
    capabilities: list[str]
    engines: list[EngineStatus] = []
    in_flight: int = 0
    mem_total: int = 0
    mem_free: int = 0
    vram_total: int = 0
    vram_free: int = 0
    pod: str = ""  # a rented pod's name: its models come with it, the scheduler places nothing on it
    addrs: list[str] = []  # the node's network addresses, the one it reaches the bus from first (loopback left out)
    rpc: RpcServer | None = None  # a ggml RPC server this node offers to hold layers of others' models
    gpus: int = 0  # GPUs this node has (vLLM runs one rank on each; a CPU-only node runs one rank)
    gpu_memory: list[GpuMemory] = []  # per GPU, in device order (vram_total/vram_free are their sums)
    gpu_api: str = ""  # how those GPUs are driven: "cuda" (NVIDIA), "vulkan" (AMD, Intel: llama.cpp's Vulkan build)
    stored: list[str] = []  # store paths of the model files this node fetched from the head (placement prefers them)
    mem_budget: int = 0  # bytes of RAM the operator lets models use here (CODERAI_WORKER_MEMORY_BUDGET_MB); 0: 90 %
    # sensors over the worker's temperature limit, with their last reading (°C): a GPU's index ("0"), or "node" for
    # the machine; the engines they hold report `draining` until they cool (empty, and left out, while none is hot)
    hot: dict[str, float] = {}
    # the worker is stopping (SIGTERM): its engines take no new work, and this heartbeat, and any after it, are its
    # last; the first one heard is when it was told (the pod broker bills a preempted pod to it)
    leaving: bool = False


class Assignment(Message, frozen=True, kw_only=True):
    """What one node should have loaded; the worker watches its own key and converges on it."""

    node_id: str
    models: list[ModelConfig] = []
    rpc_peers: list[str] = []  # addresses allowed through this node's RPC gate: the nodes serving split models
    fence: int = 0  # the writing scheduler's fencing token (runtime/leader.py); the worker refuses an older one
