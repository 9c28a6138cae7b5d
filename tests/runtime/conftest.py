"""What the runtime tests share: a bus on the session's nats-server."""

from __future__ import annotations

import pytest

from coderai.runtime.bus import Bus


@pytest.fixture
async def bus(nats_server):
    b = await Bus.connect(nats_server.url, "test")
    yield b
    await b.close()
