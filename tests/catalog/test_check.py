"""`coderai models check NAME`: whether a model can burst to a pod and why not, asked of real servers: the fake
Hub (what `source` names), the fake RunPod API (its GPU types' memory, with the broker's key) and the head's model
store on disk. A server that cannot be reached is skipped, saying so, and does not stop a burst."""

from __future__ import annotations

import socket

import pytest

from coderai.catalog.cli import main
from coderai.testing.fake_runpod import FakeRunPod


@pytest.fixture
def runpod(monkeypatch):
    with FakeRunPod() as fake:  # GPU types of 24, 48 and 80 GB
        monkeypatch.setenv("CODERAI_POD_BROKER_RUNPOD_API_KEY", fake.api_key)
        monkeypatch.setenv("CODERAI_POD_BROKER_RUNPOD_API_BASE", fake.base_url)
        yield fake


def check(tmp_path, capsys, model: str) -> tuple[int, dict[str, tuple[str, str]], str]:
    """Run the check on a models file holding `model` (TOML keys); (exit status, topic -> (status, text), headline)."""
    (tmp_path / "models.toml").write_text(
        f'[[models]]\nname = "m"\nengine = "llama"\npath = "/nowhere/m.gguf"\n{model}\n'
    )
    rc = main(["--data-dir", str(tmp_path), "check", "m"])
    head, *lines = capsys.readouterr().out.splitlines()
    found = {}
    for line in lines:
        topic, status, text = line.split(None, 2)
        found[topic] = (status, text)
    return rc, found, head


BURST = 'pod = { burst = "when_busy", max_hourly_usd = 2.0 }'


def test_a_model_that_never_bursts_and_names_no_source(tmp_path, capsys, runpod):
    rc, found, head = check(tmp_path, capsys, "memory_mb = 9000")
    assert rc == 1 and head == "m: cannot burst"
    assert found["policy"][0] == "no" and 'pod.burst is "never"' in found["policy"][1]
    assert found["weights"][0] == "no" and "no source: a pod has no copy of /nowhere/m.gguf" in found["weights"][1]
    assert found["size"] == ("ok", "needs about 8.8 GB: 4 of 4 RunPod GPU types hold it in 1 GPU(s)")


def test_a_source_on_the_hub_can_burst(tmp_path, capsys, runpod, fake_hub, hf_env, blob):
    fake_hub.add("acme/m-GGUF", {"m.gguf": blob(300_000)})
    rc, found, head = check(tmp_path, capsys, f'source = "hf://acme/m-GGUF/m.gguf@main"\n{BURST}')
    assert rc == 0 and head == "m: can burst"
    assert found["policy"] == ("ok", "pod.burst = when_busy, 0 to 1 pods, at most $2/h a pod")
    assert found["weights"][0] == "ok" and "m.gguf on " + fake_hub.url in found["weights"][1]
    assert found["size"][0] == "ok" and "memory_mb is not set" in found["size"][1]
    assert [m for m, _p, _r in fake_hub.requests] == ["HEAD"]  # asked, nothing downloaded


@pytest.mark.parametrize(
    "source, needle",
    [
        ("hf://acme/m-GGUF/other.gguf", "no such file"),
        ("hf://acme/nothing", "no repo 'acme/nothing'"),
        ("hf://acme/two-GGUF", "holds 2 GGUF files; pick one"),
    ],
)
def test_a_source_the_hub_does_not_have_cannot_burst(tmp_path, capsys, runpod, fake_hub, hf_env, blob, source, needle):
    fake_hub.add("acme/m-GGUF", {"m.gguf": blob(1000)})
    fake_hub.add("acme/two-GGUF", {"a.gguf": blob(10), "b.gguf": blob(10)})
    rc, found, head = check(tmp_path, capsys, f'source = "{source}"\n{BURST}')
    assert rc == 1 and head == "m: cannot burst"
    assert found["weights"][0] == "no" and needle in found["weights"][1]


def test_too_large_for_every_gpu_type_unless_the_pod_has_more_gpus(tmp_path, capsys, runpod, fake_hub, hf_env, blob):
    fake_hub.add("acme/m-GGUF", {"m.gguf": blob(1000)})
    model = 'source = "hf://acme/m-GGUF/m.gguf"\nmemory_mb = 200000\n'
    rc, found, _ = check(tmp_path, capsys, model + BURST)
    assert rc == 1 and found["size"] == (
        "no",
        "needs about 195.3 GB: no RunPod GPU type holds that in 1 GPU(s) "
        "(the largest: NVIDIA A100 80GB PCIe, 80 GB); raise pod.gpu_count",
    )
    rc, found, _ = check(tmp_path, capsys, model + 'pod = { burst = "always", gpu_count = 4 }')
    assert rc == 0 and found["size"] == ("ok", "needs about 195.3 GB: 2 of 4 RunPod GPU types hold it in 4 GPU(s)")


def test_offline_is_skipped_saying_so(tmp_path, capsys, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    monkeypatch.setenv("CODERAI_POD_BROKER_RUNPOD_API_KEY", "k")
    monkeypatch.setenv("CODERAI_POD_BROKER_RUNPOD_API_BASE", closed)
    rc, found, head = check(tmp_path, capsys, f'source = "hf://acme/m-GGUF/m.gguf"\nmemory_mb = 4000\n{BURST}')
    assert rc == 0 and head == "m: can burst, as far as was checked (2 skipped)"
    assert found["weights"][0] == "skipped" and f"{closed} unreachable (offline?)" in found["weights"][1]
    assert found["size"][0] == "skipped" and "127.0.0.1 unreachable (offline?)" in found["size"][1]


def test_no_runpod_key_skips_the_size(tmp_path, capsys, monkeypatch):
    for var in ("CODERAI_POD_BROKER_RUNPOD_API_KEY", "RUNPOD_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "models" / "acme").mkdir(parents=True)
    (tmp_path / "models" / "acme" / "m.gguf").write_bytes(b"x" * 5000)
    rc, found, _ = check(tmp_path, capsys, f'source = "store://acme/m.gguf"\n{BURST}')
    assert rc == 0
    assert found["weights"][0] == "ok" and "in the head's model store" in found["weights"][1]
    assert found["size"][0] == "skipped" and "no RunPod API key" in found["size"][1]
    rc, found, _ = check(tmp_path, capsys, f'source = "store://acme/gone.gguf"\n{BURST}')
    assert rc == 1 and found["weights"][0] == "no" and "not in the head's model store" in found["weights"][1]


def test_an_unknown_model_or_a_bad_source_is_an_error(tmp_path, capsys):
    (tmp_path / "models.toml").write_text("")
    assert main(["--data-dir", str(tmp_path), "check", "nope"]) == 1
    assert "no model 'nope' on the running stack or in" in capsys.readouterr().err
    (tmp_path / "models.toml").write_text(
        '[[models]]\nname = "m"\nengine = "llama"\npath = "/p"\nsource = "hf://acme"\n'
    )
    assert main(["--data-dir", str(tmp_path), "check", "m"]) == 1
    assert "model 'm': source: 'hf://acme': a Hub repo is hf://<org>/<repo>" in capsys.readouterr().err
