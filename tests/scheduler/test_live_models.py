"""Models changed while the scheduler runs: the write-back into the models file (other entries and their comments
kept), and a scheduler on a real NATS that serves add and remove and notices an edited models file."""

from __future__ import annotations

import asyncio
import contextlib
import tomllib

import msgspec
import pytest

from coderai.contracts import BusError, ModelConfig, model_key
from coderai.contracts.admin import AddModelRequest, RemoveModelRequest
from coderai.contracts.subjects import CMD_SCHEDULER_ADD, CMD_SCHEDULER_REMOVE
from coderai.contracts.topology import MODELS
from coderai.models_file import entry, load_models, set_entry, write_models_file
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import NatsServer
from coderai.runtime.kv import read_all
from coderai.runtime.lifecycle import wait_for
from coderai.scheduler.service import Scheduler
from coderai.scheduler.settings import SchedulerSettings

FILE = """# the models of this box
[[models]]
name = "a"  # the small one
engine = "llama"
path = "/m/a.gguf"

# b: keep it on w1
[[models]]
name = "b"
engine = "llama"
path = "/m/b.gguf"
nodes = ["w1"]
[models.params]
n_ctx = 4096
"""


def test_entry_keeps_only_what_differs_from_the_defaults():
    cfg = ModelConfig(name="m", engine="llama", path="/m", params={"n_ctx": 8}, keep_alive_s=30.0, resident="on_demand")
    assert entry(cfg) == {
        "name": "m",
        "engine": "llama",
        "path": "/m",
        "params": {"n_ctx": 8},
        "resident": "on_demand",
        "keep_alive_s": 30.0,
    }
    from coderai.contracts.models import PodPolicy

    assert entry(ModelConfig(name="m", engine="echo", path="", pod=PodPolicy(burst="always")))["pod"] == {
        "burst": "always"
    }


