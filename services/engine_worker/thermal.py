"""Thermal supervision: a card over its temperature limit takes no new work until it cools.

A source reads temperatures (°C) by sensor: a GPU's index ("0", "1", ...), or `NODE` for the machine as a whole.
It is NVML where the driver's library loads, else `nvidia-smi` (run without a shell, with a timeout), else the
kernel's thermal zones (`/sys/class/thermal/thermal_zone*/temp`, millidegrees; their hottest is the machine's),
or a file named by the worker's settings (a test, or an operator's own sensor): a JSON number (the machine) or an
object `{"0": 91.5, "node": 70}`. A reading that is not a number, or is absurd, is left out with a log line (a
sensor that gives none keeps its state): a bad sensor never crashes the worker, nor flips a card.

`Thermal` is the hysteresis: a sensor at or over `limit_c` is hot until it reads below `resume_c`. The worker
pauses the engines a hot sensor holds (`holds`: those on a hot card; every engine for a hot machine, and those
with no device named while any card is hot, since they may run on any) exactly as a drain does: in-flight jobs
finish, nothing new comes, the heartbeat says which sensors are hot.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import math
import os
import shutil
import stat
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

log = logging.getLogger("coderai.engine_worker")

NODE = "node"  # the sensor of a whole-machine reading
MIN_C, MAX_C = -40.0, 150.0  # a reading outside is a broken sensor, not a temperature
MAX_SENSORS = 64
MAX_FILE_BYTES = 64 * 1024
SYSFS = Path("/sys/class/thermal")
SMI_TIMEOUT_S = 10.0

Readings = dict[str, float]
Read = tuple[Readings, list[str]]
"""(temperatures by sensor, what could not be read: short lines for the log)"""


def celsius(value: object) -> float | None:
    """`value` as a temperature, or None when it is not a number (a bool is not one) or outside `MIN_C`..`MAX_C`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        c = float(value)
    except ValueError:
        return None
    return c if math.isfinite(c) and MIN_C <= c <= MAX_C else None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _sensor(name: object) -> str | None:
    if name == NODE:
        return NODE
    return name if isinstance(name, str) and name.isdigit() and len(name) <= 3 else None


