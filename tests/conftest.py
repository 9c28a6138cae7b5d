"""Session fixtures: a real nats-server (JetStream) and redis-server on random loopback ports, and a tiny GGUF."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from coderai.runtime.embedded import NatsServer, RedisServer


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = NatsServer(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    from coderai.testing.tiny_gguf import build_tiny_gguf

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    build_tiny_gguf(path)
    return path


@pytest.fixture
def unique() -> str:
    """A token for per-test subjects and buckets."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def artifacts(request) -> Path:
    """A folder kept after the run for what a test saves for people to look at (screenshots):
    `$CODERAI_TEST_ARTIFACTS/<test>`, by default `test-artifacts/<test>` in the repository (git ignores it)."""
    import os
    import re

    root = Path(os.environ.get("CODERAI_TEST_ARTIFACTS") or Path(__file__).resolve().parent.parent / "test-artifacts")
    path = root / re.sub(r"[^\w.-]+", "_", request.node.name)
    path.mkdir(parents=True, exist_ok=True)
    return path
