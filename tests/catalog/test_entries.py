"""Specs, the built-in catalogue, whole-repo file selection and the models-file entry (pure, no network)."""

from __future__ import annotations

import tomllib

import msgspec
import pytest
from coderai.catalog import BUILTIN, CatalogError, ModelStore, Pulled, resolve
from coderai.catalog.entries import guess_engine, select
from coderai.catalog.place import append_model, model_entry
from coderai.catalog.store import FileRecord
from coderai.contracts import ModelConfig


def test_every_builtin_entry_makes_a_valid_model_config(tmp_path):
    store = ModelStore(tmp_path)
    for e in BUILTIN.values():
        assert e.engine and e.kind and e.memory_mb and "/" in e.repo
        rec = Pulled(
            name=e.name,
            repo=e.repo,
            revision="main",
            main=e.main,
            engine=e.engine,
            params=e.params,
            memory_mb=e.memory_mb,
        )
        msgspec.convert(model_entry(rec, store), ModelConfig)


def test_specs_resolve():
    assert resolve("whisper-tiny").repo == "Systran/faster-whisper-tiny"
    known = resolve("Qwen/Qwen2.5-0.5B-Instruct-GGUF:qwen2.5-0.5b-instruct-q4_k_m.gguf")
    assert known.name == "qwen2.5-0.5b-instruct" and known.memory_mb == 900
    adhoc = resolve("me/My-GGUF:sub/My-Model.Q4.gguf", name="")
    assert (adhoc.name, adhoc.engine, adhoc.files, adhoc.main) == (
        "my-model.q4",
        "llama-server",
        ["sub/My-Model.Q4.gguf"],
        "sub/My-Model.Q4.gguf",
    )
    assert resolve("me/repo", name="mine").name == "mine" and resolve("me/repo").engine == ""
    for bad in ("nothing", "a/b/c", "../x", "a/..", "me/repo:../../etc/passwd", ""):
        with pytest.raises(CatalogError):
            resolve(bad)


def test_select_and_guess():
    st = BUILTIN["all-minilm-l6-v2"]
    files = [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "onnx/model.onnx",
        "tf_model.h5",
        "modules.json",
        "1_Pooling/config.json",
        "README.md",
        ".gitattributes",
    ]
    picked = select(st, files)
    assert picked == ["config.json", "model.safetensors", "modules.json", "1_Pooling/config.json"]
    assert guess_engine(picked) == ("embed", "embed", "")
    assert guess_engine(["v.onnx", "v.onnx.json"]) == ("tts", "speech", "v.onnx")
    assert guess_engine(["model_index.json", "unet/config.json"])[0] == "diffusers"
    assert guess_engine(["weights.pt"]) == ("", "", "")


def test_append_model_keeps_the_file_valid_and_refuses_duplicates(tmp_path):
    f = tmp_path / "models.toml"
    f.write_text('# mine\n[[models]]\nname = "a"\nengine = "llama"\npath = "/a.gguf"\n')
    append_model(f, {"name": "b", "engine": "whisper", "path": '/x "y"', "params": {"n_ctx": 2048, "x-y": True}})
    doc = tomllib.loads(f.read_text())
    assert [m["name"] for m in doc["models"]] == ["a", "b"]
    assert doc["models"][1]["params"] == {"n_ctx": 2048, "x-y": True} and doc["models"][1]["path"] == '/x "y"'
    with pytest.raises(CatalogError, match="already serves"):
        append_model(f, {"name": "a", "engine": "llama", "path": "/z"})


def test_every_pulled_model_gets_a_store_path_nodes_can_fetch(tmp_path):
    store = ModelStore(tmp_path)
    rec = lambda repo, main, *files: Pulled(
        name="m",
        repo=repo,
        revision="main",
        main=main,
        engine="tts",
        files={f: FileRecord(size=1, etag="0" * 64) for f in files},
    )
    gguf = model_entry(rec("acme/x-GGUF", "sub/x.gguf", "sub/x.gguf"), store)
    assert (gguf["store_path"], "store_file" in gguf) == ("acme/x-GGUF/sub/x.gguf", False)  # as before
    folder = model_entry(rec("Systran/faster-whisper-tiny", "", "config.json", "model.bin", "tokenizer.json"), store)
    assert (folder["store_path"], "store_file" in folder) == ("Systran/faster-whisper-tiny/", False)
    assert folder["path"] == str(store.root / "Systran" / "faster-whisper-tiny")
    piper = BUILTIN["piper-en-us-lessac-medium"]
    voice = model_entry(rec(piper.repo, piper.main, *piper.files), store)
    assert (voice["store_path"], voice["store_file"]) == (
        "rhasspy/piper-voices/en/en_US/lessac/medium/",
        "en_US-lessac-medium.onnx",
    )
    assert voice["path"] == str(store.root / voice["store_path"] / voice["store_file"])
    top = model_entry(rec("me/voice", "v.onnx", "v.onnx", "v.onnx.json"), store)
    assert (top["store_path"], top["store_file"]) == ("me/voice/", "v.onnx")
    spread = model_entry(rec("me/voice", "a/b/v.onnx", "a/b/v.onnx", "a/c/v.json"), store)
    assert (spread["store_path"], spread["store_file"]) == ("me/voice/a/", "b/v.onnx")
    assert msgspec.convert(spread, ModelConfig).store_file == "b/v.onnx"
