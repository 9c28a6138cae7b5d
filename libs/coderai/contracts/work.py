"""Fan-out: parts of one request on the `WORK` work-queue stream, pulled by every worker holding the model."""

from __future__ import annotations

import msgspec

from coderai.contracts.base import Message, RequestId
from coderai.contracts.jobs import Op
from coderai.contracts.keys import model_key
from coderai.contracts.models import ModelConfig
from coderai.contracts.ops import BATCH_OPS, FANOUT_OPS


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


ACK_WAIT_S = 5.0  # a part whose worker died (or whose delivery was lost with a head) goes to another this soon
MAX_DELIVER = 3  # a part that failed this many workers fails its request


def consumer_config(consumer: str) -> object:
    """The one config of a shared `WORK` consumer (`work-<model key>-<op>`): the scheduler makes it so before a node
    may pull from it, and a node may only bind it, never change it (a node that could set its delivery settings
    could stall or drop every holder's parts)."""
    from nats.js.api import AckPolicy, ConsumerConfig  # here only: importing the contracts never loads a bus client

    mk, op = consumer.removeprefix("work-").rsplit("-", 1)
    return ConsumerConfig(
        name=consumer,
        durable_name=consumer,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ACK_WAIT_S,
        max_deliver=MAX_DELIVER,
        filter_subject=f"coderai.work.{mk}.{op}",
    )


def work_consumer(model: str, op: str) -> str:
    """The durable consumer of `WORK` every holder of `model` shares for `op`."""
    return f"work-{model_key(model)}-{op}"


def work_consumers(models: list[ModelConfig]) -> list[str]:
    """The `WORK` consumers a node holding `models` (ModelConfigs) pulls from: the only ones its rights name.
    Fan-out parts and batch lines of one (model, op) share a consumer."""
    queued = FANOUT_OPS | BATCH_OPS
    return sorted({work_consumer(m.name, op) for m in models for op in m.serves() if op in queued})
