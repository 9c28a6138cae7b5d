"""Host pools (the `host` family: engines/host_engine.py, host_pool.py, host_pools_file.py) with real hosts: each is
a real OpenAI-compatible server (coderai.testing.fake_host) that its pool's `start_cmd` starts and its `stop_cmd`
stops, declared in the worker's `<data_dir>/host_pools.toml`. No host up: the first requests start exactly one;
load goes to the least busy; a host killed mid-request hands the request to another, started for it; an idle host
and those up at unload get their stop_cmd. Attacks: a command as a model param, a pools file with a shell string,
an unknown key, a relative program, a URL with a password or a file others may write; a command that hangs is
killed at its timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest

from coderai.contracts import ChatJob, ModelConfig, SamplingParams
from coderai.engine_params import ParamError, check
from coderai.engine_worker.engines import engine_class
from coderai.engine_worker.engines.base import CancelFlag, EngineLoadError, EngineLost
from coderai.engine_worker.engines.host_engine import HostPoolEngine
from coderai.engine_worker.engines.host_pools_file import PoolsError, parse_pools, read_pools
from coderai.models_file import load_models
from coderai.runtime.embedded import free_port
from coderai.testing.fake_host import alive, release, stats
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

HELPER = [sys.executable, "-m", "coderai.testing.fake_host"]


class Lab:
    """Hosts named by word (each answers its name), the pools file declaring them as pool `p`, and the engines
    loaded on it; everything is stopped at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ports: dict[str, int] = {}
        self.engines: list[HostPoolEngine] = []
        self.record = root / "record.txt"
        self.record.touch()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def pidfile(self, name: str) -> str:
        return str(self.root / f"{name}.pid")

    def start_cmd(self, name: str, hold: bool = False, usage: bool = True) -> list[str]:
        port = self.ports.setdefault(name, free_port())
        return [*HELPER, "start", "--port", str(port), "--pidfile", self.pidfile(name), "--name", name] + [
            "--record",
            str(self.record),
            *(["--hold"] if hold else []),
            *([] if usage else ["--no-usage"]),
        ]

    def stop_cmd(self, name: str) -> list[str]:
        return [*HELPER, "stop", "--pidfile", self.pidfile(name), "--name", name, "--record", str(self.record)]

    def host(self, name: str, hold: bool = False, usage: bool = True, **extra: Any) -> dict[str, Any]:
        start = self.start_cmd(name, hold, usage)
        return {"url": self.url(name), "start_cmd": start, "stop_cmd": self.stop_cmd(name), **extra}

    def write(self, hosts: list[dict[str, Any]], down_s: float = 30) -> None:
        lines = [f"[pools.p]\ndown_s = {down_s}"]
        for h in hosts:
            lines.append("[[pools.p.hosts]]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in h.items()]
        (self.root / "host_pools.toml").write_text("\n".join(lines) + "\n")

    def engine(self, **params: Any) -> HostPoolEngine:
        eng = HostPoolEngine(ModelConfig(name="m", engine="host", path="-", params={"pool": "p", **params}))
        self.engines.append(eng)
        eng.load()
        return eng

    def lines(self) -> list[str]:
        return self.record.read_text().split()

    def events(self) -> list[str]:
        words = self.lines()
        return [f"{a} {b}" for a, b in zip(words[::2], words[1::2], strict=True)]

    def healthy(self, name: str) -> bool:
        try:
            return stats(self.url(name))["name"] == name
        except OSError:
            return False

    def pid(self, name: str) -> int:
        return int(Path(self.pidfile(name)).read_text())

    def close(self) -> None:
        for eng in self.engines:
            eng.close()
        for pidfile in self.root.glob("*.pid"):
            try:
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


@pytest.fixture
def lab(tmp_path, monkeypatch):
    monkeypatch.setenv("CODERAI_WORKER_DATA_DIR", str(tmp_path))
    lab = Lab(tmp_path)
    yield lab
    lab.close()


def chat(text: str = "hi", stream: bool = False) -> ChatJob:
    messages = [{"role": "user", "content": text}]
    return ChatJob(request_id="r1", model="m", messages=messages, stream=stream, params=SamplingParams(max_tokens=3))


def answer(eng: HostPoolEngine, stream: bool = False, text: str = "hi") -> str:
    """The answer's text (a host started with --hold holds a request saying `hold`)."""
    if not stream:
        choices, _ = eng.chat(chat(text), CancelFlag(), None)
        return str(choices[0].message["content"])
    pieces: list[str] = []
    eng.chat(
        chat(text, stream=True),
        CancelFlag(),
        lambda delta, text, finish, **_: pieces.append((delta or {}).get("content") or ""),
    )
    return "".join(pieces)


def test_the_family_is_a_worker_engine():
    assert engine_class("host") is HostPoolEngine


def test_with_no_host_up_the_first_requests_start_exactly_one_and_unload_stops_it(lab):
    lab.write([lab.host("alpha"), lab.host("beta")])
    eng = lab.engine()
    assert lab.events() == []  # nothing started at load
    with ThreadPoolExecutor(4) as ex:
        answers = list(ex.map(lambda _: answer(eng), range(4)))
    assert answers == ["alpha alpha alpha"] * 4
    assert lab.events() == ["start alpha"]
    eng.close()
    assert lab.events() == ["start alpha", "stop alpha"]
    assert not lab.healthy("alpha")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_host_that_reports_no_usage_is_billed_all_the_same(lab, stream):
    """A host's server that sends no usage (whole or streamed) leaves the answer counted here (about four
    characters a token), as a remote endpoint's is: never free because its server kept quiet."""
    lab.write([lab.host("quiet", usage=False)])
    eng = lab.engine()
    emit = (lambda *_a, **_k: None) if stream else None
    _, usage = eng.chat(chat("how warm is it in Lisbon in May", stream), CancelFlag(), emit)
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_load_goes_to_the_host_with_fewest_requests_in_flight(lab):
    hosts = [lab.host("alpha", hold=True), lab.host("beta", hold=True)]
    lab.write(hosts)
    for h in hosts:  # both running before the model loads: it takes them as up
        subprocess.run(h["start_cmd"], check=True, timeout=30)
    wait_until(lambda: lab.healthy("alpha") and lab.healthy("beta"), 30, "both hosts up")
    eng = lab.engine()
    with ThreadPoolExecutor(4) as ex:
        futures = [ex.submit(answer, eng, i % 2 == 0, "hold") for i in range(4)]
        wait_until(lambda: stats(lab.url("alpha"))["held"] + stats(lab.url("beta"))["held"] == 4, 30, "4 held")
        assert stats(lab.url("alpha"))["held"] == stats(lab.url("beta"))["held"] == 2
        release(lab.url("alpha"))
        release(lab.url("beta"))
        answers = sorted(f.result(timeout=60) for f in futures)
    assert answers == ["alpha alpha alpha"] * 2 + ["beta beta beta"] * 2
    assert lab.events() == ["start alpha", "start beta"]  # the test's own starts: none by the pool


@pytest.mark.parametrize("stream", [True, False])
def test_a_host_killed_mid_request_hands_it_to_another_started_for_it_then_idle_hosts_stop(lab, stream):
    lab.write([lab.host("alpha", hold=True, idle_stop_s=0.3), lab.host("beta", idle_stop_s=0.3)])
    eng = lab.engine()
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(answer, eng, stream, "hold")
        wait_until(lambda: lab.healthy("alpha") and stats(lab.url("alpha"))["held"] == 1, 30, "alpha holds it")
        assert lab.events() == ["start alpha"]  # busy, it is not stopped for being idle
        os.kill(lab.pid("alpha"), signal.SIGKILL)
        assert pending.result(timeout=60) == "beta beta beta"
    assert lab.events()[:2] == ["start alpha", "start beta"]
    wait_until(lambda: "stop beta" in lab.events(), 30, "beta stopped when idle")
    assert not lab.healthy("beta")
    assert lab.events().count("start beta") == 1


def hang(lab: Lab) -> list[str]:
    """A start command that never ends, its pid in the lab's `stuck.pid` (a shell only because the test says so:
    it writes its pid within milliseconds, then becomes the sleep)."""
    return ["/bin/sh", "-c", f"echo $$ > {lab.pidfile('stuck')}; exec sleep 3600"]


def test_a_hanging_start_command_is_killed_at_its_timeout_and_the_next_host_serves(lab):
    lab.write(
        [{"url": f"http://127.0.0.1:{free_port()}", "start_cmd": hang(lab), "cmd_timeout_s": 2}, lab.host("beta")]
    )
    eng = lab.engine()
    began = time.monotonic()
    assert answer(eng) == "beta beta beta"
    assert time.monotonic() - began < 30
    wait_until(lambda: not alive(lab.pid("stuck")), 10, "the hanging command killed")
    assert lab.events() == ["start beta"]


def test_no_host_that_can_start_is_a_clean_retryable_error(lab):
    fails = [sys.executable, "-c", "raise SystemExit(3)"]
    lab.write(
        [
            {"url": f"http://127.0.0.1:{free_port()}", "start_cmd": hang(lab), "cmd_timeout_s": 2},
            {"url": f"http://127.0.0.1:{free_port()}", "start_cmd": fails},
            {"url": f"http://127.0.0.1:{free_port()}"},
        ]
    )
    eng = lab.engine()
    with pytest.raises(EngineLost) as got:
        answer(eng)
    msg = str(got.value)
    assert "still running after 2s, killed" in msg and "exited 3" in msg and "no start_cmd" in msg
    wait_until(lambda: not alive(lab.pid("stuck")), 10, "the hanging command killed")


def test_a_request_cancelled_while_its_host_starts_stops_waiting(lab):
    lab.write([{"url": f"http://127.0.0.1:{free_port()}", "start_cmd": hang(lab), "cmd_timeout_s": 60}])
    eng = lab.engine()
    cancel = CancelFlag()
    with ThreadPoolExecutor(1) as ex:
        pending = ex.submit(eng.chat, chat(), cancel, None)
        wait_until(lambda: alive(lab.pid("stuck")), 10, "the start command running")
        cancel.set()
        with pytest.raises(EngineLost, match="cancelled"):
            pending.result(timeout=10)
    os.kill(lab.pid("stuck"), signal.SIGKILL)  # the start goes on without it; ended here, not at its timeout


def test_commands_are_never_model_params():
    for source in (False, True):  # neither the API nor the bus nor an operator's models file
        for name in ("start_cmd", "stop_cmd", "hosts", "url"):
            with pytest.raises(ParamError, match=f"takes no param '{name}'"):
                check("host", {"pool": "p", name: ["/bin/sh", "-c", "id"]}, operator=source)
    with pytest.raises(ParamError, match="at most 64"):
        check("host", {"pool": "p" * 65}, operator=False)
    check("host", {"pool": "p", "served_model": "x", "api_key_secret": "k", "timeout_s": 5}, operator=False)


BAD_FILES = {
    'start_cmd = "ssh box start"': "without a shell",
    'start_cmd = ["ssh box start"]': "holds spaces",
    'start_cmd = ["./start.sh"]': "relative path",
    'stop_cmd = ["bin/stop"]': "relative path",
    "start_cmd = []": "length",
    "shell = true": "unknown field `shell`",
    'health_path = "/../../etc"': "health_path",
    "idle_stop_s = -1": "idle_stop_s",
}


@pytest.mark.parametrize("line", list(BAD_FILES))
def test_a_pools_file_with_a_shell_string_unknown_key_or_relative_program_is_refused(line):
    text = f'[pools.p]\n[[pools.p.hosts]]\nurl = "http://127.0.0.1:1"\n{line}\n'
    with pytest.raises(PoolsError, match=BAD_FILES[line]):
        parse_pools(text)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://box/", "http"),
        ("file:///etc/passwd", "http"),
        ("http://user:hunter2@box:8080", "no user or password"),
        ("http://box:8080/?x=1", "query"),
    ],
)
def test_a_pools_file_url_that_is_not_plain_http_is_refused(url, why):
    with pytest.raises(PoolsError, match=why) as got:
        parse_pools(f'[pools.p]\n[[pools.p.hosts]]\nurl = "{url}"\n')
    assert "hunter2" not in str(got.value)  # a password is never repeated


