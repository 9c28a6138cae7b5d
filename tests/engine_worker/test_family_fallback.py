"""A llama-server model on a machine without the binary runs on the in-process engine, its server-only params
dropped; with the binary it is left alone."""

from __future__ import annotations

import pytest

from coderai.contracts import ModelConfig
from coderai.engine_worker.engines import available_families, resolve

CFG = ModelConfig(
    name="m",
    engine="llama-server",
    path="/m.gguf",
    params={"parallel": 8, "n_ctx": 4096, "cache_ram_mb": 64, "queue": 3, "n_threads": 2},
)


def test_without_the_binary_the_in_process_engine_serves_it(monkeypatch, tmp_path):
    pytest.importorskip("llama_cpp")
    monkeypatch.setenv("CODERAI_LLAMA_SERVER", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr("coderai.runtime.embedded.sys.executable", str(tmp_path / "python"))
    cfg = resolve(CFG)
    assert cfg.engine == "llama" and cfg.params == {"n_ctx": 4096, "n_threads": 2}
    assert "llama-server" in available_families()  # the worker still takes such models


def test_with_the_binary_the_model_is_unchanged(monkeypatch, tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("")
    monkeypatch.setenv("CODERAI_LLAMA_SERVER", str(binary))
    assert resolve(CFG) is CFG
    other = ModelConfig(name="e", engine="embed", path="x")
    assert resolve(other) is other
