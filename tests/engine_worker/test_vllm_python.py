"""Which interpreter runs vLLM, and whether a worker offers the vllm family: pure checks, no vLLM needed."""

from __future__ import annotations

import sys

from coderai.contracts import ModelConfig
from coderai.engine_worker.engines import available_families
from coderai.engine_worker.engines.vllm import VllmEngine, find_vllm_python


def _venv_with_vllm(root) -> str:
    """A venv folder whose `vllm/bin/python` exists, as scripts/setup links it."""
    python = root / "vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    python.chmod(0o755)
    return str(python)


def test_the_venv_setup_links_beside_this_one_is_found(tmp_path, monkeypatch):
    monkeypatch.delenv("CODERAI_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert find_vllm_python() is None
    python = _venv_with_vllm(tmp_path)
    assert find_vllm_python() == python


def test_the_setting_names_another_interpreter_first(tmp_path, monkeypatch):
    _venv_with_vllm(tmp_path)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setenv("CODERAI_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert find_vllm_python() == "/opt/vllm/bin/python"


def test_a_worker_without_vllm_offers_the_family_when_the_venv_is_there(tmp_path, monkeypatch):
    """The family's `needs` (an importable vllm) fails in the worker's own python; the venv makes up for it."""
    monkeypatch.delenv("CODERAI_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    assert "vllm" not in available_families()
    _venv_with_vllm(tmp_path)
    assert "vllm" in available_families()


def test_the_server_runs_under_the_models_python_else_the_found_one(tmp_path, monkeypatch):
    monkeypatch.delenv("CODERAI_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    found = _venv_with_vllm(tmp_path)
    cfg = ModelConfig(name="m", engine="vllm", path="/models/m")
    cmd, _ = VllmEngine(cfg).command(8000)
    assert cmd[:3] == [found, "-m", "vllm.entrypoints.openai.api_server"]
    own = ModelConfig(name="m", engine="vllm", path="/models/m", params={"python": "/own/bin/python"})
    assert VllmEngine(own).command(8000)[0][0] == "/own/bin/python"
