"""GPU memory in the heartbeat: parsed from nvidia-smi where NVML cannot be loaded, none without a driver."""

from __future__ import annotations

import os
import stat

from coderai.engine_worker.node import GpuProbe, build_heartbeat, parse_smi_memory


def test_parse_smi_memory_reads_mib_per_gpu_and_skips_noise():
    text = "81559, 80000\n24576, 1024\n[N/A], [N/A]\n\n"
    assert parse_smi_memory(text) == [(81559 << 20, 80000 << 20), (24576 << 20, 1024 << 20)]
    assert parse_smi_memory("") == []


def _smi_on_path(tmp_path, monkeypatch, out: str) -> None:
    """An `nvidia-smi` that answers the memory query like the real one, counting how often it is run."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho x >> {tmp_path}/calls\nprintf '{out}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_without_nvml_the_probe_asks_nvidia_smi_at_most_every_few_seconds(tmp_path, monkeypatch):
    _smi_on_path(tmp_path, monkeypatch, "24576, 20480\\n24576, 24000\\n")
    probe = GpuProbe()
    if probe._nvml is not None:  # a machine with a real driver: NVML answers, nvidia-smi is never run
        assert not (tmp_path / "calls").exists()
        return
    assert probe.count == 2
    assert probe.memory() == (2 * 24576 << 20, (20480 + 24000) << 20)
    hb = build_heartbeat("n1", 1, ["llama"], [], gpu=probe)
    assert (hb.gpus, hb.vram_total, hb.vram_free) == (2, 2 * 24576 << 20, (20480 + 24000) << 20)
    assert [(g.total, g.free) for g in hb.gpu_memory] == [(24576 << 20, 20480 << 20), (24576 << 20, 24000 << 20)]
    assert len((tmp_path / "calls").read_text().split()) == 1  # count, memory and heartbeat shared one run


def test_no_driver_means_no_gpu_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi anywhere
    probe = GpuProbe()
    if probe._nvml is None:
        assert (probe.count, probe.memory()) == (0, (0, 0))
    hb = build_heartbeat("n1", 1, ["llama"], [])
    assert (hb.gpus, hb.vram_total, hb.vram_free, hb.gpu_memory) == (0, 0, 0, [])
