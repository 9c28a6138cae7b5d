"""`coderai models show` (the same command as `info`) splits a pulled GGUF's estimate from its header."""

from __future__ import annotations

import json

from coderai.catalog.cli import main
from coderai.contracts import ModelConfig
from coderai.sizing import MB, estimate


def test_show_prints_weights_kv_cache_and_overhead_of_a_pulled_gguf(fake_hub, hf_env, tiny_gguf, tmp_path, capsys):
    fake_hub.add("acme/tiny-GGUF", {"tiny.gguf": tiny_gguf.read_bytes()})
    home = str(tmp_path / "home")
    assert main(["--data-dir", home, "pull", "acme/tiny-GGUF:tiny.gguf", "--name", "tiny"]) == 0
    capsys.readouterr()
    assert main(["--data-dir", home, "show", "tiny", "--no-nodes"]) == 0
    shown = json.loads(capsys.readouterr().out)
    want = estimate(ModelConfig(name="tiny", engine="llama-server", path=str(tiny_gguf)))
    assert shown["memory"] == {
        "weights_mb": want.weights // MB,
        "kv_cache_mb": want.kv_cache // MB,
        "overhead_mb": want.overhead // MB,
        "from": "gguf",
    }
    assert shown["memory_mb"] == want.total // MB and shown["engine"] == "llama-server"
    assert main(["--data-dir", home, "info", "tiny", "--no-nodes"]) == 0
    assert json.loads(capsys.readouterr().out) == shown


def test_show_of_a_catalogue_name_not_pulled_gives_its_figure(tmp_path, capsys):
    assert main(["--data-dir", str(tmp_path), "show", "qwen2.5-7b-instruct", "--no-nodes"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["memory_mb"] == 6400 and shown["memory"]["from"] == "memory_mb" and not shown["pulled"]
