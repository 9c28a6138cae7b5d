"""Every `request.completed` the EVENTS stream holds, read back whole: what usage, spend and Prometheus were built
from (for the tests and the soak, which match them against what their clients saw)."""

from __future__ import annotations

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from coderai.contracts import RequestCompleted
from coderai.contracts.base import decode
from coderai.contracts.subjects import EVT_REQUEST_COMPLETED
from coderai.contracts.topology import EVENTS


async def read_completed(nats_url: str, batch: int = 1000) -> list[RequestCompleted]:
    """The stream's `request.completed` events, oldest first, through an ephemeral consumer without acks (so no
    bound on unacked messages), up to the last one stored when the consumer was made."""
    nc = await nats.connect(nats_url, connect_timeout=5, allow_reconnect=False)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe(
            EVT_REQUEST_COMPLETED(), stream=EVENTS.name, config=ConsumerConfig(ack_policy=AckPolicy.NONE)
        )
        left = (await sub.consumer_info()).num_pending or 0
        out: list[RequestCompleted] = []
        while len(out) < left:
            msgs = await sub.fetch(batch=min(batch, left - len(out)), timeout=5)
            out += [decode(m.data, RequestCompleted) for m in msgs]
        await sub.unsubscribe()
        return out
    finally:
        await nc.close()
