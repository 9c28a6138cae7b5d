"""The `transformers` engine on the tiny random HF llama: chat (temperature 0 is deterministic, streaming adds up
to the whole answer), completions, and an adapter served on top of its base (a tar, as fine-tuning stores it)."""

from __future__ import annotations

import io
import tarfile

import pytest

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from coderai.contracts import ChatJob, CompletionJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines import engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.testing.tiny_hf_llama import tiny_hf_llama

pytestmark = pytest.mark.slow
MSGS = [{"role": "user", "content": "Say something."}]
GREEDY = SamplingParams(max_tokens=8, temperature=0)


def engine(path, **params):
    e = engine_class("transformers")(ModelConfig(name="t", engine="transformers", path=str(path), params=params))
    e.load()
    return e


def chat(e, stream=False):
    pieces = []
    job = ChatJob(request_id="r", model="t", messages=MSGS, params=GREEDY, stream=stream)
    choices, usage = e.chat(job, CancelFlag(), (lambda d, t, f: pieces.append((d, f))) if stream else None)
    return choices, usage, pieces


def test_chat_and_completions_on_the_base_model():
    e = engine(tiny_hf_llama())
    (c1,), usage, _ = chat(e)
    (c2,), _, _ = chat(e)
    assert c1.message["role"] == "assistant" and c1.message == c2.message  # greedy: the same answer twice
    assert usage.completion_tokens <= 8 and usage.prompt_tokens > 0
    assert c1.finish_reason in ("stop", "length")
    _, _, pieces = chat(e, stream=True)
    text = "".join((d or {}).get("content", "") for d, _ in pieces)
    assert text == c1.message["content"] and pieces[-1][1] == c1.finish_reason
    assert pieces[0][0]["role"] == "assistant"
    (done,), _ = e.complete(CompletionJob(request_id="r", model="t", prompt="def ", params=GREEDY), CancelFlag(), None)
    assert isinstance(done.text, str) and done.finish_reason in ("stop", "length")
    e.close()


def test_an_adapter_tar_is_served_over_its_base(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = tiny_hf_llama()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    lora = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted((tmp_path / "adapter").iterdir()):
            tar.add(p, arcname=p.name)
    (tmp_path / "adapter.tar").write_bytes(buf.getvalue())
    tuned = engine(tmp_path / "adapter.tar", base=str(base))
    (c,), _, _ = chat(tuned)
    assert isinstance(c.message["content"], str)
    assert list(tmp_path.glob(".adapter.tar.*"))  # unpacked once beside the tar
    logits = lambda m: m(input_ids=torch.tensor([[1, 2, 3]])).logits
    with torch.no_grad():
        assert not torch.allclose(logits(tuned.model), logits(engine(base).model))  # the adapter changes the model
