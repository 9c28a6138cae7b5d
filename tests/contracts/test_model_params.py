"""ModelConfig's param accessors: int(), float(), str() of a param as the engines read it, the default when it is
absent, null or "", and a TypeError or ValueError naming the param when its value is of another kind."""

from __future__ import annotations

import msgspec
import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.params import as_int


def _cfg(**params: object) -> ModelConfig:
    return ModelConfig(name="m", engine="echo", path="", params=params)


def test_numbers_convert_as_int_and_float_do() -> None:
    cfg = _cfg(n_ctx=4096, half=2.9, text="12", scale="1.5", flag=True, zero=0)
    assert cfg.param_int("n_ctx") == 4096
    assert cfg.param_int("half") == 2  # truncated, as int(2.9)
    assert cfg.param_int("text") == 12
    assert cfg.param_int("flag") == 1
    assert cfg.param_float("scale") == 1.5
    assert cfg.param_float("n_ctx") == 4096.0
    # 0 is a value, not unset: `or DEFAULT` at the call site is what makes 0 mean the default
    assert cfg.param_int("zero", 7) == 0
    assert (cfg.param_int("zero") or 7) == 7


def test_absent_null_and_empty_give_the_default() -> None:
    cfg = _cfg(none=None, empty="")
    for key in ("missing", "none", "empty"):
        assert cfg.param_int(key) is None
        assert cfg.param_int(key, 5) == 5
        assert cfg.param_float(key, 2.5) == 2.5
        assert cfg.param_str(key, "cpu") == "cpu"
        assert cfg.param_bool(key) is False
        assert cfg.param_bool(key, True) is True
        assert cfg.param_strs(key) == []
        assert cfg.param_table(key) == {}


def test_strings_lists_tables_and_truthiness() -> None:
    cfg = _cfg(device="cuda:1", urls=["http://a", "http://b"], env={"A": 1}, on=1, off=0, no=False, words="false")
    assert cfg.param_str("device") == "cuda:1"
    assert cfg.param_strs("urls") == ["http://a", "http://b"]
    assert cfg.param_table("env") == {"A": 1}
    assert cfg.param_bool("on") is True
    assert cfg.param_bool("off", True) is False
    assert cfg.param_bool("no", True) is False
    assert cfg.param_bool("words") is True  # truthiness, as `if params.get(...)` reads it


@pytest.mark.parametrize(
    ("read", "error"),
    [
        (lambda c: c.param_int("word"), ValueError),
        (lambda c: c.param_int("items"), TypeError),
        (lambda c: c.param_int("table"), TypeError),
        (lambda c: c.param_float("word"), ValueError),
        (lambda c: c.param_float("items"), TypeError),
        (lambda c: c.param_str("number"), TypeError),
        (lambda c: c.param_strs("word"), TypeError),
        (lambda c: c.param_strs("mixed"), TypeError),
        (lambda c: c.param_table("items"), TypeError),
    ],
)
def test_a_value_of_another_kind_fails_naming_the_param(read, error) -> None:
    cfg = _cfg(word="many", items=[1, 2], table={"a": 1}, number=3, mixed=["a", 1])
    with pytest.raises(error, match=r"params\.\w+ must be"):
        read(cfg)


def test_params_decode_as_json_values() -> None:
    raw = b'{"name":"m","engine":"llama","path":"x","params":{"n_ctx":"8192","env":{"A":"1"},"n":null}}'
    cfg = msgspec.json.decode(raw, type=ModelConfig)
    assert cfg.params == {"n_ctx": "8192", "env": {"A": "1"}, "n": None}
    assert cfg.param_int("n_ctx") == 8192
    assert cfg.param_table("env") == {"A": "1"}


def test_as_int_names_what_it_reads() -> None:
    assert as_int(3.0, "step") == 3
    with pytest.raises(TypeError, match="step must be a whole number"):
        as_int(None, "step")
    with pytest.raises(ValueError, match="step must be a whole number"):
        as_int(float("inf"), "step")
