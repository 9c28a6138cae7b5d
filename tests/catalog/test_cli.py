"""`coderai models ...` as a user runs it (a child process pointed at the fake Hub), the bar, and fits()."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tomllib

from coderai.catalog import fits
from coderai.catalog.cli import Bar
from coderai.catalog.pull import Progress
from coderai.contracts import Heartbeat, ModelConfig
from coderai.models_file import load_models

GB = 1 << 30


def models(env, data, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "coderai.cli", "models", "--data-dir", str(data), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_cli_pull_list_info_rm(fake_hub, hf_env, tmp_path, blob):
    data = blob(12 * (1 << 20), 9)  # over huggingface_hub's 10 MB read size: two progress steps
    fake_hub.add("acme/cli-GGUF", {"cli-q4.gguf": data})
    home = tmp_path / "home"
    r = models(hf_env, home, "pull", "acme/cli-GGUF:cli-q4.gguf", "--name", "cli", "--place")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("cli ")]
    percents = [float(ln.split()[2].rstrip("%")) for ln in lines]
    assert percents[0] == 0.0 and percents[-1] == 100.0 and any(0 < p < 100 for p in percents)
    assert percents == sorted(percents) and lines[-1].split()[1] == "done"
    assert "pulled cli (llama-server, 12.0 MB)" in r.stdout and "no running stack reached" in r.stdout
    placed = tomllib.loads((home / "models.toml").read_text())["models"]
    assert placed == [
        {
            "name": "cli",
            "engine": "llama-server",
            "path": str(home.resolve() / "models" / "acme" / "cli-GGUF" / "cli-q4.gguf"),
            "store_path": "acme/cli-GGUF/cli-q4.gguf",
        }
    ]

    r = models(hf_env, home, "list")
    assert r.returncode == 0 and r.stdout.split()[:3] == ["cli", "llama-server", "chat"]
    r = models(hf_env, home, "info", "cli", "--no-nodes")
    info = json.loads(r.stdout)
    assert info["size"] == len(data) and info["engine"] == "llama-server" and info["pulled"]
    assert info["memory_mb"] == int(len(data) * 1.2 + 256 * (1 << 20)) // (1 << 20)  # the scheduler's estimate
    r = models(hf_env, home, "info", "qwen2.5-7b-instruct", "--no-nodes")
    assert json.loads(r.stdout)["memory_mb"] == 6400 and not json.loads(r.stdout)["pulled"]
    r = models(hf_env, home, "info", "cli", "--nats-url", "nats://127.0.0.1:9")
    assert json.loads(r.stdout)["nodes"] == [] and "did not answer" in json.loads(r.stdout)["nodes_note"]

    r = models(hf_env, home, "pull", "acme/cli-GGUF:cli-q4.gguf", "--name", "cli", "--place")
    assert r.returncode == 1 and "already serves a model named 'cli'" in r.stderr
    assert len(fake_hub.ranges("cli-q4.gguf")) == 1  # the second pull found the file verified in place

    r = models(hf_env, home, "rm", "cli", "--files")  # no stack: out of the models file, and the files deleted
    assert r.returncode == 0 and "removed cli from" in r.stdout and "removed cli (12.0 MB)" in r.stdout
    assert tomllib.loads((home / "models.toml").read_text()) == {}
    assert not (home / "models" / "acme").exists()
    assert models(hf_env, home, "list").stdout == ""
    r = models(hf_env, home, "rm", "cli", "--files")
    assert r.returncode == 1 and "no pulled model 'cli'" in r.stderr


def test_cli_add_set_rm_edit_the_models_file_when_no_stack_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CODERAI_NATS_URL"}
    home = tmp_path / "home"
    r = models(
        env,
        home,
        "add",
        "m",
        "--engine",
        "llama",
        "--path",
        "/m.gguf",
        "--param",
        "n_ctx=2048",
        "--resident",
        "on_demand",
        "--keep-alive",
        "60",
        "--set",
        'nodes=["w1"]',
    )
    assert r.returncode == 0 and "no running stack reached" in r.stdout, r.stderr
    assert load_models(str(home / "models.toml")) == [
        ModelConfig(
            name="m",
            engine="llama",
            path="/m.gguf",
            params={"n_ctx": 2048},
            resident="on_demand",
            keep_alive_s=60.0,
            nodes=["w1"],
        )
    ]
    r = models(env, home, "add", "m", "--engine", "llama", "--path", "/m.gguf")
    assert r.returncode == 1 and "has a model named 'm' already" in r.stderr
    r = models(env, home, "set", "m", "params.n_ctx=4096", "params.seed=7", "keep_alive_s=", "replicas=2")
    assert r.returncode == 0, r.stderr
    [m] = load_models(str(home / "models.toml"))
    assert (m.params, m.keep_alive_s, m.replicas, m.resident) == ({"n_ctx": 4096, "seed": 7}, None, 2, "on_demand")
    r = models(env, home, "set", "m", "engine=nope")
    assert r.returncode == 1 and "not a valid model" in r.stderr and "$.engine" in r.stderr
    assert models(env, home, "set", "m", "name=x").returncode == 1
    r = models(env, home, "rm", "m")
    assert r.returncode == 0 and "removed m from" in r.stdout
    assert load_models(str(home / "models.toml")) == []
    r = models(env, home, "rm", "m")
    assert r.returncode == 1 and "no model 'm'" in r.stderr


def test_cli_unknown_repo_fails_clearly(fake_hub, hf_env, tmp_path):
    r = models(hf_env, tmp_path, "pull", "nobody/nothing:x.gguf")
    assert r.returncode == 1
    assert "coderai models: no repo 'nobody/nothing'" in r.stderr and "Traceback" not in r.stderr


def test_bar_redraws_one_line_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    bar = Bar(out)
    for done, state in ((0, "downloading"), (50, "downloading"), (100, "done")):
        bar(Progress(name="m", state=state, bytes_done=done, bytes_total=100, percent=float(done)))
    text = out.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert "[" + "#" * 15 + "." * 15 + "] m downloading  50.0%" in text


def test_fits_uses_the_schedulers_capacity():
    def hb(node, **mem):
        return Heartbeat(node_id=node, version="x", seq=1, ts=0.0, host="h", capabilities=["llama"], **mem)

    nodes = [
        hb("gpu", vram_total=24 * GB, vram_free=4 * GB, mem_total=64 * GB),
        hb("small", mem_total=6 * GB, mem_free=6 * GB),
        hb("unknown"),
    ]
    got = {n["node"]: n for n in fits(6 * GB, nodes)}
    assert got["gpu"]["fits"] and not got["gpu"]["fits_now"]  # 90 % of 24 GB, but only 4 GB free now
    assert not got["small"]["fits"] and got["small"]["capacity_mb"] == int(6 * GB * 0.9) >> 20  # 90 % usable
    assert got["unknown"]["fits"] and got["unknown"]["capacity_mb"] is None
    as_json = [
        {
            "heartbeat": {
                "node_id": "j",
                "version": "x",
                "seq": 1,
                "ts": 0.0,
                "host": "h",
                "capabilities": [],
                "mem_total": 4 * GB,
            },
            "assigned": [],
            "age_s": 0.1,
        }
    ]
    assert fits(6 * GB, as_json)[0]["fits"] is False
