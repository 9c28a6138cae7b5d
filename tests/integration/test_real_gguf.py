"""A real K-quant GGUF (Gemma 3 270M Q4_K_M) served through the stack the README's setup builds: the code paths
a tiny f16 model never reaches (K-quant kernels, a real tokenizer and chat template). A native build crashed
here on exactly this model (SIGILL/SIGSEGV on CPUs that report AVX-512); the portable build must answer."""

from __future__ import annotations

import openai
import pytest

from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from coderai.testing.real_gguf import MISSING, gemma3_q4km

    try:
        return gemma3_q4km()
    except ImportError:
        pytest.skip(MISSING)


def test_the_installed_llama_cpp_answers_on_a_k_quant_model_in_a_child():
    from coderai.testing.real_gguf import smoke

    ok, said = smoke()
    assert ok, said
    assert not said.startswith("skipped") and int(said.split()[0]) > 0


def test_the_built_llama_server_answers_on_a_k_quant_model():  # setup's smoke run of a native build, on this one
    from coderai.testing.real_gguf import smoke_server

    ok, said = smoke_server()
    assert ok, said
    assert not said.startswith("skipped") and int(said.split()[0]) > 0


def test_a_k_quant_gguf_answers_through_the_stack(tmp_path_factory, gemma):
    # the base model's GGUF has no chat template: chat goes through llama-cpp-python's gemma format
    params = {"n_ctx": 1024, "n_threads": 2, "chat_format": "gemma"}
    models = [{"name": "gemma3-270m", "engine": "llama", "path": str(gemma), "params": params}]
    with running_stack(tmp_path_factory.mktemp("gemma-stack"), models, gateway_args=("--no-auth",)) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=120)
        done = client.completions.create(
            model="gemma3-270m", prompt="The capital of France is", max_tokens=32, temperature=0
        )
        assert done.usage.completion_tokens > 0
        assert {"paris", "france"} & set(done.choices[0].text.lower().replace(".", " ").split())  # real words, on topic
        r = client.chat.completions.create(
            model="gemma3-270m",
            max_tokens=32,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert r.usage.completion_tokens > 0 and r.choices[0].message.content.strip()
        pieces = list(
            client.chat.completions.create(
                model="gemma3-270m",
                max_tokens=32,
                stream=True,
                messages=[{"role": "user", "content": "Count to five."}],
            )
        )
        text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
        assert text.strip() and pieces[-1].choices[0].finish_reason in ("stop", "length")
        assert stack.procs["worker-w1"].alive()  # the worker survived the quantized kernels
