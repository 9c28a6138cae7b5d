"""The README's snippets run: the SDK example against a live stack, the models file through the real loader."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coderai.models_file import load_models

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_readme_sdk_example_runs(api_stack, admin_key):
    [code] = [b for b in _blocks("python") if "from openai import OpenAI" in b]
    env = {**os.environ, "CODERAI_BASE_URL": api_stack.base_url, "CODERAI_API_KEY": admin_key}
    api_stack.wait_model_ready("coderai-tiny", headers={"Authorization": f"Bearer {admin_key}"})
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr  # the SDK raises on any error status or error event


def test_readme_models_file_is_valid(tmp_path):
    [toml] = [b for b in _blocks("toml") if "[[models]]" in b]
    path = tmp_path / "models.toml"
    path.write_text(toml)
    [model] = load_models(str(path))
    assert model.engine == "llama-server" and model.params["n_ctx"] == 8192


def test_readme_gives_the_two_commands_and_ci_runs_the_test_one():
    shell = _blocks("bash")
    assert "./scripts/up\n" in shell and "./scripts/test\n" in shell
    ci = (README.parent / ".ci" / "run").read_text()
    assert "scripts/test" in ci
