"""One llama.cpp model over several machines: RPC servers that nodes offer, and the split the scheduler picks.

A worker started with an RPC server announces it in its heartbeat (`RpcServer`). A llama model that fits no
single node (or whose config names `rpc_nodes`) is given to one serving node together with a `SplitPlan`: the
devices that hold its layers, each with its share. A vLLM model with more tensor x pipeline parallel ranks than
one node has is planned the same way (`mode = "ray"`): the serving node heads a Ray cluster that the other
nodes of the plan join, and vLLM runs its ranks over it. The plan travels inside the model's config in that node's
assignment (`ModelConfig.shards`), so a changed plan reloads the model like any other config change.
"""

from __future__ import annotations

from typing import Literal

from coderai.contracts.base import Message

SplitMode = Literal["layer", "row"]


class RpcServer(Message, frozen=True, kw_only=True):
    """A ggml RPC server a node offers: where to reach it and what its device has."""

    endpoint: str  # host:port on the cluster interface (the node's access gate, never 0.0.0.0)
    device: str = "CPU"  # the ggml device it exposes
    mem_total: int = 0
    mem_free: int = 0


class SplitDevice(Message, frozen=True, kw_only=True):
    """One device holding part of a model: the serving node's own (`endpoint` empty) or a remote RPC server;
    for a Ray plan, one node and the address it joins the Ray cluster from."""

    node_id: str
    endpoint: str = ""
    share: float  # fraction of the model's layers (layer split) or rows (row split) on this device
    layers: list[int] = []  # the block indices it holds (layer split), for the admin view
    ranks: int = 0  # vLLM or SGLang ranks (one per GPU, one on a CPU-only node) it runs: ray and ranks plans only


class SplitPlan(Message, frozen=True, kw_only=True):
    # ray: vLLM over a Ray cluster; ranks: SGLang, each node its `--node-rank` of `--nnodes`
    mode: SplitMode | Literal["ray", "ranks"] = "layer"
    devices: list[SplitDevice]  # the serving node's own device first
    n_layers: int = 0  # blocks in the model, when the scheduler could read them from the GGUF
    warning: str = ""  # e.g. row split over a link slower than 10 GbE

    def remote(self) -> list[SplitDevice]:
        return [d for d in self.devices if d.endpoint]
