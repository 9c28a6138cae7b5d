"""JetStream object stores: bound, or made when missing, with a cap the server's disk can hold."""

from __future__ import annotations

import logging
from typing import Any

from coderai.contracts.topology import BucketSpec

log = logging.getLogger("coderai.bus")

INSUFFICIENT_STORAGE = 10047  # JetStream's error code: a stream or store asks for more than the server may keep


async def object_store(js: Any, spec: BucketSpec, *, create: bool = False, max_bytes: int = 0) -> Any:
    """Bind the object store `spec` names (`BLOBS`, `FILES`). Missing: created with its spec's TTL and
    description and at most `max_bytes` (0: no cap) when `create`, else nats-py's BucketNotFoundError."""
    from nats.js.api import ObjectStoreConfig
    from nats.js.errors import BadRequestError, BucketNotFoundError, ServerError

    try:
        return await js.object_store(spec.name)
    except BucketNotFoundError:
        if not create:
            raise
    while True:
        cfg = ObjectStoreConfig(bucket=spec.name, ttl=spec.ttl_s or None, description=spec.description,
                                max_bytes=max_bytes or None)
        try:
            return await js.create_object_store(spec.name, config=cfg)
        except ServerError as exc:
            # nats-server refuses a cap over its store limit (by default 75 % of the free disk): on a small
            # disk the store is made with half the cap, down to 64 MiB, rather than not at all
            if exc.err_code != INSUFFICIENT_STORAGE or not max_bytes or max_bytes // 2 < 64 << 20:
                raise
            log.warning("the %s store's cap of %d MiB does not fit this server's disk; trying %d MiB",
                        spec.name, max_bytes >> 20, max_bytes >> 21)
            max_bytes //= 2
        except BadRequestError as exc:  # another service created it a moment ago, with other limits: bind it
            log.debug("create_object_store %s: %s", spec.name, exc)
            try:
                return await js.object_store(spec.name)
            except BucketNotFoundError:
                raise exc from None
