"""What a node's heartbeat may claim: engines for the models it was given, under the ids a worker gives them.
The router (whom to send requests) and the scheduler (residency, a video's stages, a fine-tune's holders, and the
node records behind `/admin/nodes`, `/v1/models` and `/api/ps`) both believe a heartbeat only this far."""

from __future__ import annotations

import msgspec

from coderai.contracts.keys import model_key
from coderai.contracts.nodes import EngineStatus, Heartbeat


def claim_fault(node_id: str, e: EngineStatus, placed: frozenset[str] | None, held_by: str | None = None) -> str:
    """Why the engine `e` that node `node_id` reports cannot be believed ("" when it can): its model is not in
    `placed` (what the scheduler's assignment, or the pod broker's lease, gives the node; None: unchecked), its
    id is not the one a worker gives that model's engine, or another node's engine holds that id (`held_by`)."""
    if placed is None:
        return ""
    if e.model not in placed:
        return f"an engine for model {e.model!r}, which is not placed on it"
    try:
        expected = f"{node_id}-{model_key(e.model)}"
    except ValueError:
        return "an engine with no model"
    if e.engine_id != expected:
        return f"engine id {e.engine_id!r} for model {e.model!r} (a worker calls it {expected!r})"
    if held_by is not None and held_by != node_id:
        return f"engine id {e.engine_id!r}, which node {held_by!r} holds"
    return ""


def believed(hb: Heartbeat, placed: frozenset[str]) -> tuple[Heartbeat, list[tuple[EngineStatus, str]]]:
    """`hb` with only the engines it may claim, given the models `placed` on its node; and the others, with why."""
    kept: list[EngineStatus] = []
    refused: list[tuple[EngineStatus, str]] = []
    for e in hb.engines:
        why = claim_fault(hb.node_id, e, placed)
        if why:
            refused.append((e, why))
        else:
            kept.append(e)
    return (hb if not refused else msgspec.structs.replace(hb, engines=kept)), refused
