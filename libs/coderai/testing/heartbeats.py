"""A worker's heartbeat as tests write it: only what the test is about, the rest fixed."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from coderai.contracts import Heartbeat


def heartbeat(node: str, capabilities: Iterable[str] = ("llama",), **fields: object) -> Heartbeat:
    """Node `node` on host `node`, version "0", first beat (seq 1) at time 0; any other `Heartbeat` field by name
    (`seq` and `ts` too)."""
    beat = Heartbeat(node_id=node, version="0", seq=1, ts=0.0, host=node, capabilities=list(capabilities))
    return msgspec.structs.replace(beat, **fields)