def test_replacing_an_entry_keeps_the_others_as_written(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(FILE)
    new = ModelConfig(name="a", engine="llama", path="/m/a2.gguf", params={"n_ctx": 8, "x": {"y": [1, 2.5]}})
    set_entry(str(path), "a", entry(new))
    text = path.read_text()
    assert text.startswith('# the models of this box\n[[models]]\nname = "a"\n')
    assert text.endswith(FILE[FILE.index("# b: keep it on w1") :])  # b, its comment and its sub-table untouched
    assert load_models(str(path))[0] == new


def test_adding_appends_and_removing_takes_only_that_entry(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(FILE)
    set_entry(str(path), "c", {"name": "c", "engine": "echo", "path": ""})
    assert path.read_text().startswith(FILE) and [m.name for m in load_models(str(path))] == ["a", "b", "c"]
    set_entry(str(path), "a", None)
    text = path.read_text()
    assert "the small one" not in text and "# b: keep it on w1" in text and "n_ctx = 4096" in text
    assert [m.name for m in load_models(str(path))] == ["b", "c"]


def test_a_missing_file_is_made_and_a_file_of_another_shape_is_rewritten(tmp_path):
    path = tmp_path / "new" / "models.toml"
    set_entry(str(path), "m", {"name": "m", "engine": "echo", "path": ""})
    assert [m.name for m in load_models(str(path))] == ["m"]
    inline = tmp_path / "inline.toml"  # no [[models]] lines to cut between: rewritten from what it says
    inline.write_text('models = [{ name = "a", engine = "echo", path = "" }]\n')
    set_entry(str(inline), "b", {"name": "b", "engine": "echo", "path": "", "params": {"k": "v"}})
    assert [(m.name, m.params) for m in load_models(str(inline))] == [("a", {}), ("b", {"k": "v"})]
    assert not list(tmp_path.glob(".*.tmp"))  # the temp files were renamed into place


def test_a_value_toml_cannot_hold_is_refused_before_the_file_changes(tmp_path):
    path = write_models_file(tmp_path / "models.toml", [{"name": "a", "engine": "echo", "path": ""}])
    before = path.read_text()
    with pytest.raises(ValueError, match="null"):
        set_entry(str(path), "b", {"name": "b", "engine": "echo", "path": "", "params": {"k": None}})
    assert path.read_text() == before


# --- a scheduler on a real bus -----------------------------------------------------------------------


@pytest.fixture
async def live(tmp_path):
    """A scheduler running from `tmp_path/models.toml` on a NATS of its own, and a bus to talk to it."""
    server = NatsServer(tmp_path / "nats").start()
    path = tmp_path / "models.toml"
    path.write_text(FILE)
    sched = Scheduler(SchedulerSettings(nats_url=server.url, data_dir=str(tmp_path / "data"), models_file=str(path)))
    try:
        async with contextlib.AsyncExitStack() as stack:
            await sched.start(stack, asyncio.Event())
            bus = await Bus.connect(server.url, "test")
            stack.push_async_callback(bus.close)
            yield sched, bus, path
    finally:
        server.stop()


async def published(bus: Bus) -> dict[str, ModelConfig]:
    return {m.name: m for m in (await read_all(await bus.kv(MODELS), ModelConfig)).values()}


async def test_add_and_remove_change_the_bucket_and_the_file_at_once(live):
    sched, bus, path = live
    c = ModelConfig(name="c", engine="llama", path="/m/c.gguf", resident="on_demand", keep_alive_s=20.0)
    reply = await bus.request(CMD_SCHEDULER_ADD, AddModelRequest(model=c, replace=False), timeout=5)
    assert reply.model == c
    assert (await published(bus))["c"] == c and sched.models[-1] == c
    assert tomllib.loads(path.read_text())["models"][-1] == {
        "name": "c",
        "engine": "llama",
        "path": "/m/c.gguf",
        "resident": "on_demand",
        "keep_alive_s": 20.0,
    }
    assert "# b: keep it on w1" in path.read_text()
    with pytest.raises(BusError) as exc:
        await bus.request(CMD_SCHEDULER_ADD, AddModelRequest(model=c, replace=False), timeout=5)
    assert exc.value.code == "conflict"

    reply = await bus.request(CMD_SCHEDULER_REMOVE, RemoveModelRequest(name="a"), timeout=5)
    assert reply.model.path == "/m/a.gguf"
    assert set(await published(bus)) == {"b", "c"} and [m.name for m in sched.models] == ["b", "c"]
    assert [m.name for m in load_models(str(path))] == ["b", "c"]
    with pytest.raises(BusError) as exc:
        await bus.request(CMD_SCHEDULER_REMOVE, RemoveModelRequest(name="a"), timeout=5)
    assert exc.value.code == "not_found"


async def test_an_edited_models_file_is_published_and_an_invalid_one_ignored(live, caplog):
    sched, bus, path = live
    path.write_text(
        FILE.replace('path = "/m/a.gguf"', 'path = "/m/a-v2.gguf"')
        + '\n[[models]]\nname = "d"\nengine = "echo"\npath = ""\n'
    )
    await wait_for(lambda: _when(bus, lambda m: m.get("d") and m["a"].path == "/m/a-v2.gguf"), 10, what="the edit")
    assert set(await published(bus)) == {"a", "b", "d"} and [m.name for m in sched.models] == ["a", "b", "d"]

    path.write_text(FILE + '\n[[models]]\nname = "oops"\nengine = "no-such-engine"\npath = ""\n')
    await wait_for(lambda: _said(caplog, "is invalid"), 10, what="the scheduler to read the invalid file")
    assert set(await published(bus)) == {"a", "b", "d"}  # served as before

    path.write_text(FILE.replace('[[models]]\nname = "a"  # the small one\nengine = "llama"\npath = "/m/a.gguf"\n', ""))
    await wait_for(lambda: _when(bus, lambda m: set(m) == {"b"}), 10, what="a and d to be removed")
    assert [m.name for m in sched.models] == ["b"]
    assert model_key("b") in await (await bus.kv(MODELS)).keys()


async def _said(caplog, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


async def _when(bus: Bus, ok) -> bool:
    return bool(ok(await published(bus)))


async def test_params_over_the_bus_are_the_familys_own_and_never_what_runs(live):
    """Attack: whoever reaches the scheduler's add subject (the admin API, `coderai models`, a pull) passes a
    param that becomes a server flag or chooses a program. Each is refused naming it; nothing is published."""
    sched, bus, path = live
    before = path.read_text()
    for params in (
        {"host": "0.0.0.0"},
        {"log_file": "/etc/passwd"},
        {"trust_remote_code": True},
        {"env": {"LD_PRELOAD": "/tmp/x.so"}},
        {"extra_args": ["--host", "0.0.0.0"]},
        {"n_ctx": -5},
    ):
        bad = ModelConfig(name="evil", engine="llama-server", path="/m/e.gguf", params=params)
        with pytest.raises(BusError) as exc:
            await bus.request(CMD_SCHEDULER_ADD, AddModelRequest(model=bad), timeout=5)
        name = next(iter(params))
        assert exc.value.code == "bad_request" and exc.value.param == f"params.{name}", exc.value
        print(f"scheduler add with params.{name}: refused ({exc.value.message[:60]})")
    assert "evil" not in await published(bus) and path.read_text() == before
    # a model the operator's file gave `env` may be sent back whole (`coderai models set`) but not changed
    own = ModelConfig(name="ops", engine="llama-server", path="/m/o.gguf", params={"env": {"A": "1"}, "n_ctx": 64})
    sched.models.append(own)
    await bus.request(CMD_SCHEDULER_ADD, AddModelRequest(model=msgspec.structs.replace(own, replicas=2)), timeout=5)
    with pytest.raises(BusError) as exc:
        changed = msgspec.structs.replace(own, params={"env": {"A": "2"}, "n_ctx": 64})
        await bus.request(CMD_SCHEDULER_ADD, AddModelRequest(model=changed), timeout=5)
    assert exc.value.param == "params.env"
