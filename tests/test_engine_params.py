"""Model params are data: each engine family's own, typed and in range; anything else is refused, naming it."""

from __future__ import annotations

import re
import subprocess

import pytest

from coderai.engine_params import EXEC_PARAMS, FAMILY_PARAMS, ParamError, check, takes
from coderai.engine_worker.engines import FAMILIES

# what an admin key (or whoever can reach the scheduler's subject) would pass to get a shell or a file
HOSTILE = {
    "host": "0.0.0.0",
    "port": 80,
    "log_file": "/etc/cron.d/x",
    "slot_save_path": "/",
    "path": "/",
    "api_key": "",
    "webui": True,
    "trust_remote_code": True,
    "python": "/tmp/evil",
    "env": {"LD_PRELOAD": "x"},
    "extra_args": ["--host", "0.0.0.0"],
}


@pytest.mark.parametrize("engine", ["llama-server", "vllm", "llama"])
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_param_that_moves_a_server_writes_a_file_or_runs_code_is_refused_from_the_api(engine, name):
    with pytest.raises(ParamError) as exc:
        check(
            engine, {"n_ctx": 512, name: HOSTILE[name]} if engine != "vllm" else {name: HOSTILE[name]}, operator=False
        )
    assert exc.value.param == f"params.{name}"
    print(f"{engine}: params.{name} from the API: refused ({exc.value.message[:70]})")


def test_the_operators_own_file_may_name_what_runs():
    check(
        "vllm",
        {
            "python": "/opt/vllm/bin/python",
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
            "extra_args": ["--disable-frontend-multiprocessing"],
            "trust_remote_code": True,
        },
        operator=True,
    )
    with pytest.raises(ParamError, match="no param 'host'"):  # an unknown flag is refused from the file too
        check("llama-server", {"host": "0.0.0.0"}, operator=True)


@pytest.mark.parametrize(
    "params, why",
    [
        ({"n_ctx": "512; rm -rf /"}, "whole number"),
        ({"n_ctx": 1.5}, "whole number"),
        ({"n_ctx": 1 << 30}, "between"),
        ({"parallel": 0}, "between"),
        ({"parallel": True}, "whole number"),
        ({"flash_attn": "maybe"}, "one of"),
        ({"mmproj": "a\0b"}, "at most"),
        ({"embedding": "yes"}, "true or false"),
        ({"n_threads": float("nan")}, "whole number"),
        ({"rope_freq_base": float("inf")}, "between"),
    ],
)
def test_values_are_typed_and_in_range(params, why):
    with pytest.raises(ParamError, match=why):
        check("llama-server", params, operator=False)


def test_what_each_family_reads_is_in_its_table():
    assert set(FAMILY_PARAMS) == set(FAMILIES)
    check(
        "llama-server",
        {
            "parallel": 4,
            "n_ctx": 2048,
            "n_threads": 2,
            "cache_ram_mb": 64,
            "queue": 12,
            "pooling": "mean",
            "chat_template": "chatml",
            "flash_attn": "auto",
        },
        operator=False,
    )
    check("video", {"stages": True, "steps": 2}, operator=False)
    check("video", {"stages": 2}, operator=False)
    check("echo", {"reply": "hi", "tool_calls": {"Read": {"file_path": "x"}}, "slots": 1}, operator=False)
    check("no-such-family", {"anything": 1}, operator=False)  # the worker says it has no such family
    assert "host" not in takes("llama-server") and not EXEC_PARAMS & set(takes("vllm"))


def test_every_llama_server_param_that_becomes_a_flag_is_one_the_server_has():
    from coderai.engine_worker.engines.llama_server import NAMED, OWN_PARAMS, find_binary

    binary = find_binary()
    if binary is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    flags = set(
        re.findall(
            r"--[a-z0-9-]+", subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60).stdout
        )
    )
    flagged = {
        k: NAMED.get(k, "--" + k.replace("_", "-"))
        for k in FAMILY_PARAMS["llama-server"]
        if k not in OWN_PARAMS or k in NAMED
    }
    assert {k: f for k, f in flagged.items() if f not in flags} == {}
