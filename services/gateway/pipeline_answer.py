"""The shapes of a call's answer, the adapters a controller hands its `Call` to once it is built: `answer` for a
whole answer (a JSON body), `relay_stream` for frames relayed as they come (SSE tokens, audio bytes), and
`open_stream` to admit, open and relay in one, with keep-alive comments while the model loads on demand. Each runs
the call's stages in order and leaves it accounted once, whatever happens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from litestar import Request

from coderai.contracts import BusError, Chunk, ErrorReply, Final
from coderai.gateway.errors import ApiError, ClientGone, from_bus
from coderai.gateway.http import until_disconnect
from coderai.gateway.frames import next_frame

if TYPE_CHECKING:
    from coderai.gateway.pipeline import Call


async def answer(
    call: Call, request: Request | None = None, on_chunk: Callable[[Chunk], Awaitable[None]] | None = None
) -> Final:
    """The whole answer, its output's blobs inline, accounted once. With `request`, a client that disconnects
    while it waits cancels the engine job (and the call is accounted as cancelled)."""
    if request is None:
        return await _whole(call, on_chunk)
    return await until_disconnect(request, _whole(call, on_chunk))


async def _whole(call: Call, on_chunk: Callable[[Chunk], Awaitable[None]] | None) -> Final:
    if not call.admitted:
        await call.admit()
    frame = await call.open()
    try:
        while not isinstance(frame, Final):
            if on_chunk is not None:
                await on_chunk(frame)
            frame = await call.next()
        frame = await call.unpacked(frame)
    except BaseException as exc:
        raise await call.fail(exc) from None
    await call.finish(frame)
    return frame


def relay_stream(
    call: Call,
    first: Chunk | Final,
    chunk: Callable[[Chunk], bytes],
    final: Callable[[Final], Awaitable[bytes]],
    error: Callable[[ApiError], bytes] | None = None,
) -> AsyncIterator[bytes]:
    """The frames relayed as they come, each chunk as `chunk` shapes it (an SSE event, audio bytes) and the end
    as `final` does. Headers are gone by the time an engine fails mid-stream: `error` renders the failure as a
    last piece (SSE's error event); without it the stream is cut. A client that leaves cancels the engine job.
    Accounted once, in every case."""

    async def pieces() -> AsyncIterator[bytes]:
        last: Final | None = None
        ended = False
        frame: Any = first
        stream = call.stream
        try:
            while not isinstance(frame, Final):  # per token: `Call.next` inlined
                yield chunk(frame)
                assert stream is not None  # a chunk came on it (a fan-out's answer is one Final)
                frame = await next_frame(stream)
                if isinstance(frame, ErrorReply):
                    raise BusError.from_reply(frame)
            last, ended = frame, True
            tail = await final(frame)
            # accounted before the last bytes go out: its event is journalled, so a gateway killed once the client
            # has the whole answer still has it billed (the next gateway to start sends it); shielded, so a client
            # leaving now does not cut the accounting short (the `finally` below finds it done)
            await asyncio.shield(call.finish(frame))
            yield tail
        except BusError as exc:
            err = from_bus(exc, call.gw.settings.retry_after_s)
            call.status, call.http_status = err.code or "error", err.status
            ended = True
            if error is None:
                raise err from None
            yield error(err)
        finally:
            if not ended:  # the client went away mid-stream (or the stream broke): stop the engine
                call.abandon()
            else:  # may run while the stream's task is being cancelled: detached
                call.finish_detached(last)

    return pieces()


LOADING_KEEPALIVE_S = 5.0  # between the comments of a stream that waits for its model to load


async def open_stream(
    call: Call,
    request: Request,
    chunk: Callable[[Chunk], bytes],
    final: Callable[[Final], Awaitable[bytes]],
    error: Callable[[ApiError], bytes],
    comment: bytes | None,
) -> AsyncIterator[bytes]:
    """Admit, open and `relay_stream`. Errors before the first frame are the client's status code, except while
    the model loads on demand with a `comment` (an SSE comment): then the stream starts at once with it, repeated
    every `LOADING_KEEPALIVE_S` so clients and proxies do not time out, and a failure comes as `error`."""
    await call.admit()
    if comment is None:
        return relay_stream(call, await until_disconnect(request, call.open()), chunk, final, error)
    loading = asyncio.Event()
    call.on_loading = loading.set
    opening = asyncio.ensure_future(call.open())
    told = asyncio.ensure_future(loading.wait())
    try:
        await until_disconnect(request, asyncio.wait({opening, told}, return_when=asyncio.FIRST_COMPLETED))
    except (asyncio.CancelledError, ClientGone):
        opening.cancel()
        raise
    finally:
        told.cancel()
    if opening.done():
        return relay_stream(call, opening.result(), chunk, final, error)

    async def pieces() -> AsyncIterator[bytes]:
        try:
            yield comment  # the response starts now, while the model loads
            while not (await asyncio.wait({opening}, timeout=LOADING_KEEPALIVE_S))[0]:
                yield comment
            try:
                first = opening.result()
            except ApiError as err:
                yield error(err)
                return
            async for piece in relay_stream(call, first, chunk, final, error):
                yield piece
        finally:
            if not opening.done():
                opening.cancel()

    return pieces()
