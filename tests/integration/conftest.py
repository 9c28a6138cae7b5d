"""Whole stacks of real processes: their own nats-server, the session's redis-server, a tiny GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from coderai.gateway.auth import KeyRecord, hash_key, write_keys
from coderai.runtime.embedded import NatsServer
from coderai.testing.stack import Stack, write_models_file

ADMIN_KEY = "sk-test-admin-0123456789"
USER_KEY = "sk-test-user-0123456789"


@pytest.fixture(scope="session")
def admin_key() -> str:
    return ADMIN_KEY


@pytest.fixture(scope="session")
def user_key() -> str:
    return USER_KEY


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    write_keys(str(path), [
        KeyRecord(name="admin", sha256=hash_key(ADMIN_KEY), scopes=["inference", "admin"]),
        KeyRecord(name="alice", sha256=hash_key(USER_KEY), scopes=["inference"]),
    ])
    return path


@pytest.fixture(scope="module")
def api_stack(tmp_path_factory, redis_server, tiny_gguf, keys_file):
    """One worker serving `tiny`; `ghost` is configured but placed nowhere (so it has no engine)."""
    root = tmp_path_factory.mktemp("stack")
    nats = NatsServer(root / "nats").start()
    models = write_models_file(root / "models.toml", [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 1024}},
        {"name": "ghost", "engine": "llama", "path": str(tiny_gguf), "nodes": ["nowhere"]},
        {"name": "coderai-tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},  # README's name
    ])
    stack = Stack(root, nats.url, redis_server.url, extra_env={"CODERAI_GATEWAY_MAX_BODY_BYTES": "65536"})
    try:
        stack.start_core(models)
        stack.start_worker("w1")
        stack.start_gateway("--api-keys-file", str(keys_file))
        stack.wait_model_ready("tiny", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        yield stack
    finally:
        stack.stop()
        nats.stop()
