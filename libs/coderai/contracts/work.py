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