def test_a_pools_file_others_may_write_or_a_missing_pool_fails_the_load_saying_why(lab):
    lab.write([lab.host("alpha")])
    path = lab.root / "host_pools.toml"
    assert set(read_pools(path)) == {"p"}
    path.chmod(0o666)
    with pytest.raises(EngineLoadError, match="writable by every user"):
        lab.engine()
    path.chmod(0o600)
    with pytest.raises(EngineLoadError, match="no pool 'q'"):
        lab.engine(pool="q")
    path.unlink()
    with pytest.raises(EngineLoadError, match="no host pools file at"):
        lab.engine()
    assert lab.events() == []


def test_the_docs_examples_are_what_the_loaders_take(tmp_path):
    text = (Path(__file__).resolve().parents[2] / "docs" / "modalities.md").read_text()
    section = text.split("### `host`: hosts started on demand", 1)[1].split("\n### ", 1)[0]
    model, pools = re.findall(r"```toml\n(.*?)```", section, flags=re.S)
    (tmp_path / "models.toml").write_text(model)
    [cfg] = load_models(str(tmp_path / "models.toml"))
    check(cfg.engine, dict(cfg.params), operator=False)
    [pool] = parse_pools(pools).values()
    assert [h.url for h in pool.hosts] == ["http://10.0.0.5:8080", "http://10.0.0.6:8080"]
    assert pool.hosts[0].stop_cmd and pool.hosts[1].stop_cmd is None


