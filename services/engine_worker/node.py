"""Facts about this machine: memory, GPUs, and the heartbeat built from them (its id: runtime/node_id.py)."""

from __future__ import annotations

import ctypes
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from coderai import __version__
from coderai.contracts import EngineStatus, GpuMemory, Heartbeat
from coderai.contracts.split import RpcServer


def memory() -> tuple[int, int]:
    """(total, available) bytes of RAM, from /proc/meminfo where there is one."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total = int(info["MemTotal"].split()[0]) * 1024
        free = int(info.get("MemAvailable", info["MemFree"]).split()[0]) * 1024
        return total, free
    except (OSError, KeyError, ValueError):
        return 0, 0


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def parse_smi_memory(text: str) -> list[tuple[int, int]]:
    """(total, free) bytes per GPU from `nvidia-smi --query-gpu=memory.total,memory.free
    --format=csv,noheader,nounits` (MiB per line); lines it cannot read are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            out.append((int(parts[0]) << 20, int(parts[1]) << 20))
    return out


VULKAN_DEVICE = re.compile(r"^\s*Vulkan(\d+): .*\((\d+) MiB, (\d+) MiB free\)\s*$")


def parse_vulkan_devices(text: str) -> list[tuple[int, int]]:
    """(total, free) bytes per Vulkan device from `llama-server --list-devices` (lines like `Vulkan0: Radeon RX
    7900 XTX (RADV NAVI31) (24560 MiB, 24000 MiB free)`), in device order; other lines (the CPU) skipped."""
    found: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        m = VULKAN_DEVICE.match(line)
        if m and len(found) < 64:
            found[int(m[1])] = (int(m[2]) << 20, min(int(m[3]), int(m[2])) << 20)
    return [found[i] for i in sorted(found)]


class GpuProbe:
    """The GPUs on this machine and their memory, for the heartbeat (placement fits models by it).

    NVIDIA: NVML through ctypes (the driver's own library, microseconds a call) when it loads; otherwise
    `nvidia-smi`. Without either, and with a Vulkan build of llama-server (scripts/setup with
    `CODERAI_LLAMA_BACKEND=vulkan`: AMD and Intel cards), the Vulkan devices it lists. A program is asked at most
    every `SMI_EVERY_S`, since a process start costs tens of milliseconds. No driver: no GPUs. `api` says which:
    "cuda", "vulkan" or "".
    """

    SMI_EVERY_S = 10.0

    def __init__(self, vulkan_server: str | None = None) -> None:
        self._nvml = self._load_nvml()
        self._smi = None if self._nvml is not None else shutil.which("nvidia-smi")
        self._vulkan = vulkan_server if self._nvml is None and self._smi is None else None
        self._smi_at = -1e9
        self._smi_last: list[tuple[int, int]] = []
        self.count = len(self.devices())
        if self._vulkan and not self.count:  # a CPU build (or no Vulkan device): not asked again
            self._vulkan = None
        self.api = "cuda" if self._nvml is not None or self._smi else "vulkan" if self._vulkan and self.count else ""

    @staticmethod
    def _load_nvml() -> ctypes.CDLL | None:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return None
            return lib
        except (OSError, AttributeError):
            return None

    def devices(self) -> list[tuple[int, int]]:
        """(total, free) bytes per GPU."""
        if self._nvml is not None:
            return self._nvml_devices(self._nvml)
        program = self._smi or self._vulkan
        if program and time.monotonic() - self._smi_at >= self.SMI_EVERY_S:
            self._smi_at = time.monotonic()
            if self._smi:
                argv, parse = (
                    [self._smi, "--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits"],
                    parse_smi_memory,
                )
            else:
                argv, parse = [program, "--list-devices"], parse_vulkan_devices
            try:
                out = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
                self._smi_last = parse(out.stdout + out.stderr)
            except (OSError, subprocess.TimeoutExpired):
                self._smi_last = []
        return self._smi_last

    @staticmethod
    def _nvml_devices(lib: ctypes.CDLL) -> list[tuple[int, int]]:
        n = ctypes.c_uint(0)
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
            return []
        out = []
        for i in range(n.value):
            handle, mem = ctypes.c_void_p(), _NvmlMemory()
            if (
                lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) == 0
                and lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) == 0
            ):
                out.append((int(mem.total), int(mem.free)))
        return out

    def memory(self) -> tuple[int, int]:
        """(total, free) bytes over every GPU; (0, 0) without one."""
        devs = self.devices()
        return sum(t for t, _ in devs), sum(f for _, f in devs)


def addresses(first: str = "") -> list[str]:
    """This machine's interface addresses (loopback and link-local left out), `first` (if any) first."""
    import ifaddr  # comes with zeroconf

    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            a = ip.ip if isinstance(ip.ip, str) else ip.ip[0]
            if not (a.startswith("127.") or a == "::1" or a.startswith("fe80")) and a not in found:
                found.append(a)
    return ([first] if first else []) + [a for a in found if a != first]


def build_heartbeat(
    node_id: str,
    seq: int,
    families: list[str],
    engines: list[EngineStatus],
    pod: str = "",
    addrs: list[str] | None = None,
    rpc: RpcServer | None = None,
    gpu: GpuProbe | None = None,
    mem_budget: int = 0,
    stored: list[str] | None = None,
) -> Heartbeat:
    """This node's heartbeat; `mem_budget`: bytes of RAM the operator lets models use here (0: the default)."""
    total, free = memory()
    devices = gpu.devices() if gpu is not None else []
    vram_total, vram_free = sum(t for t, _ in devices), sum(f for _, f in devices)
    return Heartbeat(
        node_id=node_id,
        version=__version__,
        seq=seq,
        ts=time.time(),
        host=socket.gethostname(),
        capabilities=families,
        engines=engines,
        in_flight=sum(e.in_flight for e in engines),
        mem_total=total,
        mem_free=free,
        pod=pod,
        addrs=addrs or [],
        rpc=rpc,
        gpus=gpu.count if gpu is not None else 0,
        vram_total=vram_total,
        vram_free=vram_free,
        gpu_memory=[GpuMemory(total=t, free=f) for t, f in devices],
        gpu_api=gpu.api if gpu is not None else "",
        mem_budget=mem_budget,
        stored=stored or [],
    )
