"""Whole stacks of real processes: their own nats-server, the session's redis-server, a tiny GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.stack import running_stack

ADMIN_KEY = "sk-test-admin-0123456789"
USER_KEY = "sk-test-user-0123456789"
OTHER_USER_KEY = "sk-test-bob-0123456789"  # a second tenant


@pytest.fixture(scope="session")
def admin_key() -> str:
    return ADMIN_KEY


FILE_QUOTA = 300_000
FILE_COUNT = 8  # files one key may keep
BATCHES_PER_KEY = 2  # batches one key may run at once
"""Bytes of files one key may keep in the shared stack (test_api checks the quota)."""


@pytest.fixture(scope="session")
def user_key() -> str:
    return USER_KEY


@pytest.fixture(scope="session")
def other_user_key() -> str:
    return OTHER_USER_KEY


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    write_keys(
        str(path),
        [
            KeyRecord(name="admin", sha256=hash_key(ADMIN_KEY), scopes=["inference", "admin"]),
            KeyRecord(name="alice", sha256=hash_key(USER_KEY), scopes=["inference"]),
            KeyRecord(name="bob", sha256=hash_key(OTHER_USER_KEY), scopes=["inference"]),
        ],
    )
    return path


@pytest.fixture(scope="module")
def api_stack(tmp_path_factory, redis_server, tiny_gguf, keys_file):
    """One worker serving `tiny`; `ghost` is configured but placed nowhere (so it has no engine)."""
    models = [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 1024}},
        {"name": "ghost", "engine": "llama", "path": str(tiny_gguf), "nodes": ["nowhere"]},
        {"name": "coderai-tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},  # README's name
    ]
    with running_stack(
        tmp_path_factory.mktemp("stack"),
        models,
        gateway_args=("--api-keys-file", str(keys_file)),
        redis_url=redis_server.url,
        extra_env={
            "CODERAI_GATEWAY_MAX_BODY_BYTES": "65536",
            "CODERAI_GATEWAY_FILE_QUOTA_BYTES": str(FILE_QUOTA),
            "CODERAI_GATEWAY_FILE_QUOTA_COUNT": str(FILE_COUNT),
            "CODERAI_GATEWAY_BATCHES_PER_KEY": str(BATCHES_PER_KEY),
        },
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    ) as stack:
        yield stack


@pytest.fixture
def admin(stack, admin_key):
    """An httpx client with the admin key on the module's `stack` (a module with another stack has its own)."""
    import httpx

    with httpx.Client(base_url=stack.http_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Debian's headless Chromium, one per test module (see coderai.testing.browser)."""
    from coderai.testing.browser import chromium, missing

    if why := missing():
        pytest.skip(why)
    with chromium(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver
