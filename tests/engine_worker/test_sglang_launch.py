"""The sglang family's launch lines, checked against SGLang's own argument parser (the installed 0.5.23's
`ServerArgs.add_cli_args`, which scripts/setup installs beside the venv: SGLang itself does not run on a machine
without its CUDA kernels), and the launcher that keeps the API key off the command line, run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.split import SplitDevice, SplitPlan
from coderai.engine_worker.engines.base import EngineLoadError
from coderai.engine_worker.engines.sglang import (
    KEY_ENV,
    SGLangEngine,
    SGLangMember,
    rank_flags,
    server_args,
    server_command,
)
from coderai.engine_params import ParamError, check

PARSER = Path(sys.prefix) / "sglang-args"  # scripts/setup links it there (dev extra)

PARSE = textwrap.dedent(
    """
    import argparse, json, sys
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    out = []
    for argv in json.loads(sys.stdin.read()):
        ns = vars(parser.parse_args(argv))
        out.append({k: v for k, v in ns.items() if isinstance(v, (str, int, float, bool, type(None)))})
    print(json.dumps(out))
    """
)


def parse(*argvs: list[str]) -> list[dict]:
    """What SGLang's parser makes of each argv (it exits 2, naming the argument, on one it does not know)."""
    if not (PARSER / "sglang").is_dir():
        pytest.fail(f"SGLang's parser is not installed at {PARSER}: run scripts/setup with the dev extra")
    r = subprocess.run(
        [sys.executable, "-c", PARSE],
        input=json.dumps(list(argvs)),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(PARSER)},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def model(**params: object) -> ModelConfig:
    return ModelConfig(name="big", engine="sglang", path="/models/big", params=params)


def plan(*nodes: str, ranks: int = 2) -> SplitPlan:
    return SplitPlan(
        mode="ranks",
        devices=[
            SplitDevice(node_id=n, endpoint=f"10.0.0.{i + 1}", share=1 / len(nodes), ranks=ranks)
            for i, n in enumerate(nodes)
        ],
    )


ONE_NODE = {
    "tp_size": 2,
    "mem_fraction_static": 0.8,
    "context_length": 8192,
    "trust_remote_code": True,
    "disable_radix_cache": False,  # false: left out
    "schedule_policy": "lpm",
    "tool_call_parser": "qwen25",
    "extra_args": ["--log-level", "warning"],
    "env": {"X": "1"},  # the engine's own, never a flag
    "load_timeout_s": 900,
}
KT = {"kt_weight_path": "/w/experts", "kt_method": "AMXINT4", "kt_cpuinfer": 32, "kt_num_gpu_experts": 8}
RANKED = ModelConfig(
    name="big", engine="sglang", path="/models/big", params={"tp_size": 4, "dist_port": 6000}, shards=plan("a", "b")
)


def lines() -> dict[str, list[str]]:
    """Every launch line the tests check, by name: parsed in one run of SGLang's parser (importing it takes
    seconds on 2 cores), then looked up by each test."""
    four = plan("a", "b", "c", "d")
    out = {
        "one_node": server_args("/models/big", "big", 31000, ONE_NODE),
        "kt": server_args("/m", "m", 1, KT),
        **{f"rank_{n}": server_args("/m", "m", 30000, {"tp_size": 8}, rank_flags(four, n, 5757)) for n in "abcd"},
        "serving": SGLangEngine(RANKED, "a").command(30001)[0][3:],  # after `python -c LAUNCH`
        "member": SGLangMember(RANKED, "b").command(30002)[3:],
    }
    return out


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict]:
    built = lines()
    return dict(zip(built, parse(*built.values()), strict=True))