@pytest.mark.slow
def test_through_a_stack_a_host_killed_mid_request_hands_it_on_and_the_idle_host_stops(tmp_path):
    """The same, end to end: a worker reads the pools file of its own data dir, the gateway's stream is answered by
    the host started for it after the first was killed, and the idle one gets its stop_cmd."""
    (tmp_path / "w1").mkdir()
    lab = Lab(tmp_path / "w1")  # the stack's worker w1 keeps its data in <root>/w1
    lab.write([lab.host("alpha", hold=True), lab.host("beta", idle_stop_s=0.5)])
    models = [{"name": "pooled", "engine": "host", "path": "-", "params": {"pool": "p", "served_model": "x"}}]
    try:
        with running_stack(tmp_path, models, gateway_args=("--no-auth",)) as stack:
            assert lab.events() == ["start alpha"]  # the stack's own first chat started one host
            client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=60)

            def streamed() -> str:
                messages: Any = [{"role": "user", "content": "please hold"}]
                chunks = client.chat.completions.create(model="pooled", messages=messages, max_tokens=3, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

            with ThreadPoolExecutor(1) as ex:
                pending = ex.submit(streamed)
                wait_until(lambda: stats(lab.url("alpha"))["held"] == 1, 30, "alpha holds the request")
                os.kill(lab.pid("alpha"), signal.SIGKILL)
                assert pending.result(timeout=60) == "beta beta beta"
            assert lab.events() == ["start alpha", "start beta"]
            wait_until(lambda: "stop beta" in lab.events(), 30, "beta stopped when idle")
            assert not lab.healthy("beta")
    finally:
        lab.close()
