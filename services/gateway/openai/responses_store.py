"""Stored responses (`store: true`): one record per response in the `coderai_responses` KV bucket, for 30 days.

A record holds its owner (the key name), the response object as the client saw it last, the input items it was
made from (for `input_items`) and the conversation as chat messages (output included), which is what a
`previous_response_id` continues. Another key's record is as unknown as one that never was; an admin key sees all.
Background responses also run here: as tasks of this gateway process, their record written as they go and touched
while they run (`takeover.keepalive`). One whose gateway stopped (its record untouched for `LOST_S`) is marked failed
by the first read after that, so a client polling it learns it ended instead of waiting on it forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import msgspec

from coderai.contracts import encode
from coderai.contracts.topology import RESPONSES
from coderai.gateway.auth import Caller
from coderai.gateway.errors import ApiError
from coderai.gateway.openai.files import mine
from coderai.gateway.openai.responses_record import RUNNING, ResponseTenure, StoredResponse, not_found
from coderai.gateway.takeover import keepalive, runner_id
from coderai.gateway.state import Gateway

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

log = logging.getLogger("coderai.gateway")

REVOKE_CHECK_S = 5.0
"""How often a running background response's key is asked after (one Redis read): a revoked key's work stops; its
record is touched as often."""
LOST_S = 60.0
"""A queued or running background response whose record was not touched this long lost its gateway."""

KEEP_S = 30 * 24 * 3600  # the bucket's TTL: a record older than this is gone, and no longer counts
QUOTA = "coderai:responses:{}"  # per key: a sorted set of its stored response ids by time, and a hash id -> bytes


class Responses:
    """The bucket (bound once per process) and the background responses this process runs. With Redis, each key's
    stored responses are counted (`QUOTA`), so one key cannot fill JetStream with them."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._kv: KeyValue | None = None
        self.tasks: dict[str, asyncio.Task] = {}
        self.owners: dict[str, str] = {}  # a running background response's id -> its key
        self.me = runner_id(getattr(getattr(gw, "settings", None), "node_id", ""))

    async def _kept(self, owner: str) -> tuple[int, int]:
        """(how many, how many bytes) of stored responses `owner` keeps, the expired ones forgotten first."""
        redis, ids, sizes = self.gw.redis, QUOTA.format(owner), QUOTA.format(owner) + ":bytes"
        old = await redis.zrangebyscore(ids, "-inf", time.time() - KEEP_S)
        if old:
            await redis.zrem(ids, *old)
            await redis.hdel(sizes, *old)
        return await redis.zcard(ids), sum(int(v) for v in await redis.hvals(sizes))

    async def admit(self, who: Caller, background: bool) -> None:
        """429 before any work when the key keeps as many stored responses (or bytes of them) as it may, or runs
        as many background responses in this process."""
        s = self.gw.settings
        if (
            background
            and s.background_per_key
            and sum(o == who.key_name for o in self.owners.values()) >= s.background_per_key
        ):
            raise ApiError(
                429,
                f"This key runs {s.background_per_key} background responses already; wait for one to finish.",
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(s.retry_after_s)},
            )
        if self.gw.redis is None or not (s.responses_quota_count or s.responses_quota_bytes):
            return
        count, size = await self._kept(who.key_name)
        if (s.responses_quota_count and count >= s.responses_quota_count) or (
            s.responses_quota_bytes and size >= s.responses_quota_bytes
        ):
            raise ApiError(
                429,
                f"This key keeps {count} stored responses ({size} bytes), its quota; delete some, or "
                "send store: false.",
                type="insufficient_quota",
                code="responses_quota_exceeded",
            )

    async def _note(self, rec: StoredResponse, size: int) -> None:
        if self.gw.redis is not None:
            ids = QUOTA.format(rec.owner)
            await self.gw.redis.zadd(ids, {rec.id: rec.created_at})
            await self.gw.redis.hset(ids + ":bytes", rec.id, size)

    async def kv(self) -> KeyValue:
        kv = self._kv
        if kv is None:
            kv = self._kv = await self.gw.bus.kv(RESPONSES)
        return kv

    async def _entry(self, resp_id: str) -> tuple[StoredResponse, int] | None:
        from nats.js.errors import KeyNotFoundError

        if not resp_id.startswith("resp_") or not resp_id[5:].isalnum():
            return None
        try:
            entry = await (await self.kv()).get(resp_id)
        except KeyNotFoundError:
            return None
        if entry is None or not entry.value:
            return None
        assert entry.revision is not None  # an entry read from the bucket has its revision
        return msgspec.json.decode(entry.value, type=StoredResponse), entry.revision

    async def get(self, who: Caller, resp_id: str) -> StoredResponse:
        """The caller's stored response `resp_id`, else a 404."""
        found = await self._entry(resp_id)
        if found is None or not mine(who, found[0].owner):
            raise not_found(resp_id)
        return await self._unless_lost(*found)

    async def _unless_lost(self, rec: StoredResponse, revision: int) -> StoredResponse:
        """`rec`, or, when it is a background response whose gateway stopped touching it `LOST_S` ago, `rec` marked
        failed (one revision-checked write: a runner that was only slow learns at its next touch that it ended)."""
        from nats.js.errors import KeyWrongLastSequenceError

        if not rec.runner or rec.response.get("status") not in RUNNING or time.time() - rec.updated_at < LOST_S:
            return rec
        error = {
            "code": "server_error",
            "message": "The gateway running this background response stopped before it "
            "finished; nothing was billed. Create it again.",
        }
        failed = msgspec.structs.replace(
            rec, response={**rec.response, "status": "failed", "error": error}, runner="", updated_at=time.time()
        )
        try:
            await (await self.kv()).update(rec.id, encode(failed), last=revision)
        except KeyWrongLastSequenceError:  # touched or ended meanwhile: as it is now
            found = await self._entry(rec.id)
            return found[0] if found is not None else rec
        log.warning(
            "background response %s: its gateway %s stopped touching it %.0f s ago; marked failed",
            rec.id,
            rec.runner,
            time.time() - rec.updated_at,
        )
        return failed

    async def prior(self, who: Caller, resp_id: str) -> StoredResponse:
        """The response a `previous_response_id` continues; OpenAI's 400 previous_response_not_found if the caller
        has none by that id (unknown, expired, deleted or another key's)."""
        try:
            rec = await self.get(who, resp_id)
        except ApiError:
            rec = None
        if rec is None or rec.response.get("status") not in ("completed", "incomplete"):
            raise ApiError(
                400,
                f"Previous response with id '{resp_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return rec

    async def put(self, rec: StoredResponse) -> int:
        """Store `rec`; its revision."""
        data = encode(rec)
        revision = await (await self.kv()).put(rec.id, data)
        await self._note(rec, len(data))
        return revision

    async def update(
        self,
        resp_id: str,
        response: dict[str, Any],
        messages: list[dict[str, Any]] | None = None,
        *,
        unless_cancelled: bool = True,
        runner: str = "",
    ) -> bool:
        """Write a background response's new state, unless it was cancelled meanwhile (compare-and-set on the
        revision, so a cancel from another gateway process is never overwritten), or, from `runner`, unless it is
        no longer that runner's (found lost and failed). Whether it was written."""
        from nats.js.errors import KeyWrongLastSequenceError

        for _ in range(5):
            found = await self._entry(resp_id)
            if found is None:
                return False  # deleted meanwhile
            rec, rev = found
            if (unless_cancelled and rec.response.get("status") == "cancelled") or (runner and rec.runner != runner):
                return False
            new = msgspec.structs.replace(rec, response=response, messages=messages or rec.messages)
            data = encode(new)
            try:
                await (await self.kv()).update(resp_id, data, last=rev)
                await self._note(new, len(data))
                return True
            except KeyWrongLastSequenceError:
                continue
        return False

    async def delete(self, who: Caller, resp_id: str) -> None:
        rec = await self.get(who, resp_id)
        task = self.tasks.pop(resp_id, None)
        if task is not None:
            task.cancel()
        await (await self.kv()).delete(resp_id)
        if self.gw.redis is not None:
            await self.gw.redis.zrem(QUOTA.format(rec.owner), resp_id)
            await self.gw.redis.hdel(QUOTA.format(rec.owner) + ":bytes", resp_id)

    def run(self, tenure: ResponseTenure, work: Awaitable[None], who: Caller | None = None) -> None:
        """Run a background response's `work` as a task of this process (kept until done, cancellable). While it
        runs, its record is touched (`tenure`) and `who`'s key is asked after, every `REVOKE_CHECK_S`: revoked, the
        response is cancelled; ended elsewhere (cancelled through another gateway, found lost), the work stops."""
        resp_id = tenure.rec.id

        async def revoked() -> bool:
            if who is None or not await self.gw.auth.revoked(who):
                return False
            log.info("background response %s: key %s was revoked; cancelling it", resp_id, who.key_name)
            found = await self._entry(resp_id)
            if found is not None:
                await self._cancelled(resp_id, found)
            return True

        async def guarded() -> None:
            me = asyncio.current_task()
            assert me is not None  # guarded runs as a task (below)
            keep = asyncio.create_task(keepalive(tenure, me, REVOKE_CHECK_S, "background response", revoked))
            try:
                await work
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # the outermost edge of a task nobody awaits
                log.warning("background response %s failed: %s", resp_id, exc)
            finally:
                keep.cancel()
                self.tasks.pop(resp_id, None)
                self.owners.pop(resp_id, None)

        self.tasks[resp_id] = asyncio.create_task(guarded())

    async def cancel(self, who: Caller, resp_id: str) -> dict[str, Any]:
        """Cancel a background response: its status becomes cancelled and its engine job stops (when it runs in
        this process; in another, its result is dropped when it ends). Cancelling a finished one is a no-op."""
        rec = await self.get(who, resp_id)
        if not rec.response.get("background"):
            raise ApiError(
                400, "Only a background response can be cancelled.", param="response_id", code="invalid_request"
            )
        if rec.response.get("status") not in RUNNING:
            return rec.response
        found = await self._entry(resp_id)
        body = await self._cancelled(resp_id, found) if found is not None else None
        return body if body is not None else (await self.get(who, resp_id)).response

    async def _cancelled(self, resp_id: str, found: tuple[StoredResponse, int]) -> dict[str, Any] | None:
        """The record (`found`: it and its revision) marked cancelled and its task here stopped; None when it
        changed meanwhile (it finished: what it became stands)."""
        from nats.js.errors import KeyWrongLastSequenceError

        rec, revision = found
        if rec.response.get("status") not in ("queued", "in_progress"):
            return None
        body = {**rec.response, "status": "cancelled", "completed_at": None}
        try:
            await (await self.kv()).update(resp_id, encode(msgspec.structs.replace(rec, response=body)), last=revision)
        except KeyWrongLastSequenceError:
            return None
        task = self.tasks.pop(resp_id, None)
        if task is not None:
            task.cancel()
        return body