def test_one_node_launch_line_with_the_family_params_is_what_sglang_parses(parsed):
    check("sglang", ONE_NODE, operator=True)
    ns = parsed["one_node"]
    assert (ns["model_path"], ns["host"], ns["port"], ns["served_model_name"]) == (
        "/models/big",
        "127.0.0.1",
        31000,
        "big",
    )
    assert ns["tp_size"] == 2 and ns["mem_fraction_static"] == 0.8 and ns["context_length"] == 8192
    assert ns["trust_remote_code"] is True and ns["disable_radix_cache"] is False and ns["enable_metrics"] is True
    assert ns["schedule_policy"] == "lpm" and ns["tool_call_parser"] == "qwen25" and ns["log_level"] == "warning"
    assert ns["api_key"] is None  # the key is never on the command line (the launcher adds it in-process)


def test_ktransformers_params_are_sglangs_kt_flags(parsed):
    check("sglang", KT, operator=True)
    ns = parsed["kt"]
    assert (ns["kt_weight_path"], ns["kt_method"], ns["kt_cpuinfer"], ns["kt_num_gpu_experts"]) == (
        "/w/experts",
        "AMXINT4",
        32,
        8,
    )


def test_each_node_of_a_plan_gets_its_rank_and_the_serving_nodes_address(parsed):
    ranks = [parsed[f"rank_{n}"] for n in "abcd"]
    assert [ns["node_rank"] for ns in ranks] == [0, 1, 2, 3]
    assert {ns["nnodes"] for ns in ranks} == {4} and {ns["dist_init_addr"] for ns in ranks} == {"10.0.0.1:5757"}
    assert {ns["tp_size"] for ns in ranks} == {8}


def test_a_plan_sglang_cannot_run_is_refused_before_anything_starts():
    with pytest.raises(EngineLoadError, match="same ranks on every node"):
        rank_flags(
            SplitPlan(
                mode="ranks",
                devices=[
                    SplitDevice(node_id="a", endpoint="10.0.0.1", share=0.5, ranks=2),
                    SplitDevice(node_id="b", endpoint="10.0.0.2", share=0.5, ranks=1),
                ],
            ),
            "a",
            5757,
        )
    with pytest.raises(EngineLoadError, match="not in the plan"):
        rank_flags(plan("a", "b"), "z", 5757)
    with pytest.raises(EngineLoadError, match="needs a plan"):
        SGLangMember(model(), "a")


def test_the_engine_and_a_member_build_their_lines_from_the_plan(parsed):
    serving, member = parsed["serving"], parsed["member"]
    assert (serving["node_rank"], member["node_rank"]) == (0, 1)
    assert serving["dist_init_addr"] == member["dist_init_addr"] == "10.0.0.1:6000"
    cmd, env = SGLangEngine(RANKED, "a").command(30001)
    assert "dist_port" not in " ".join(cmd) and KEY_ENV not in env  # the child server adds the key


@pytest.mark.parametrize("bad", [{"tp_size": 0}, {"start_cmd": ["sh"]}, {"kt_cpuinfer": "many"}, {"python": 3}])
def test_params_out_of_range_or_unknown_are_refused(bad):
    with pytest.raises(ParamError):
        check("sglang", bad, operator=True)


def test_the_launcher_hands_sglang_the_key_in_process_and_keeps_it_off_the_command_line(tmp_path):
    """A stand-in `sglang.launch_server` module (the real one needs CUDA kernels) prints what it got; the launcher
    is the real one."""
    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(
        "import json, os, sys\n"
        f"print(json.dumps({{'argv': sys.argv, 'env_has_key': {KEY_ENV!r} in os.environ, 'name': __name__}}))\n"
    )
    cmd = server_command(sys.executable, ["--model-path", "/m", "--port", "1"])
    key = "sk-not-for-ps-" + "x" * 20
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, KEY_ENV: key, "PYTHONPATH": str(tmp_path)},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["argv"][1:] == ["--model-path", "/m", "--port", "1", "--api-key", key]
    assert got["name"] == "__main__" and got["env_has_key"] is False  # its own children do not inherit it
    assert key not in " ".join(cmd)  # what `ps` shows
