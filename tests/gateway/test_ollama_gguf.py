"""What Ollama's `/api/show` and `/api/tags` read from a GGUF (coderai.gateway.ollama_gguf), Modelfile parsing
(coderai.gateway.ollama_create) and capabilities (coderai.gateway.ollama_models): pure functions over files and
configs."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from coderai.contracts import ModelConfig
from coderai.gateway.errors import ApiError
from coderai.gateway.ollama_gguf import Digests, facts, file_type_name, human_number, read_facts
from coderai.gateway.ollama_create import _with_parameters, parse_modelfile
from coderai.gateway.ollama_models import capabilities


def test_numbers_and_file_types_as_ollama_writes_them():
    assert human_number(268_098_176) == "268.10M"
    assert human_number(7_615_616_512) == "7.6B" and human_number(8_000_000_000) == "8B"
    assert human_number(12_000_000) == "12M" and human_number(5_300) == "5K" and human_number(12) == "12"
    assert file_type_name(15) == "Q4_K_M" and file_type_name(1) == "F16" and file_type_name(0) == "F32"
    assert file_type_name(None) == "" and file_type_name(9999) == ""


def test_the_tiny_gguf_header(tiny_gguf):
    f = read_facts(tiny_gguf)
    assert f.architecture == "llama" and f.quantization_level == "F16" and f.context_length == 2048
    assert f.parameters > 0 and f.parameter_size and f.size == tiny_gguf.stat().st_size
    assert f.info["llama.context_length"] == 2048 and f.info["general.parameter_count"] == f.parameters
    assert "im_start" in f.template and not f.projector
    assert facts(tiny_gguf) is facts(tiny_gguf)  # read once per (path, size, mtime)


def test_the_real_k_quant_gguf():
    try:
        from coderai.testing.real_gguf import MISSING, gemma3_q4km
    except ImportError:
        pytest.skip("coderai.testing.real_gguf is missing")
    try:
        path = gemma3_q4km()
    except ImportError:
        pytest.skip(MISSING)
    f = read_facts(path)
    assert (f.architecture, f.parameter_size, f.quantization_level) == ("gemma3", "268.10M", "Q4_K_M")
    assert f.context_length == 32768 and f.size_label == "270M"


def test_not_a_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(ValueError):
        read_facts(junk)
    assert facts(junk) is None and facts(tmp_path / "missing.gguf") is None


def test_digests_once_and_from_names(tmp_path):
    data = b"x" * 5000
    plain = tmp_path / "m.gguf"
    plain.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    named = tmp_path / f"sha256-{'a' * 64}"
    named.write_bytes(data)

    async def run() -> tuple[str, str, str, str]:
        d = Digests()
        first = await d.get(plain)
        plain.chmod(0)  # unreadable now: a second read would fail, the cache answers
        try:
            again = await d.get(plain)
        finally:
            plain.chmod(0o644)
        return first, again, await d.get(named), await d.get(tmp_path / "gone")

    first, again, by_name, gone = asyncio.run(run())
    assert first == again == want and by_name == "a" * 64 and gone == ""


def test_modelfile_parsing():
    text = (
        'FROM sha256:abc\n# a comment\nPARAMETER stop "<|im_end|>"\nPARAMETER num_ctx 4096\n'
        'SYSTEM """\nYou are\nhelpful.\n"""\nLICENSE MIT\n'
    )
    source, params, others = parse_modelfile(text)
    assert source == "sha256:abc" and params == [("stop", "<|im_end|>"), ("num_ctx", "4096")]
    assert others == ["SYSTEM", "LICENSE"]


def test_parameters_that_serving_keeps_and_the_rest_refused():
    cfg = ModelConfig(name="m", engine="llama", path="/m.gguf", stop=["a"], params={"n_ctx": 512})
    got = _with_parameters(cfg, [("stop", "b"), ("stop", ["a", "c"]), ("num_ctx", "2048"), ("num_predict", 64)])
    assert got.stop == ["a", "b", "c"] and got.params == {"n_ctx": 2048} and got.default_output_tokens == 64
    with pytest.raises(ApiError) as exc:
        _with_parameters(cfg, [("temperature", "0.2")])
    assert exc.value.status == 400 and "temperature" in exc.value.message
    with pytest.raises(ApiError):
        _with_parameters(cfg, [("num_ctx", "lots")])


def test_capabilities():
    plain = ModelConfig(name="m", engine="llama", path="/m.gguf")
    assert capabilities(plain, None) == ["completion"]
    tools = ModelConfig(
        name="m",
        engine="llama-server",
        path="/m.gguf",
        params={"chat_template": "{% if tools %}...{% endif %}<think>", "mmproj": "/p.gguf"},
    )
    assert capabilities(tools, None) == ["completion", "thinking", "tools", "vision"]
    assert "embedding" in capabilities(ModelConfig(name="e", engine="embed", path="x"), None)
