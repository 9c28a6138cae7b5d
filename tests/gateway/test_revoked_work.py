"""Work a key started that outlives its request stops when the key is revoked: a video job (its keepalive stops
the job), on a real NATS, and a finished background response is left as it ended. (A running background response:
tests/gateway/test_response_takeover.py; a batch: tests/integration/test_accounts.py; a fine-tuning job:
tests/cluster/test_finetune.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import time
import types

from coderai.gateway.auth import Caller
from coderai.gateway.openai import responses_store
from coderai.gateway.openai.responses_record import StoredResponse
from coderai.gateway.openai.responses_store import Responses
from coderai.gateway.video.takeover import VideoJobs

WHO = Caller("tenant", frozenset({"inference"}))


class _Auth:
    """The key store's answer about one key, switched by the test (the revocation itself is tested on a real
    stack: tests/integration/test_accounts.py)."""

    def __init__(self) -> None:
        self.is_revoked = False
        self.asked = 0

    async def revoked(self, who: Caller) -> bool:
        self.asked += 1
        return self.is_revoked


async def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)  # a poll with a deadline


async def test_a_finished_background_response_is_not_rewritten(bus, monkeypatch, unique):
    monkeypatch.setattr(responses_store, "REVOKE_CHECK_S", 0.05)
    auth = _Auth()
    auth.is_revoked = True
    responses = Responses(types.SimpleNamespace(bus=bus, auth=auth, redis=None))
    rid = f"resp_{unique}"
    await responses.put(
        StoredResponse(
            id=rid,
            owner="tenant",
            created_at=time.time(),
            response={"id": rid, "background": True, "status": "completed"},
        )
    )
    assert await responses._cancelled(rid, await responses._entry(rid)) is None
    assert (await responses._entry(rid))[0].response["status"] == "completed"


async def test_a_revoked_keys_video_job_is_stopped_by_its_keepalive():
    auth = _Auth()
    videos = VideoJobs.__new__(VideoJobs)
    videos.gw, videos.touch_every_s = types.SimpleNamespace(auth=auth), 0.02
    tenure = types.SimpleNamespace(rec=types.SimpleNamespace(id="video_x", updated_at=time.time() + 3600))
    job = asyncio.create_task(asyncio.Event().wait())
    revoked: list[bool] = []
    keep = asyncio.create_task(videos.keepalive(tenure, job, WHO, revoked))
    await _until(lambda: _true(auth.asked >= 2))
    assert not job.done()
    auth.is_revoked = True
    await asyncio.wait_for(keep, 10)
    with contextlib.suppress(asyncio.CancelledError):
        await job
    assert revoked == [True] and job.cancelled()


async def _true(value: bool) -> bool:
    return value
