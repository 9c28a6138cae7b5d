"""The fake Hugging Face Hub (coderai.testing.fake_hub) as fixtures."""

from __future__ import annotations

import os

import pytest

from coderai.testing.fake_hub import CHUNK, FakeHub, hub_env
from coderai.testing.fake_hub import blob as _blob


@pytest.fixture
def fake_hub():
    hub = FakeHub()
    yield hub
    hub.close()


@pytest.fixture
def hf_env(fake_hub, monkeypatch, tmp_path):
    """Point huggingface_hub (in this process and in children) at the fake, with no telemetry or token."""
    for k, v in hub_env(fake_hub, str(tmp_path / "hf-home")).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)  # 10 MB by default: one update
    return dict(os.environ)


@pytest.fixture
def blob():
    """`blob(n, seed)`: n deterministic pseudo-random bytes."""
    return _blob
