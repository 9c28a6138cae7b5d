"""Thermal supervision (issue 43, item 6): a card over its temperature limit takes no new work until it cools.

The sources read for real: a file the test rewrites, a fake `nvidia-smi` program run as the worker runs the real
one, thermal zones in a fake sysfs folder. The worker part runs a real worker's engines on the bus (the echo
engine paced by `token_delay_s`): a hot sensor pauses the engines it holds (in-flight jobs finish, new ones find
no engine), the heartbeat says which sensors are hot, and cooling below the resume mark brings them back."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import sys
from pathlib import Path

import msgspec
import pytest

from coderai.contracts import Assignment, BusError, ChatJob, Chunk, Final, Frame, Heartbeat, ModelConfig, decode
from coderai.contracts import SamplingParams
from coderai.contracts.admin import DrainRequest
from coderai.contracts.subjects import ENGINE_CHAT, HEARTBEAT
from coderai.engine_worker import thermal
from coderai.engine_worker.host import EngineHost, engine_id_for
from coderai.engine_worker.service import Worker
from coderai.engine_worker.settings import WorkerSettings
from coderai.engine_worker.thermal import NODE, FileSource, SmiSource, SysfsSource, Thermal
from coderai.runtime.bus import Bus
from coderai.runtime.lifecycle import wait_for
from coderai.runtime.settings import SettingsError, load_settings


class Fixed:
    name = "fixed"

    def __init__(self) -> None:
        self.readings: thermal.Readings = {}
        self.problems: list[str] = []

    def read(self) -> thermal.Read:
        return dict(self.readings), list(self.problems)


# --- readings -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "readings"),
    [
        ("91.5", {NODE: 91.5}),
        ("72\n", {NODE: 72.0}),
        ('{"0": 45, "1": 91.5, "node": 60}', {"0": 45.0, "1": 91.5, NODE: 60.0}),
    ],
)
def test_a_thermal_file_is_a_number_or_an_object_of_sensors(text, readings):
    assert thermal.parse_json(text) == (readings, [])


@pytest.mark.parametrize(
    "text",
    [
        "hot",
        "",
        "NaN",  # JSON as Python reads it: a float, but no temperature
        "1e999",
        "-300",
        "1000",
        "true",
        '"85"',
        "[85]",
        "null",
        '{"0": "hot"}',
        '{"0": true}',
        '{"0": 9000}',
        '{"gpu0": 50}',
        '{"-1": 50}',
        '{"0": {"nested": 1}}',
        "[" * 100_000,
        "\udcff\x00garbage",
    ],
)
def test_garbage_in_a_thermal_file_is_no_reading_and_says_why(text):
    readings, problems = thermal.parse_json(text)
    assert readings == {} and len(problems) == 1 and len(problems[0]) < 120


def test_good_sensors_are_kept_beside_bad_ones_and_their_number_is_bounded():
    readings, problems = thermal.parse_json(json.dumps({"0": 50, "1": "x", "2": 70}))
    assert readings == {"0": 50.0, "2": 70.0} and problems == ["sensor 1: not a temperature: 'x'"]
    many = {str(i): 40 for i in range(500)}
    readings, problems = thermal.parse_json(json.dumps(many))
    assert len(readings) == thermal.MAX_SENSORS and "436 sensors" in problems[-1]


def test_nvidia_smi_output_is_read_line_by_line():
    text = "0, 45\n1, 92\n2, [N/A]\nno comma\n\n3, 1e9\n"
    readings, problems = thermal.parse_smi(text)
    assert readings == {"0": 45.0, "1": 92.0}
    assert len(problems) == 3 and "[N/A]" in problems[0]


def _zone(root: Path, n: int, content: str | None) -> None:
    zone = root / f"thermal_zone{n}"
    zone.mkdir(parents=True)
    if content is None:
        (zone / "temp").mkdir()  # reading it fails as an unreadable sensor does
    else:
        (zone / "temp").write_text(content)


def test_sysfs_thermal_zones_give_the_machine_its_hottest_zone(tmp_path):
    _zone(tmp_path, 0, "45000\n")
    _zone(tmp_path, 1, "91500\n")
    _zone(tmp_path, 2, "garbage\n")
    _zone(tmp_path, 3, None)
    _zone(tmp_path, 4, "-273000\n")  # what a broken ACPI zone reports
    (tmp_path / "cooling_device0").mkdir()
    readings, problems = SysfsSource(tmp_path).read()
    assert readings == {NODE: 91.5}
    assert len(problems) == 3 and {p.split(":")[0] for p in problems} == {
        "thermal_zone2",
        "thermal_zone3",
        "thermal_zone4",
    }
    assert thermal.read_sysfs(tmp_path / "absent") == ({}, [])


def test_the_file_source_reads_only_a_regular_file_of_bounded_size(tmp_path):
    path = tmp_path / "temps.json"
    source = FileSource(str(path))
    assert source.read()[0] == {} and "cannot read" in source.read()[1][0]
    path.write_text('{"0": 88}')
    assert source.read() == ({"0": 88.0}, [])
    path.write_bytes(b" " * (thermal.MAX_FILE_BYTES + 1))
    assert source.read()[0] == {} and "over" in source.read()[1][0]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes to it: opening it for a blocking read would hang
    assert FileSource(str(fifo)).read() == ({}, [f"{fifo} is not a regular file"])
    assert FileSource("/dev/zero").read() == ({}, ["/dev/zero is not a regular file"])
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def _program(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\nimport sys\n{body}\n")
    path.chmod(0o755)
    return str(path)


def test_nvidia_smi_is_run_with_its_query_and_without_a_shell(tmp_path):
    smi = _program(
        tmp_path,
        "nvidia-smi",
        "assert sys.argv[1:] == ['--query-gpu=index,temperature.gpu', '--format=csv,noheader,nounits'], sys.argv\n"
        "print('0, 93'); print('1, 41')",
    )
    assert SmiSource(smi).read() == ({"0": 93.0, "1": 41.0}, [])
    failing = _program(tmp_path, "smi-fails", "print('NVIDIA-SMI has failed', file=sys.stderr); sys.exit(9)")
    assert SmiSource(failing).read() == ({}, ["nvidia-smi exited with code 9: 'NVIDIA-SMI has failed'"])
    hung = _program(tmp_path, "smi-hangs", "import threading; threading.Event().wait()")
    assert SmiSource(hung, timeout_s=0.5).read() == ({}, ["nvidia-smi did not answer within 0.5 s"])
    readings, problems = SmiSource(str(tmp_path / "gone")).read()
    assert readings == {} and problems[0].startswith("cannot run nvidia-smi")


def test_the_source_is_the_file_else_nvidia_smi_else_thermal_zones_else_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))  # no nvidia-smi anywhere
    sysfs = tmp_path / "sys"
    assert thermal.pick_source(nvml=False, sysfs=sysfs) is None
    _zone(sysfs, 0, "50000")
    assert isinstance(thermal.pick_source(nvml=False, sysfs=sysfs), SysfsSource)
    smi = _program(tmp_path, "nvidia-smi", "print('0, 40')")
    assert isinstance(found := thermal.pick_source(smi=smi, nvml=False, sysfs=sysfs), SmiSource)
    assert found.binary == smi
    assert isinstance(thermal.pick_source(file=str(tmp_path / "t.json"), smi=smi, nvml=False), FileSource)
    assert thermal.thermal_for("", 0.0, 80.0) is None  # limit 0: not watched


def test_settings_and_a_resume_mark_at_or_over_the_limit(tmp_path, caplog):
    s = load_settings(WorkerSettings, "worker", env={"CODERAI_WORKER_THERMAL_FILE": "/tmp/t.json"})
    assert (s.thermal_limit_c, s.thermal_resume_c, s.thermal_file) == (90.0, 80.0, "/tmp/t.json")
    with pytest.raises(SettingsError, match="CODERAI_WORKER_THERMAL_POLL_S"):
        load_settings(WorkerSettings, "worker", env={"CODERAI_WORKER_THERMAL_POLL_S": "0"})
    caplog.set_level(logging.INFO, "coderai.engine_worker")
    t = thermal.thermal_for(str(tmp_path / "t.json"), 85.0, 95.0)  # no hysteresis: cool as soon as under 85
    assert t is not None and t.resume_c == 85.0
    assert "is not below CODERAI_WORKER_THERMAL_LIMIT_C" in caplog.text
    t.update({"0": 85.0})
    assert t.update({"0": 84.9}) == (set(), {"0"})


# --- hysteresis -----------------------------------------------------------------------------------------------


def test_hot_at_the_limit_and_cool_only_below_the_resume_mark(caplog):
    t = Thermal(Fixed(), limit_c=90, resume_c=80)
    caplog.set_level(logging.INFO, "coderai.engine_worker")
    assert t.update({"0": 89.9, "1": 50}) == (set(), set()) and not t.hot
    assert t.update({"0": 90.0}) == ({"0"}, set()) and t.hot == {"0"}
    assert t.update({"0": 95.0}) == (set(), set())  # still hot: no second line
    assert t.update({"0": 85.0}) == (set(), set()) and t.hot == {"0"}  # between the marks: stays hot
    assert t.update({}) == (set(), set()) and t.hot == {"0"}  # no reading: no change
    assert t.update({"0": 79.5}) == (set(), {"0"}) and not t.hot
    lines = [r.getMessage() for r in caplog.records if r.name == "coderai.engine_worker"]
    assert len(lines) == 2 and "GPU 0 is at 90.0 °C" in lines[0] and "GPU 0 cooled to 79.5 °C" in lines[1]


def test_a_hot_card_holds_the_engines_on_it_and_those_that_name_none():
    t = Thermal(Fixed(), limit_c=90, resume_c=80)
    assert not t.holds([]) and not t.holds([0])
    t.update({"0": 91, "1": 60})
    assert t.holds([0]) and t.holds([1, 0]) and not t.holds([1])
    assert t.holds([])  # its default device may be any card
    assert t.hot_temps() == {"0": 91.0}
    t.update({NODE: 99, "0": 70})
    assert t.holds([1]) and t.hot_temps() == {NODE: 99.0}


async def test_garbage_readings_are_ignored_with_one_warning_while_they_last(caplog):
    source = Fixed()
    t = Thermal(source, limit_c=90, resume_c=80)
    caplog.set_level(logging.DEBUG, "coderai.engine_worker")
    source.readings, source.problems = {"0": 95}, ["sensor 1: not a temperature: 'x'"]
    assert await t.poll() is True and t.hot == {"0"}
    assert await t.poll() is False
    warned = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert [r.levelno for r in warned] == [logging.WARNING, logging.DEBUG]


# --- the worker -----------------------------------------------------------------------------------------------


def _cfg(name: str, devices: list[int] | None = None) -> ModelConfig:
    return ModelConfig(
        name=name, engine="echo", path="-", params={"reply": name, "token_delay_s": 0.02}, devices=devices or []
    )


@pytest.fixture
async def hot_worker(bus, unique, tmp_path):
    temps = tmp_path / "temps.json"
    temps.write_text('{"0": 50, "1": 50}')
    s = WorkerSettings(families=["echo"], mdns=False, thermal_file=str(temps), thermal_poll_s=0.05)
    w = Worker(s, f"n{unique}")
    w.bus = bus  # as start() would connect it; the thermal watch as start() makes it
    w.thermal = thermal.thermal_for(s.thermal_file, s.thermal_limit_c, s.thermal_resume_c)
    yield w, temps
    await w._unload_all()


async def _ask(bus: Bus, w: Worker, model: str, tokens: int = 2, logit_bias: dict[str, float] | None = None):
    job = ChatJob(
        request_id=f"r-{model}-{tokens}",
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        params=SamplingParams(max_tokens=tokens, logit_bias=logit_bias),
    )
    return await bus.open_stream(
        ENGINE_CHAT, job, idle_timeout_s=20, node_id=w.node_id, engine_id=engine_id_for(w.node_id, model)
    )


async def _answer(stream) -> list:
    frames: list = []
    while not isinstance(frames[-1] if frames else None, Final):
        frames.append(decode(await stream.next_raw(), Frame))
    stream.close()
    return frames


async def _load(w: Worker, *cfgs: ModelConfig) -> list[EngineHost]:
    await w.converge(Assignment(node_id=w.node_id, models=list(cfgs)))
    await wait_for(lambda: all(w.hosts[c.name].state == "ready" for c in cfgs), 30, what="the loads")
    return [w.hosts[c.name] for c in cfgs]


async def test_a_hot_card_takes_no_new_work_finishes_what_runs_and_resumes_when_cool(bus, hot_worker):
    w, temps = hot_worker
    on0, on1 = await _load(w, _cfg("on0", [0]), _cfg("on1", [1]))
    beats: list[Heartbeat] = []

    async def heard(hb: Heartbeat, _m) -> None:
        beats.append(hb)

    sub = await bus.listen(HEARTBEAT, heard, subject_str=HEARTBEAT(node_id=w.node_id))
    try:
        running = await _ask(bus, w, "on0", tokens=40)  # 0.8 s of tokens, in flight when the card turns hot
        first = decode(await running.next_raw(), Frame)
        assert isinstance(first, Chunk) and on0.in_flight == 1

        temps.write_text('{"0": 93.5, "1": 60}')
        assert await w.thermal.poll() is True
        await w.hold()
        assert (on0.state, on1.state) == ("draining", "ready")
        with pytest.raises(
            BusError
        ) as refused:  # a new job for the hot card finds no engine: the router goes elsewhere
            await _answer(await _ask(bus, w, "on0"))
        assert refused.value.code == "no_engine"
        assert _text(await _answer(await _ask(bus, w, "on1"))) == "on1 on1"  # the cool card serves on
        done = [first, *await _answer(running)]
        assert done[-1].usage.completion_tokens == 40  # what ran when it turned hot finished
        await wait_for(lambda: any(b.hot == {"0": 93.5} for b in beats), 10, what="a heartbeat saying GPU 0 is hot")
        assert any(e.state == "draining" and e.model == "on0" for e in beats[-1].engines)

        temps.write_text('{"0": 85, "1": 60}')  # under the limit, over the resume mark: still hot
        assert await w.thermal.poll() is False and on0.state == "draining"
        temps.write_text('{"0": 79, "1": 60}')
        beats.clear()
        assert await w.thermal.poll() is True
        await w.hold()
        assert on0.state == "ready"
        assert _text(await _answer(await _ask(bus, w, "on0"))) == "on0 on0"
        await wait_for(lambda: any(not b.hot for b in beats), 10, what="a heartbeat without hot sensors")
        assert "hot" not in msgspec.json.decode(msgspec.json.encode(beats[-1]))  # left out: older readers see no field
    finally:
        await sub.unsubscribe()


async def test_the_watch_polls_by_itself_and_a_drain_outlasts_the_heat(bus, hot_worker):
    w, temps = hot_worker
    [host] = await _load(w, _cfg("any"))  # no device named: any hot card holds it
    assert w.thermal is not None
    watch = asyncio.create_task(w.thermal.run(w.settings.thermal_poll_s, w.hold))
    try:
        temps.write_text('{"1": 120}')
        await wait_for(lambda: host.state == "draining", 10, what="the watch to pause the engine")
        temps.write_text('{"1": "garbage"}')  # a bad reading in between changes nothing
        await wait_for(lambda: w.thermal is not None and w.thermal._problems, 10, what="the bad reading")
        assert host.state == "draining"
        await w._drain(DrainRequest(drain=True), None)
        temps.write_text('{"1": 40}')
        await wait_for(lambda: w.thermal is not None and not w.thermal.hot, 10, what="the card to cool")
        assert host.state == "draining"  # cool, but the node drains
        await w._drain(DrainRequest(drain=False), None)
        assert host.state == "ready"
        temps.write_text(json.dumps({NODE: 95}))  # the machine as a whole
        await wait_for(lambda: host.state == "draining", 10, what="the hot machine to pause it")
        await w.converge(Assignment(node_id=w.node_id, models=[_cfg("any"), _cfg("late", [3])]))
        await wait_for(
            lambda: w.hosts["late"].load_s > 0 and w.hosts["late"].state == "draining",
            30,
            what="a copy loaded while the machine is hot to start paused",
        )
    finally:
        watch.cancel()


def _text(frames: list) -> str:
    return "".join(f.delta.get("content", "") for f in frames if isinstance(f, Chunk) and f.delta)


@pytest.mark.slow
async def test_a_real_llama_server_on_a_hot_card_finishes_its_stream_and_serves_again_when_cool(
    bus, unique, tmp_path, tiny_gguf
):
    """The same, on a real child server (llama-server on the tiny GGUF): a long stream in flight when its card
    turns hot finishes whole, a new job is refused, and the server serves again once the card cools."""
    from coderai.runtime.embedded import find_llama_server

    if find_llama_server() is None:
        pytest.fail("no llama-server binary: scripts/setup builds it")
    temps = tmp_path / "temps.json"
    temps.write_text('{"0": 50}')
    s = WorkerSettings(families=["llama-server"], mdns=False, thermal_file=str(temps), thermal_poll_s=0.05)
    w = Worker(s, f"n{unique}")
    w.bus = bus
    w.thermal = thermal.thermal_for(s.thermal_file, s.thermal_limit_c, s.thermal_resume_c)
    cfg = ModelConfig(
        name="ls0", engine="llama-server", path=str(tiny_gguf), params={"n_ctx": 512, "parallel": 2}, devices=[0]
    )
    try:
        [host] = await _load(w, cfg)
        # every end-of-generation token biased away (llama.cpp ends at <|endoftext|> too, by its text): a stream the
        # tiny model ended after one token would prove nothing
        ends = [
            host.engine.post_json("/tokenize", {"content": t, "parse_special": True}, "t")["tokens"][0]
            for t in ("<|im_end|>", "<|endoftext|>")
        ]
        running = await _ask(bus, w, "ls0", tokens=200, logit_bias={str(t): -100.0 for t in ends})
        first = decode(await running.next_raw(), Frame)
        assert isinstance(first, Chunk)
        temps.write_text('{"0": 97}')
        assert await w.thermal.poll() is True
        await w.hold()
        assert host.state == "draining"
        with pytest.raises(BusError) as refused:
            await _answer(await _ask(bus, w, "ls0"))
        assert refused.value.code == "no_engine"
        done = [first, *await _answer(running)]
        assert isinstance(done[-1], Final) and done[-1].usage.completion_tokens > 1  # finished, not cut
        temps.write_text('{"0": 60}')
        assert await w.thermal.poll() is True
        await w.hold()
        assert host.state == "ready"
        again = await _answer(await _ask(bus, w, "ls0", tokens=4))
        assert isinstance(again[-1], Final) and again[-1].usage.completion_tokens > 0
    finally:
        await w._unload_all()
