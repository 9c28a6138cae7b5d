"""The models file (coderai.models_file): valid TOML becomes ModelConfigs; every failure is a ModelsFileError
naming the path; what write_models_file writes loads back."""

from __future__ import annotations

import pytest

from coderai.contracts import ModelConfig
from coderai.runtime.settings import SettingsError
from coderai.models_file import ModelsFileError, load_models, write_models_file

VALID = """
[[models]]
name = "coderai-tiny"
engine = "llama"
path = "~/.coderai/models/coderai-tiny.gguf"
params = { n_ctx = 2048 }

[[models]]
name = "emb"
engine = "embed"
path = "/m/emb"
ops = ["embed"]
nodes = ["n1", "n2"]
owned_by = "me"
created = 17
"""


def write(tmp_path, text: str):
    p = tmp_path / "models.toml"
    p.write_text(text)
    return p


def test_models_file_error_is_a_settings_error():
    assert issubclass(ModelsFileError, SettingsError)


def test_a_valid_file_loads_in_order(tmp_path):
    models = load_models(str(write(tmp_path, VALID)))
    assert models == [
        ModelConfig(
            name="coderai-tiny", engine="llama", path="~/.coderai/models/coderai-tiny.gguf", params={"n_ctx": 2048}
        ),
        ModelConfig(
            name="emb", engine="embed", path="/m/emb", ops=["embed"], nodes=["n1", "n2"], owned_by="me", created=17
        ),
    ]
    assert models[0].serves() == ["chat", "complete"]
    assert models[1].serves() == ["embed"]


def test_an_empty_file_has_no_models(tmp_path):
    assert load_models(str(write(tmp_path, ""))) == []


def test_a_home_relative_path_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path, VALID)
    assert [m.name for m in load_models("~/models.toml")] == ["coderai-tiny", "emb"]


@pytest.mark.parametrize(
    "text, needle",
    [
        ('[[models]]\nname = "a"\nengine = "llama"\npath = "/p"\ncolour = "red"\n', "colour"),
        ('[[models]]\nname = "a"\nengine = "llama"\npath = "/p"\n[extra]\nx = 1\n', "extra"),
        ('[[models]]\nname = "a"\nengine = "llama"\n', "path"),
        ('[[models]]\nname = "a"\nengine = "cobol"\npath = "/p"\n', "engine"),
        ('[[models]]\nname = "a"\nengine = "llama"\npath = "/p"\nparams = 3\n', "params"),
    ],
)
def test_schema_errors_name_the_path_and_the_field(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(ModelsFileError) as ei:
        load_models(str(p))
    msg = str(ei.value)
    assert msg.startswith(f"{p}: ")
    assert needle in msg


def test_duplicate_names_are_rejected_and_listed_once_each(tmp_path):
    body = "".join(
        f'[[models]]\nname = "{n}"\nengine = "llama"\npath = "/p"\n\n' for n in ["b", "a", "b", "c", "a", "b"]
    )
    p = write(tmp_path, body)
    with pytest.raises(ModelsFileError) as ei:
        load_models(str(p))
    assert str(ei.value) == f"{p}: model names appear twice: a, b"


def test_a_missing_file_names_the_path(tmp_path):
    p = tmp_path / "nope.toml"
    with pytest.raises(ModelsFileError) as ei:
        load_models(str(p))
    assert str(ei.value).startswith(f"{p}: ")
    assert "No such file" in str(ei.value)


def test_bad_toml_names_the_path(tmp_path):
    p = write(tmp_path, "[[models]\nname = ")
    with pytest.raises(ModelsFileError) as ei:
        load_models(str(p))
    assert str(ei.value).startswith(f"{p}: ")


def test_a_directory_is_an_error_not_a_crash(tmp_path):
    with pytest.raises(ModelsFileError) as ei:
        load_models(str(tmp_path))
    assert str(ei.value).startswith(f"{tmp_path}: ")


def test_what_write_models_file_writes_loads_back(tmp_path):
    models = [
        {"name": "tiny", "engine": "llama", "path": '/m/a \\ "b".gguf', "params": {"n_ctx": 2048, "a.b": True}},
        {"name": "emb", "engine": "embed", "path": "/m/emb", "nodes": ["n1", "n2"], "memory_mb": 12},
    ]
    p = write_models_file(tmp_path / "models.toml", models)
    assert p == tmp_path / "models.toml"
    got = load_models(str(p))
    assert [m.name for m in got] == ["tiny", "emb"]
    assert got[0].path == '/m/a \\ "b".gguf' and got[0].params == {"n_ctx": 2048, "a.b": True}
    assert got[1].nodes == ["n1", "n2"] and got[1].memory_mb == 12
