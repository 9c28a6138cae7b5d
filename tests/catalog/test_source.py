"""A model's `source` (coderai.catalog.source): every accepted form parses to what a pod's worker fetches, and every
bad one is refused with a message saying what would be right; the models file refuses them by model name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coderai.catalog.source import Source, SourceError, parse_source
from coderai.models_file import ModelsFileError, load_models


@pytest.mark.parametrize(
    "text, want",
    [
        (
            "hf://acme/tiny-GGUF/tiny.gguf",
            Source("hf", "hf://acme/tiny-GGUF/tiny.gguf", repo="acme/tiny-GGUF", file="tiny.gguf"),
        ),
        (
            "hf://acme/tiny-GGUF/q/tiny.gguf@0123abc",
            Source(
                "hf",
                "hf://acme/tiny-GGUF/q/tiny.gguf@0123abc",
                repo="acme/tiny-GGUF",
                file="q/tiny.gguf",
                revision="0123abc",
            ),
        ),
        (
            "hf://Qwen/Qwen2.5-7B-Instruct-AWQ",
            Source("hf", "hf://Qwen/Qwen2.5-7B-Instruct-AWQ", repo="Qwen/Qwen2.5-7B-Instruct-AWQ"),
        ),
        ("hf://org/repo@refs/pr/1", Source("hf", "hf://org/repo@refs/pr/1", repo="org/repo", revision="refs/pr/1")),
        (" qwen2.5-0.5b-instruct ", Source("catalog", "qwen2.5-0.5b-instruct")),
        (
            "store://acme/tiny-GGUF/tiny.gguf",
            Source("store", "store://acme/tiny-GGUF/tiny.gguf", path="acme/tiny-GGUF/tiny.gguf"),
        ),
        (
            "store://Systran/faster-whisper-tiny/",
            Source("store", "store://Systran/faster-whisper-tiny/", path="Systran/faster-whisper-tiny/"),
        ),
    ],
)
def test_accepted_sources(text, want):
    assert parse_source(text) == want


@pytest.mark.parametrize(
    "text, needle",
    [
        ("", "empty"),
        ("acme/tiny-GGUF", "hf://acme/tiny-GGUF"),  # a bare repo: the hint says how to write it
        ("no-such-model", "catalogue id (known: "),
        ("s3://bucket/m.gguf", "unknown scheme 's3://'"),
        ("hf://acme", "hf://<org>/<repo>"),
        ("hf://acme/../x.gguf", "hf://<org>/<repo>"),
        ("hf://acme/repo/../../etc/passwd", "plain path inside the repo"),
        ("hf://acme/repo//x.gguf", "plain path inside the repo"),
        ("hf://acme/repo/x.gguf@", "no revision after '@'"),
        ("store:///etc/passwd", "must be relative"),
        ("store://a/../../b", "store path"),
    ],
)
def test_refused_sources_say_why(text, needle):
    with pytest.raises(SourceError) as ei:
        parse_source(text)
    assert needle in str(ei.value)


def test_an_hf_source_becomes_the_pull_the_catalogue_makes():
    e = parse_source("hf://acme/tiny-GGUF/tiny.gguf@v2").entry("tiny", "llama")
    assert (e.name, e.repo, e.files, e.main, e.revision, e.engine) == (
        "tiny",
        "acme/tiny-GGUF",
        ["tiny.gguf"],
        "tiny.gguf",
        "v2",
        "llama",
    )
    whole = parse_source("hf://acme/awq").entry("big", "vllm")
    assert (whole.files, whole.main, whole.revision) == ([], "", "main")
    cat = parse_source("qwen2.5-0.5b-instruct").entry("q", "llama-server")
    assert cat.name == "q" and cat.repo == "Qwen/Qwen2.5-0.5B-Instruct-GGUF" and cat.main.endswith(".gguf")
    with pytest.raises(SourceError):
        parse_source("store://a/b.gguf").entry("x", "llama")


def _file(tmp_path, extra: str) -> str:
    p = tmp_path / "models.toml"
    p.write_text(f'[[models]]\nname = "m"\nengine = "llama"\npath = "/nowhere/m.gguf"\n{extra}\n')
    return str(p)


def test_the_models_file_takes_source_and_volume(tmp_path):
    [m] = load_models(
        _file(tmp_path, 'source = "hf://acme/m-GGUF/m.gguf"\npod = { burst = "when_busy", volume = "v1" }')
    )
    assert m.source == "hf://acme/m-GGUF/m.gguf" and m.pod.volume == "v1"


@pytest.mark.parametrize(
    "extra, needle",
    [
        ('source = "hf://acme"', "model 'm': source: 'hf://acme': a Hub repo is"),
        ('source = "ftp://x/y"', "unknown scheme"),
        ('source = "store://a/m.gguf"\nstore_path = "a/m.gguf"', "keep one"),
        ('pod = { volume = "v1" }', "pod.volume keeps weights fetched by `source`"),
    ],
)
def test_the_models_file_refuses_a_bad_source_by_model(tmp_path, extra, needle):
    path = _file(tmp_path, extra)
    with pytest.raises(ModelsFileError) as ei:
        load_models(path)
    assert str(ei.value).startswith(f"{path}: ") and needle in str(ei.value)


def test_the_models_in_docs_pods_md_load(tmp_path):
    doc = Path(__file__).resolve().parents[2] / "docs" / "pods.md"
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", doc.read_text(), flags=re.S) if "[[models]]" in b]
    assert len(blocks) >= 2
    sourced = 0
    for i, block in enumerate(blocks):
        (tmp_path / f"{i}.toml").write_text(block)
        [m] = load_models(str(tmp_path / f"{i}.toml"))
        if m.pod.serverless_endpoint:  # a serverless endpoint serves its own weights: no source to fetch
            continue
        assert parse_source(m.source).kind == "hf"
        sourced += 1
    assert sourced >= 2
