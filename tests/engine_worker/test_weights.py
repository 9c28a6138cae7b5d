"""engine_worker/weights.py in process: where a model's weights land for each kind of `source`, which path the engine
is given, and the events a fetch reports (the worker process end to end: test_weights_source.py)."""

from __future__ import annotations

import hashlib

import pytest

from coderai.catalog import ModelStore
from coderai.contracts import ModelConfig, ModelFetch, StoreChunk, StoreFetch
from coderai.engine_worker.fetch import FetchError
from coderai.engine_worker.weights import ensure_weights
from coderai.testing.fake_hub import FakeHub, blob, hub_env

GGUF = blob(40_000, seed=3)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    hub = FakeHub()
    for k, v in hub_env(hub, str(tmp_path / "hf")).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield hub
    hub.close()


class Events(list):
    async def __call__(self, evt: ModelFetch) -> None:
        self.append(evt)

    def states(self) -> list[str]:
        return [e.state for e in self]


async def head_store(req: StoreFetch, _timeout: float) -> StoreChunk:
    """The head's model store, holding one file."""
    assert req.path == "org/repo/m.gguf"
    return StoreChunk(
        data=GGUF[req.offset : req.offset + req.length], size=len(GGUF), sha256=hashlib.sha256(GGUF).hexdigest()
    )


async def fetch(cfg: ModelConfig, tmp_path, events: Events) -> ModelConfig:
    store = ModelStore(tmp_path / "data", root=tmp_path / "volume")
    return await ensure_weights(cfg, head_store, tmp_path / "data" / "models", store, events, "n1")


@pytest.mark.parametrize(
    "engine, files, want",
    [
        ("llama", {"w.gguf": GGUF, "README.md": b"# w"}, "acme/w/w.gguf"),  # a whole GGUF repo: its one GGUF
        ("embed", {"config.json": b"{}", "model.safetensors": GGUF, "README.md": b"# w"}, "acme/w"),  # a folder model
    ],
)
async def test_a_whole_repo_source_gives_the_engine_its_file_or_folder(hub, tmp_path, engine, files, want):
    hub.add("acme/w", files)
    events = Events()
    got = await fetch(ModelConfig(name="w", engine=engine, path="/nowhere/w", source="hf://acme/w"), tmp_path, events)
    assert got.path == str(tmp_path / "volume" / want) and got.source == "hf://acme/w"
    assert not (tmp_path / "volume" / "acme" / "w" / "README.md").exists()
    assert events.states()[0] == "resolving" and events.states()[-1] == "done"
    assert events[-1].bytes_done == events[-1].bytes_total == sum(len(d) for f, d in files.items() if f != "README.md")


async def test_a_store_source_comes_from_the_heads_store_onto_the_volume(tmp_path):
    events = Events()
    cfg = ModelConfig(name="m", engine="llama", path="/nowhere/m.gguf", source="store://org/repo/m.gguf")
    got = await fetch(cfg, tmp_path, events)
    assert got.path == str(tmp_path / "volume" / "org" / "repo" / "m.gguf") and got.store_path == ""
    assert (tmp_path / "volume" / "org" / "repo" / "m.gguf").read_bytes() == GGUF
    assert events.states() == ["resolving", "done"]


async def test_a_model_whose_path_is_here_fetches_nothing(tmp_path):
    here = tmp_path / "m.gguf"
    here.write_bytes(b"x")
    events = Events()
    cfg = ModelConfig(name="m", engine="llama", path=str(here), source="hf://acme/m/m.gguf")
    assert await fetch(cfg, tmp_path, events) is cfg and events == []


@pytest.mark.parametrize(
    "source, needle",
    [
        ("hf://acme/absent/m.gguf", "no repo 'acme/absent'"),
        ("store://org/repo/other.gguf", "no file 'org/repo/other.gguf'"),
    ],
)
async def test_a_fetch_that_fails_says_why_on_the_bus_and_in_the_error(hub, tmp_path, source, needle):
    async def no_such_file(req, timeout):
        from coderai.contracts import BusError

        raise BusError("not_found", f"no file {req.path!r}")

    events = Events()
    store = ModelStore(tmp_path, root=tmp_path / "volume")
    with pytest.raises(FetchError, match=f"cannot fetch the weights of m from {source}") as ei:
        await ensure_weights(
            ModelConfig(name="m", engine="llama", path="/nowhere", source=source),
            no_such_file,
            tmp_path / "models",
            store,
            events,
            "n1",
        )
    assert needle in str(ei.value)
    assert events.states()[0] == "resolving" and events.states()[-1] == "failed" and needle in events[-1].error


async def test_a_bad_source_from_the_bus_fails_the_load(tmp_path):
    with pytest.raises(FetchError, match="m: source: 'ftp://x/y': unknown scheme"):
        await fetch(ModelConfig(name="m", engine="llama", path="/nowhere", source="ftp://x/y"), tmp_path, Events())
