"""ChildServer with a tiny real child (the stand-in OpenAI server run as `python -m coderai.testing.fake_openai`, or a
script that fails): start and health, its log, a failed or hung start, restart after a crash, stop and close. And
OpenAIServerEngine as the two parts put together, on the same child."""

from __future__ import annotations

import os
import signal
import sys
import threading

import httpx
import pytest

from coderai.contracts import ChatJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines.base import CancelFlag, EngineLoadError
from coderai.engine_worker.engines.child_server import ChildServer
from coderai.engine_worker.engines.openai_server import OpenAIServerEngine
from coderai.testing.fake_openai import REPLY
from coderai.testing.procs import wait_until


def fake_command(port: int) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "-m", "coderai.testing.fake_openai", str(port)], dict(os.environ)


def script(code: str):
    def command(port: int) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-c", code], dict(os.environ)

    return command


def gone(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def closing():
    made: list[ChildServer] = []
    yield made.append
    for child in made:
        child.close()


def test_a_started_child_is_healthy_logs_and_stops_with_its_group(closing):
    child = ChildServer(fake_command, label="fake", serving="m", log_name="fake")
    closing(child)
    child.start()
    assert child.running() and child.state() == "it is running"
    assert httpx.get(f"{child.base_url}/health").status_code == 200
    assert f"fake OpenAI server on port {child.port}" in child.log_head()
    assert f"port {child.port}" in child.log_tail()
    pid, log_path = child.proc.pid, child.log_path
    child.stop()
    assert child.proc is None and not child.running() and child.state() == "it exited"
    assert not os.path.exists(log_path) and gone(pid)


def test_a_child_that_exits_fails_its_start_with_its_log_tail(closing):
    child = ChildServer(
        script("print('no model here', flush=True); raise SystemExit(3)"), label="fake", serving="/models/m.gguf"
    )
    closing(child)
    with pytest.raises(EngineLoadError) as err:
        child.start()
    assert str(err.value).startswith("fake exited with code 3 while loading /models/m.gguf; its log ends:")
    assert "no model here" in str(err.value) and child.proc is None and child.log_path == ""


def test_a_child_that_never_answers_fails_at_its_deadline(closing):
    child = ChildServer(script("import signal; signal.pause()"), label="fake", start_timeout_s=0.5)
    closing(child)
    with pytest.raises(EngineLoadError, match="fake was not healthy after 0 s"):
        child.start()
    assert child.proc is None


def test_close_during_a_start_ends_it_at_once(closing):
    child = ChildServer(script("import signal; signal.pause()"), label="fake", start_timeout_s=600)
    failed: list[Exception] = []

    def start() -> None:
        try:
            child.start()
        except EngineLoadError as exc:
            failed.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    wait_until(lambda: child.proc is not None, 30, "the child to start")
    child.close()
    starting.join(30)
    assert not starting.is_alive() and "fake was stopped" in str(failed[0])
    with pytest.raises(EngineLoadError, match="closed"):
        child.start()


def test_a_crashed_child_is_restarted_and_close_stops_the_watch(closing):
    child = ChildServer(fake_command, label="fake", name="m", log_name="fake")
    closing(child)
    child.start()
    alive, exits, restarted = threading.Event(), [], threading.Event()
    child.supervise(
        on_alive=lambda probe: alive.set(),
        on_exit=exits.append,
        on_restart=restarted.set,
        poll_s=0.05,
        backoff_s=(0.05,),
    )
    assert alive.wait(30), "the watch never saw the child alive"
    first = child.proc.pid
    os.kill(first, signal.SIGKILL)
    assert restarted.wait(60), "the child was not restarted"
    assert child.running() and child.proc.pid != first and child.restarts == 1
    assert exits[0].startswith("fake exited with code -9; its log ends:\nfake OpenAI server on port")
    assert httpx.get(f"{child.base_url}/health").status_code == 200
    watcher, pid = child._supervisor, child.proc.pid
    child.close()
    assert not watcher.is_alive() and child.proc is None and gone(pid) and child.restarts == 1


def test_a_child_that_dies_again_and_again_is_parked_not_restarted_forever(closing):
    """Crash-loop quarantine: the third death within the window parks the server, saying why (the engine reports
    that as its failure), and no restart follows; a child placed anew (a new ChildServer) starts clean."""
    child = ChildServer(fake_command, label="fake", name="m", log_name="fake", crash_limit=3, crash_window_s=600)
    closing(child)
    child.start()
    exits: list[str] = []
    restarted = threading.Semaphore(0)
    child.supervise(on_exit=exits.append, on_restart=restarted.release, poll_s=0.05, backoff_s=(0.05,))
    for death in range(3):
        wait_until(lambda: child.running(), 30, "the child to run")
        os.kill(child.proc.pid, signal.SIGKILL)
        if death < 2:
            assert restarted.acquire(timeout=60), f"death {death + 1} was not followed by a restart"
    wait_until(lambda: len(exits) == 3, 30, "the third death to be seen")
    watcher = child._supervisor
    watcher.join(10)
    print(f"the third death: {exits[-1][:160]!r}")
    assert not watcher.is_alive() and child.restarts == 2 and not child.running()
    assert exits[-1].startswith("quarantined: fake died 3 times within 600 s and is not restarted again")
    assert child.quarantined == exits[-1] and not exits[0].startswith("quarantined")


class FakeServerEngine(OpenAIServerEngine):
    family = "fake"
    label = "fake-server"
    key_env = "FAKE_OPENAI_KEY"

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        return fake_command(port)


def test_the_engine_is_the_child_and_a_client_that_carries_its_key():
    engine = FakeServerEngine(ModelConfig(name="m", engine="fake", path="/models/m"))
    try:
        engine.load()
        job = ChatJob(request_id="r", model="m", messages=[{"role": "user", "content": "hi"}], params=SamplingParams())
        choices, usage = engine.chat(job, CancelFlag(), None)
        assert choices[0].message["content"] == REPLY and usage.completion_tokens == 5
        assert engine.stats()["prompt_tokens"] == 1
        # only the engine knows the child's key
        assert httpx.post(f"{engine.base_url}/v1/chat/completions", json={"messages": []}).status_code == 401
        engine.child.stop()
        with pytest.raises(RuntimeError, match="fake-server unreachable .*; it exited"):
            engine.chat(job, CancelFlag(), None)
        engine.start_server()  # a new child on a new port: the client follows it, the counters go on
        assert engine.chat(job, CancelFlag(), None)[1].cached_tokens == 0 and engine.stats()["prompt_tokens"] == 2
    finally:
        engine.close()
    assert engine.proc is None and engine.client is None
    with pytest.raises(RuntimeError, match="fake-server is not loaded"):
        engine.chat(job, CancelFlag(), None)
