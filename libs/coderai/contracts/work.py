"""Fan-out: parts of one request on the `WORK` work-queue stream, pulled by every worker holding the model."""

from __future__ import annotations

import msgspec

from coderai.contracts.base import Message, RequestId
from coderai.contracts.jobs import Op


class WorkPart(Message, frozen=True, kw_only=True):
    """Part `part` of `parts` of a request, on `coderai.work.<model_key>.<op>`. The worker that pulls it runs `job`
    (the op's job, JSON) and sends the frames to `reply`, the gateway's inbox for this part; it acks once the part
    is answered, so a part whose worker dies is redelivered to another."""

    request_id: RequestId
    model: str
    op: Op
    part: int
    parts: int
    reply: str
    job: msgspec.Raw


def work_consumer(model: str, op: str) -> str:
    """The durable consumer of `WORK` every holder of `model` shares for `op`."""
    from coderai.contracts.keys import model_key

    return f"work-{model_key(model)}-{op}"


def work_consumers(models: list) -> list[str]:
    """The `WORK` consumers a node holding `models` (ModelConfigs) pulls from: the only ones its rights name.
    Fan-out parts and batch lines of one (model, op) share a consumer."""
    from coderai.contracts.ops import BATCH_OPS, FANOUT_OPS  # ops.py imports the subjects, which import this module

    queued = FANOUT_OPS | BATCH_OPS
    return sorted({work_consumer(m.name, op) for m in models for op in m.serves() if op in queued})

