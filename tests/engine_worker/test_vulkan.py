"""llama.cpp on Vulkan (AMD and Intel cards): the worker reports Vulkan devices and their memory to the scheduler,
and a model placed on one serves from it.

The parsing runs everywhere. The real run needs the Vulkan build, which takes 15-25 minutes on 2 cores, so it is
behind a flag of the README test command: `CODERAI_TEST_VULKAN=1 ./scripts/test` (scripts/setup then builds
`.venv/bin/llama-server-vulkan` beside the CPU build, and this test runs on Mesa's lavapipe, a CPU Vulkan device
from Debian: a real Vulkan build and driver). Without the flag it is skipped, saying so.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import openai
import pytest

from coderai.engine_worker.node import GpuProbe, parse_vulkan_devices
from coderai.testing.stack import running_stack

VULKAN_SERVER = Path(sys.prefix) / "bin" / "llama-server-vulkan"
FLAG = "CODERAI_TEST_VULKAN"

LISTED = """\
ggml_vulkan: Found 2 Vulkan devices:
ggml_vulkan: 0 = AMD Radeon RX 7900 XTX (RADV NAVI31) (radv) | uma: 0 | fp16: 1 | bf16: 0 | warp size: 64
Available devices:
  Vulkan0: AMD Radeon RX 7900 XTX (RADV NAVI31) (24560 MiB, 24000 MiB free)
  Vulkan1: llvmpipe (LLVM 15.0.6, 256 bits) (31987 MiB, 99999 MiB free)
  CPU: AMD Ryzen 9 7950X (63000 MiB, 60000 MiB free)
"""


def test_vulkan_devices_are_read_from_llama_servers_list_in_order_and_nothing_else():
    assert parse_vulkan_devices(LISTED) == [(24560 << 20, 24000 << 20), (31987 << 20, 31987 << 20)]  # free <= total
    assert parse_vulkan_devices("Available devices:\n  (none)\n") == []
    assert parse_vulkan_devices("Vulkan0: evil (1 MiB, 1 MiB free) trailing junk\n") == []  # not the listed shape


def test_a_cpu_build_is_asked_once_and_reports_no_gpu():
    from coderai.runtime.embedded import find_llama_server

    probe = GpuProbe(find_llama_server())
    if probe.api == "cuda":
        pytest.skip("this machine has NVIDIA GPUs: the Vulkan probe is not asked")
    assert (probe.count, probe.api) == (0, "") and probe.devices() == []


@pytest.mark.slow
def test_a_model_on_a_vulkan_device_is_reported_and_answers(tmp_path_factory):
    if os.environ.get(FLAG) != "1":
        pytest.skip(f"the Vulkan build takes 15-25 min: run `{FLAG}=1 ./scripts/test` (docs/engines.md)")
    assert VULKAN_SERVER.exists(), f"{FLAG}=1 but scripts/setup built no {VULKAN_SERVER}"
    from coderai.testing.real_gguf import gemma3_q4km

    shaders = tmp_path_factory.getbasetemp().parent / "mesa-shaders"  # compiled once per test run
    env = {
        "CODERAI_LLAMA_SERVER": str(VULKAN_SERVER),
        "GGML_VK_VISIBLE_DEVICES": "0",  # lavapipe is a CPU-type device, which ggml hides unless named
        "MESA_SHADER_CACHE_DIR": str(shaders),
    }
    # flash attention segfaults inside lavapipe; a real card takes the default
    params = {"n_ctx": 1024, "n_threads": 2, "n_gpu_layers": 99, "flash_attn": "off", "load_timeout_s": 600}
    models = [{"name": "gemma-vk", "engine": "llama-server", "path": str(gemma3_q4km()), "params": params}]
    with running_stack(tmp_path_factory.mktemp("vk"), models, gateway_args=("--no-auth",), extra_env=env) as stack:
        nodes = httpx.get(f"{stack.http_url}/admin/nodes", timeout=10).json()["nodes"]
        [hb] = [n["heartbeat"] for n in nodes]
        assert hb["gpu_api"] == "vulkan" and hb["gpus"] >= 1 and hb["vram_total"] > 0
        [engine] = [e for e in hb["engines"] if e["model"] == "gemma-vk"]
        assert engine["backend"] == "vulkan" and engine["gpu_layers"] > 0, engine
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=300)
        done = client.completions.create(model="gemma-vk", prompt="The capital of France is", max_tokens=16)
        assert done.usage.completion_tokens > 0 and done.choices[0].text.strip()
