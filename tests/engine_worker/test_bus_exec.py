"""A model's `python`, `env` and `extra_args` choose what a worker runs: from the bus they are dropped unless the
node's own settings allow them (CODERAI_WORKER_BUS_EXEC), so writing an assignment never runs a program."""

from __future__ import annotations

from coderai.contracts import ModelConfig
from coderai.engine_worker.service import Worker
from coderai.engine_worker.settings import WorkerSettings

RISKY = {
    "python": "/tmp/evil/bin/python",
    "env": {"LD_PRELOAD": "/tmp/evil.so"},
    "extra_args": ["--log-file", "/etc/x"],
    "n_ctx": 512,
}


def model() -> ModelConfig:
    return ModelConfig(name="m", engine="vllm", path="/models/m", params=dict(RISKY))


def test_a_node_drops_what_would_run_a_program(caplog):
    w = Worker(WorkerSettings(families=["vllm"]), "n1")
    safe = w._trusted(model())
    assert safe.params == {"n_ctx": 512}
    assert "ignoring env, extra_args, python of m" in caplog.text


def test_a_node_that_allows_it_keeps_them():
    w = Worker(WorkerSettings(families=["vllm"], bus_exec=True), "n1")
    assert w._trusted(model()).params == RISKY


def test_a_model_without_them_is_left_as_it_is():
    w = Worker(WorkerSettings(families=["llama"]), "n1")
    m = ModelConfig(name="t", engine="llama", path="/m.gguf", params={"n_ctx": 256})
    assert w._trusted(m) is m


async def test_a_model_whose_params_are_not_its_familys_is_not_loaded(caplog):
    """Over the bus, checked like input from the internet: an assignment whose model has a param its family does
    not take (one that would be a server flag nobody checked) is refused before anything starts, and reported."""
    from coderai.engine_worker.host import EngineHost

    for params in ({"host": "0.0.0.0"}, {"log_file": "/tmp/pwned"}, {"parallel": "4 --host 0.0.0.0"}):
        cfg = ModelConfig(name="m", engine="llama-server", path="/nowhere/m.gguf", params=params)
        host = EngineHost(None, "n1", cfg, 1.0)  # no bus: the refusal comes before any
        assert await host.load() is False
        assert host.state == "failed" and host.error.startswith("refused: ") and next(iter(params)) in host.error
        print(f"assignment with params {params}: {host.error[:80]}")
