"""Pure placement: which node should load which model."""

from __future__ import annotations

from coderai.contracts import Assignment, Heartbeat, ModelConfig


def plan(models: list[ModelConfig], nodes: dict[str, Heartbeat]) -> dict[str, Assignment]:
    """Every model goes to every live node that runs its engine family, or only to the nodes it names.

    Memory-aware placement and escalation come with the scheduler's own issues; this is the rule that
    keeps a single box and a small uniform cluster working.
    """
    out: dict[str, Assignment] = {}
    for node_id, hb in sorted(nodes.items()):
        caps = set(hb.capabilities)
        chosen = [m for m in models if m.engine in caps and (not m.nodes or node_id in m.nodes)]
        out[node_id] = Assignment(node_id=node_id, models=chosen)
    return out