def parse_json(text: str) -> Read:
    """A thermal file: a JSON number (the machine), or an object of sensors ("node", or a GPU's index) to °C."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return {}, [f"not JSON: {_shown(text.strip())}"]
    if not isinstance(doc, dict):
        c = celsius(doc) if not isinstance(doc, str) else None
        return ({NODE: c}, []) if c is not None else ({}, [f"not a temperature: {_shown(doc)}"])
    out: Readings = {}
    problems: list[str] = []
    for key, value in list(doc.items())[:MAX_SENSORS]:
        sensor, c = _sensor(key), celsius(value) if not isinstance(value, str) else None
        if sensor is None:
            problems.append(f"not a sensor (a GPU index or {NODE!r}): {_shown(key)}")
        elif c is None:
            problems.append(f"sensor {sensor}: not a temperature: {_shown(value)}")
        else:
            out[sensor] = c
    if len(doc) > MAX_SENSORS:
        problems.append(f"{len(doc) - MAX_SENSORS} sensors past the first {MAX_SENSORS} left out")
    return out, problems


def parse_smi(text: str) -> Read:
    """`nvidia-smi --query-gpu=index,temperature.gpu --format=csv,noheader,nounits`: one `index, °C` per GPU."""
    out: Readings = {}
    problems: list[str] = []
    for line in text.splitlines()[:MAX_SENSORS]:
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        sensor = _sensor(parts[0]) if len(parts) == 2 and parts[0] != NODE else None
        c = celsius(parts[1]) if sensor is not None else None
        if sensor is None or c is None:
            problems.append(f"nvidia-smi line not read: {_shown(line)}")
        else:
            out[sensor] = c
    return out, problems


def read_sysfs(root: Path = SYSFS) -> Read:
    """The machine's temperature: the hottest of the kernel's thermal zones (`thermal_zone*/temp`, millidegrees)."""
    temps: list[float] = []
    problems: list[str] = []
    for zone in sorted(root.glob("thermal_zone*"))[:MAX_SENSORS]:
        try:
            raw = (zone / "temp").read_text(errors="replace").strip()
        except OSError as exc:  # a zone whose sensor is off answers EIO or ENODATA
            problems.append(f"{zone.name}: {exc.strerror or exc}")
            continue
        try:
            c = celsius(int(raw) / 1000)
        except ValueError:
            c = None
        if c is None:
            problems.append(f"{zone.name}: not a temperature: {_shown(raw)}")
        else:
            temps.append(c)
    return ({NODE: max(temps)} if temps else {}), problems


class Source(Protocol):
    name: str

    def read(self) -> Read: ...


class FileSource:
    """Temperatures from a file the operator (or a test) keeps current; only a regular file is read, so a FIFO or
    a device named by mistake cannot hang or flood the worker."""

    def __init__(self, path: str) -> None:
        self.path = Path(os.path.expanduser(path))
        self.name = f"file {self.path}"

    def read(self) -> Read:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            return {}, [f"cannot read {self.path}: {exc.strerror or exc}"]
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {}, [f"{self.path} is not a regular file"]
            data = fh.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            return {}, [f"{self.path} is over {MAX_FILE_BYTES} bytes"]
        return parse_json(data.decode("utf-8", "replace"))


class SmiSource:
    """`nvidia-smi`, as a program with its arguments (no shell), killed after `timeout_s`."""

    def __init__(self, binary: str, timeout_s: float = SMI_TIMEOUT_S) -> None:
        self.binary, self.timeout_s = binary, timeout_s
        self.name = "nvidia-smi"

    def read(self) -> Read:
        try:
            r = subprocess.run(
                [self.binary, "--query-gpu=index,temperature.gpu", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=self.timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return {}, [f"nvidia-smi did not answer within {self.timeout_s:g} s"]
        except OSError as exc:
            return {}, [f"cannot run nvidia-smi: {exc.strerror or exc}"]
        if r.returncode != 0:
            return {}, [f"nvidia-smi exited with code {r.returncode}: {_shown(r.stderr.strip())}"]
        return parse_smi(r.stdout)


class NvmlSource:
    """The driver's NVML through ctypes (microseconds a read, no process started)."""

    name = "NVML"

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def read(self) -> Read:
        n = ctypes.c_uint(0)
        if self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
            return {}, ["NVML could not count the GPUs"]
        out: Readings = {}
        problems: list[str] = []
        for i in range(min(n.value, MAX_SENSORS)):
            handle, temp = ctypes.c_void_p(), ctypes.c_uint(0)
            if (
                self.lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) != 0
                or self.lib.nvmlDeviceGetTemperature(handle, 0, ctypes.byref(temp)) != 0  # 0: NVML_TEMPERATURE_GPU
            ):
                problems.append(f"NVML gave no temperature for GPU {i}")
            elif (c := celsius(temp.value)) is None:
                problems.append(f"GPU {i}: not a temperature: {temp.value}")
            else:
                out[str(i)] = c
        return out, problems


class SysfsSource:
    def __init__(self, root: Path = SYSFS) -> None:
        self.root = root
        self.name = f"thermal zones in {root}"

    def read(self) -> Read:
        return read_sysfs(self.root)


def _nvml() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        return lib if lib.nvmlInit_v2() == 0 else None
    except (OSError, AttributeError):
        return None


def pick_source(file: str = "", smi: str | None = None, sysfs: Path = SYSFS, nvml: bool = True) -> Source | None:
    """The file when one is named; else NVML, `nvidia-smi` (`smi`: its path, None: looked up on PATH), or the
    thermal zones, the first this machine has; None: nothing to read here."""
    if file:
        return FileSource(file)
    if nvml and (lib := _nvml()) is not None:
        return NvmlSource(lib)
    if smi := smi if smi is not None else shutil.which("nvidia-smi"):
        return SmiSource(smi)
    if any(sysfs.glob("thermal_zone*/temp")):
        return SysfsSource(sysfs)
    return None


