"""`coderai models pull --place` against a running stack: the pulled model is served at once, no restart."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp")


def test_a_placed_pull_is_served_by_the_running_stack(fake_hub, hf_env, tmp_path_factory, tiny_gguf):
    fake_hub.add("acme/tiny-GGUF", {"tiny-q4.gguf": tiny_gguf.read_bytes()})
    root = tmp_path_factory.mktemp("live")
    models = [{"name": "base", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}}]
    with running_stack(root, models, gateway_args=("--no-auth",)) as stack:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "coderai.cli",
                "models",
                "--data-dir",
                str(root / "home"),
                "pull",
                "acme/tiny-GGUF:tiny-q4.gguf",
                "--name",
                "fresh",
                "--place",
                "--nats-url",
                stack.nats_url,
            ],
            env=hf_env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert r.returncode == 0, r.stderr
        assert "placed: the running stack serves fresh" in r.stdout, r.stdout
        stack.wait_model_ready("fresh")  # loaded by the worker without any restart
        answer = httpx.post(
            f"{stack.base_url}/chat/completions",
            timeout=30,
            json={"model": "fresh", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert answer.status_code == 200 and answer.headers["coderai-engine"].endswith("fresh")
