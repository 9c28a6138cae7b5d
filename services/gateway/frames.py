"""What the gateway reads of an engine's stream of frames: the next real one, keep-alives skipped."""

from __future__ import annotations

import time

from coderai.contracts import BusError, Chunk, ErrorReply, Final, Frame, KeepAlive
from coderai.runtime.bus import FrameStream


async def next_frame(stream: FrameStream, queue_timeout_s: float = 0.0, model: str = "") -> Chunk | Final | ErrorReply:
    """The next frame that is not a keep-alive (keep-alives only prove the engine is alive). With
    `queue_timeout_s`, a job whose keep-alives still say it waits for a slot after that long is an `overloaded`
    BusError (a 503 with Retry-After): the client is told, never left hanging on a queue."""
    start = time.monotonic()
    while True:
        frame = await stream.next(Frame)
        if not isinstance(frame, KeepAlive):
            return frame
        if frame.queued and queue_timeout_s and time.monotonic() - start > queue_timeout_s:
            raise BusError(
                "overloaded",
                f"every slot of {model or 'the model'} stayed busy for {queue_timeout_s:g} s "
                "while this request waited (CODERAI_GATEWAY_QUEUE_TIMEOUT_S); try again later",
            )