def label(sensor: str) -> str:
    return "this machine" if sensor == NODE else f"GPU {sensor}"


class Thermal:
    """Which sensors are hot, with hysteresis: hot at or over `limit_c`, cool again only below `resume_c`."""

    def __init__(self, source: Source, limit_c: float, resume_c: float) -> None:
        # a resume mark at or over the limit is no hysteresis: cool again as soon as it is below the limit
        self.source, self.limit_c, self.resume_c = source, limit_c, min(resume_c, limit_c)
        self.temps: Readings = {}
        self.hot: set[str] = set()
        self._problems: set[str] = set()

    def update(self, readings: Readings) -> tuple[set[str], set[str]]:
        """Take a round of readings; (the sensors that became hot, those that cooled), each logged once at INFO."""
        self.temps.update(readings)
        heated = {s for s, c in readings.items() if c >= self.limit_c and s not in self.hot}
        cooled = {s for s, c in readings.items() if c < self.resume_c and s in self.hot}
        self.hot = (self.hot | heated) - cooled
        for s in sorted(heated):
            log.info(
                "%s is at %.1f °C, at or over the limit of %g °C: its engines take no new work until it is below %g °C",
                label(s),
                readings[s],
                self.limit_c,
                self.resume_c,
            )
        for s in sorted(cooled):
            log.info("%s cooled to %.1f °C: its engines take work again", label(s), readings[s])
        return heated, cooled

    def holds(self, devices: list[int]) -> bool:
        """Whether an engine on `devices` ([]: its default, any card, or the CPU) may take no new work now."""
        if not self.hot:
            return False
        if NODE in self.hot or not devices:
            return True
        return any(str(d) in self.hot for d in devices)

    def hot_temps(self) -> dict[str, float]:
        """The hot sensors and their last reading (the heartbeat's `hot`)."""
        return {s: self.temps[s] for s in sorted(self.hot) if s in self.temps}

    async def poll(self) -> bool:
        """Read the source once (off the event loop) and update; True when a sensor turned hot or cool. What could
        not be read is logged: a WARNING when it is news, DEBUG while it stays the same."""
        readings, problems = await asyncio.to_thread(self.source.read)
        new = set(problems) - self._problems
        for p in problems:
            log.log(
                logging.WARNING if p in new else logging.DEBUG,
                "thermal reading from %s ignored: %s",
                self.source.name,
                p,
            )
        self._problems = set(problems)
        heated, cooled = self.update(readings)
        return bool(heated or cooled)

    async def run(self, poll_s: float, on_change: Callable[[], Awaitable[None]]) -> None:
        """Poll every `poll_s` until cancelled, calling `on_change` after a sensor turned hot or cool."""
        while True:
            try:
                if await self.poll():
                    await on_change()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a source that fails in a way not foreseen: the next round tries again
                log.warning("thermal check failed: %s", exc)
            await asyncio.sleep(poll_s)


def thermal_for(file: str, limit_c: float, resume_c: float) -> Thermal | None:
    """The worker's supervision by its settings: None when `limit_c` is 0 or there is nothing to read here."""
    if limit_c <= 0:
        return None
    source = pick_source(file)
    if source is None:
        log.info("no temperature to watch on this machine (no NVML, nvidia-smi or thermal zone)")
        return None
    if resume_c >= limit_c:
        log.warning(
            "CODERAI_WORKER_THERMAL_RESUME_C (%g) is not below CODERAI_WORKER_THERMAL_LIMIT_C (%g): a hot card takes "
            "work again as soon as it is below the limit",
            resume_c,
            limit_c,
        )
    t = Thermal(source, limit_c, resume_c)
    log.info("watching temperatures from %s: limit %g °C, resume below %g °C", source.name, limit_c, t.resume_c)
    return t
