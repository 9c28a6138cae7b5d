"""Training on this node: one trainer child process per fine-tuning job rank, started when the scheduler says
(`coderai.cmd.node.<id>.train`), stopped when it says (`.train_stop`), its progress forwarded on
`coderai.train.report.<job>`, and (rank 0) its adapter uploaded into the head's model store.

The rendezvous address is this node's address towards the others: `CODERAI_WORKER_TRAIN_ADDR` when set, else
the first mDNS interface address, else the local address of the NATS connection when it is not loopback, else the
first non-loopback IPv4 address. Gloo (and NCCL) are pinned to the interface that reaches the master address,
so ranks never meet on a loopback or a container bridge by accident.

A rank outlives a scheduler restart: the trainer goes on, its step reports and its final report are also kept
here, and a restarted scheduler asks for them (`coderai.cmd.node.<id>.train_state`); rank 0 retries the adapter
upload until a scheduler takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import io
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import tarfile
from collections import deque
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from coderai.contracts import BusError, encode
from coderai.contracts.store import CHUNK_BYTES
from coderai.contracts.subjects import (
    CMD_NODE_TRAIN,
    CMD_NODE_TRAIN_STATE,
    CMD_NODE_TRAIN_STOP,
    TRAIN_REPORT,
    TRAIN_UPLOAD,
)
from coderai.contracts.training import (
    MAX_EVENTS,
    AdapterChunk,
    ReportKind,
    TrainReport,
    TrainSpec,
    TrainStarted,
    TrainState,
    TrainStateAsk,
    TrainStop,
    TrainStopped,
)
from coderai.engine_worker.fetch import FetchError, bus_request, fetch_file, local_path
from coderai.engine_worker.trainer import MARK, qlora_backend
from coderai.runtime.bus import Bus

log = logging.getLogger("coderai.engine_worker")

ALIVE_EVERY_S = 1.0
STOP_GRACE_S = 5.0
UPLOAD_RETRY_S = 2.0
UPLOAD_PATIENCE_S = 300.0
"""How long rank 0 keeps retrying the adapter upload (the scheduler may be restarting) before the rank fails."""


def training_capabilities() -> list[str]:
    """What this node adds to its heartbeat's capabilities: `train` (LoRA: torch, transformers and peft are
    installed) and `qlora` (also bitsandbytes, with a CUDA device node or a version that runs on the CPU).
    Cheap: nothing is imported."""
    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft")):
        return []
    caps = ["train"]
    if qlora_backend(os.path.exists("/dev/nvidiactl")):
        caps.append("qlora")
    return caps


def interface_addresses() -> dict[str, list[str]]:
    """IPv4 addresses by interface name."""
    import psutil  # comes with peft (and accelerate): present wherever training is

    return {
        name: [a.address for a in addrs if a.family == socket.AF_INET] for name, addrs in psutil.net_if_addrs().items()
    }


def pick_address(
    ifaces: dict[str, list[str]], configured: str = "", mdns: list[str] | None = None, bus_local: str = ""
) -> str:
    """The address other ranks should reach this node at (see the module docstring for the order)."""
    if configured:
        return configured
    for addr in mdns or []:
        if any(addr in a for a in ifaces.values()):
            return addr
    if bus_local and not ipaddress.ip_address(bus_local).is_loopback:
        return bus_local
    for name in sorted(ifaces):
        for addr in ifaces[name]:
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
    return "127.0.0.1"


def interface_of(ifaces: dict[str, list[str]], addr: str) -> str:
    """The interface holding `addr` ("" if none does)."""
    return next((name for name, addrs in ifaces.items() if addr in addrs), "")


def source_address_towards(addr: str) -> str:
    """The local address the kernel would send from to reach `addr` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        return s.getsockname()[0]


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def tar_folder(folder: Path) -> bytes:
    """A tar of `folder`'s files (sorted, fixed metadata: the same adapter always makes the same bytes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(str(path.relative_to(folder)))
            data = path.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class _Run:
    def __init__(self, spec: TrainSpec) -> None:
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.task: asyncio.Task | None = None
        self.stopped = False
        self.steps: deque[TrainReport] = deque(maxlen=MAX_EVENTS)  # for a restarted scheduler (`_state`)
        self.final: TrainReport | None = None


class TrainingHost:
    """The trainer children of this worker, by job id."""

    def __init__(
        self, bus: Bus, node_id: str, data_dir: Path, *, train_addr: str = "", mdns_interfaces: list[str] | None = None
    ) -> None:
        self.bus = bus
        self.node_id = node_id
        self.models_dir = data_dir / "models"
        self.work_dir = data_dir / "finetune"
        self.train_addr = train_addr
        self.mdns_interfaces = mdns_interfaces or []
        self.runs: dict[str, _Run] = {}

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        for subject, handler in (
            (CMD_NODE_TRAIN, self._train),
            (CMD_NODE_TRAIN_STOP, self._stop),
            (CMD_NODE_TRAIN_STATE, self._state),
        ):
            sub = await self.bus.serve(subject, handler, subject_str=subject(node_id=self.node_id))
            stack.push_async_callback(sub.unsubscribe)
        stack.push_async_callback(self.stop_all)

    def _bus_local(self) -> str:
        # nats-py has no public way to ask: its TCP transport's stream writer knows (a websocket one has none)
        writer: Any = getattr(self.bus.nc._transport, "_io_writer", None)
        try:
            return str(writer.get_extra_info("sockname")[0])
        except Exception:  # no such writer or socket: the interfaces decide
            return ""

    async def _train(self, spec: TrainSpec, _m: Msg) -> TrainStarted:
        if spec.job_id in self.runs and not self.runs[spec.job_id].stopped:
            raise BusError("bad_request", f"job {spec.job_id} already runs on {self.node_id}")
        ifaces = await asyncio.to_thread(interface_addresses)
        if spec.rank == 0:
            addr = pick_address(ifaces, self.train_addr, self.mdns_interfaces, self._bus_local())
            spec = _replace(spec, master_addr=addr, master_port=free_port(addr))
        elif not spec.master_addr or not spec.master_port:
            raise BusError("bad_request", "ranks above 0 need master_addr and master_port")
        run = self.runs[spec.job_id] = _Run(spec)
        run.task = asyncio.create_task(self._run(run, ifaces))
        log.info(
            "training job %s: rank %d of %d, master %s:%d",
            spec.job_id,
            spec.rank,
            spec.world_size,
            spec.master_addr,
            spec.master_port,
        )
        return TrainStarted(
            node_id=self.node_id, rank=spec.rank, master_addr=spec.master_addr, master_port=spec.master_port
        )

    async def _stop(self, req: TrainStop, _m: Msg) -> TrainStopped:
        run = self.runs.get(req.job_id)
        if run is None or run.stopped:
            return TrainStopped(node_id=self.node_id, was_running=False)
        log.info("stopping training job %s: %s", req.job_id, req.reason or "asked to")
        await self._end(run)
        return TrainStopped(node_id=self.node_id, was_running=True)

    async def _state(self, req: TrainStateAsk, _m: Msg) -> TrainState:
        """What this rank published so far, for a scheduler that restarted while it ran (it missed some)."""
        run = self.runs.get(req.job_id)
        if run is None:
            return TrainState(node_id=self.node_id)
        reports = [*run.steps, *([run.final] if run.final is not None else [])]
        return TrainState(
            node_id=self.node_id, rank=run.spec.rank, known=True, running=not run.stopped, reports=reports
        )

    async def _end(self, run: _Run) -> None:
        run.stopped = True
        if run.proc is not None and run.proc.returncode is None:
            run.proc.terminate()
            try:
                await asyncio.wait_for(run.proc.wait(), STOP_GRACE_S)
            except TimeoutError:
                run.proc.kill()
        if run.task is not None and run.task is not asyncio.current_task():
            run.task.cancel()

    async def stop_all(self) -> None:
        for run in list(self.runs.values()):
            await self._end(run)

    async def _report(self, spec: TrainSpec, kind: ReportKind, **fields: Any) -> None:
        rep = TrainReport(job_id=spec.job_id, node_id=self.node_id, rank=spec.rank, kind=kind, **fields)
        run = self.runs.get(spec.job_id)
        if run is not None and run.spec is spec:  # kept: a restarted scheduler asks for what it missed
            if kind == "step":
                run.steps.append(rep)
            elif kind in ("done", "failed"):
                run.final = rep
        try:
            await self.bus.publish(TRAIN_REPORT, rep, job_id=spec.job_id, node_id=self.node_id)
        except Exception as exc:  # the next report (alive every second) tries again
            log.warning("could not report %s for job %s: %s", kind, spec.job_id, exc)

    async def _alive(self, spec: TrainSpec) -> None:
        while True:
            await self._report(spec, "alive")
            await asyncio.sleep(ALIVE_EVERY_S)

    async def _run(self, run: _Run, ifaces: dict[str, list[str]]) -> None:
        spec = run.spec
        alive = asyncio.create_task(self._alive(spec))
        try:
            await self._run_child(run, ifaces)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the outermost edge of a rank: report it, typed
            log.exception("training job %s failed on this node", spec.job_id)
            if not run.stopped:
                await self._report(spec, "failed", message=f"{type(exc).__name__}: {exc}")
        finally:
            alive.cancel()
            run.stopped = True
            for path in filter(None, (spec.data_store_path, spec.valid_store_path)):  # a tenant's data, used up
                with contextlib.suppress(FetchError, OSError):
                    local_path(self.models_dir, path).unlink(missing_ok=True)

    async def _run_child(self, run: _Run, ifaces: dict[str, list[str]]) -> None:
        spec = run.spec
        job_dir = self.work_dir / spec.job_id
        job_dir.mkdir(parents=True, exist_ok=True)
        data = await fetch_file(bus_request(self.bus), spec.data_store_path, self.models_dir)
        valid = (
            await fetch_file(bus_request(self.bus), spec.valid_store_path, self.models_dir)
            if spec.valid_store_path
            else None
        )
        spec_file = job_dir / f"spec-{spec.rank}.json"
        spec_file.write_bytes(encode(spec))
        own = spec.master_addr if spec.rank == 0 else await asyncio.to_thread(source_address_towards, spec.master_addr)
        ifname = interface_of(ifaces, own)
        env = dict(
            os.environ,
            MASTER_ADDR=spec.master_addr,
            MASTER_PORT=str(spec.master_port),
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = ifname
        if run.stopped:
            return
        run.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "coderai.engine_worker.trainer",
            "--spec",
            str(spec_file),
            "--data",
            str(data),
            *(("--valid", str(valid)) if valid else ()),
            "--out",
            str(job_dir),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            limit=1 << 20,
        )
        log.info("training job %s: rank %d runs as pid %d on %s", spec.job_id, spec.rank, run.proc.pid, ifname or "?")
        tail: list[str] = []
        err_task = asyncio.create_task(_tail(run.proc.stderr, tail, job_dir / f"trainer-{spec.rank}.log"))
        done: dict[str, Any] | None = None
        failed: dict[str, Any] | None = None
        assert run.proc.stdout is not None
        async for raw in run.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if not line.startswith(MARK):
                continue
            evt = json.loads(line[len(MARK) :])
            kind = evt.pop("event")
            if kind == "started":
                log.info(
                    "training job %s: rank %d trains on %s examples (%s cut to %s tokens, %s left out with "
                    "nothing to learn within them), loss on %s tokens",
                    spec.job_id,
                    spec.rank,
                    evt.get("examples"),
                    evt.get("cut_examples"),
                    evt.get("max_seq_len"),
                    evt.get("left_out"),
                    evt.get("train_on"),
                )
            elif kind == "batching":
                log.info(
                    "training job %s: rank %d batches by %s%s, %.1f %% of the first epoch's batches padding",
                    spec.job_id,
                    spec.rank,
                    evt.get("batching"),
                    f" ({evt['packs']} packs)" if "packs" in evt else "",
                    100 * float(evt.get("padding") or 0),
                )
            elif kind == "step" and spec.rank == 0:
                await self._report(
                    spec,
                    "step",
                    step=evt["step"],
                    total_steps=evt["total_steps"],
                    loss=evt["loss"],
                    tokens_per_s=evt["tokens_per_s"],
                    trained_tokens=evt["trained_tokens"],
                    valid_loss=evt.get("valid_loss"),
                )
            elif kind == "done":
                done = evt
            elif kind == "failed":
                failed = evt
        rc = await run.proc.wait()
        await err_task
        if run.stopped:
            return
        if rc == 0 and done is not None:
            if spec.rank == 0:
                await self._upload(spec, job_dir / "adapter")
            await self._report(
                spec,
                "done",
                digest=done["digest"],
                total_steps=done["total_steps"],
                trained_tokens=done["trained_tokens"],
            )
            log.info("training job %s: rank %d done", spec.job_id, spec.rank)
            return
        if failed is not None:
            message, peer = failed["message"], bool(failed.get("peer"))
        else:
            message, peer = exit_reason(rc, tail), False
        log.error("training job %s: rank %d failed: %s", spec.job_id, spec.rank, message)
        await self._report(spec, "failed", message=message, peer=peer)

    async def _upload(self, spec: TrainSpec, folder: Path) -> None:
        """Send the adapter (a tar of the peft folder) to the head's store in chunks; the head renames it into
        place only after the last chunk's size and sha256 check out. A failed attempt (no scheduler: it is
        restarting; a chunk refused or lost) starts again from the first chunk every UPLOAD_RETRY_S, for up to
        UPLOAD_PATIENCE_S; the rank stays alive meanwhile, and a cancelled job stops it (`_end`)."""
        data = await asyncio.to_thread(tar_folder, folder)
        digest = hashlib.sha256(data).hexdigest()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UPLOAD_PATIENCE_S
        while True:
            try:
                await self._send_adapter(spec, data, digest)
                return
            except (BusError, RuntimeError) as exc:
                if loop.time() + UPLOAD_RETRY_S > deadline:
                    raise RuntimeError(f"the adapter upload failed for {UPLOAD_PATIENCE_S:.0f}s: {exc}") from None
                log.warning(
                    "training job %s: adapter upload failed (%s); retrying in %.0fs", spec.job_id, exc, UPLOAD_RETRY_S
                )
                await asyncio.sleep(UPLOAD_RETRY_S)

    async def _send_adapter(self, spec: TrainSpec, data: bytes, digest: str) -> None:
        off = 0
        while True:
            piece = data[off : off + CHUNK_BYTES]
            last = off + len(piece) >= len(data)
            chunk = AdapterChunk(
                job_id=spec.job_id,
                node_id=self.node_id,
                offset=off,
                data=piece,
                size=len(data) if last else 0,
                sha256=digest if last else "",
            )
            ack = await self.bus.request(TRAIN_UPLOAD, chunk, timeout=60.0, job_id=spec.job_id, node_id=self.node_id)
            off += len(piece)
            if last:
                if not ack.complete:
                    raise RuntimeError("the head did not accept the adapter upload")
                log.info("training job %s: adapter uploaded (%d bytes)", spec.job_id, len(data))
                return


def exit_reason(rc: int, stderr_tail: list[str]) -> str:
    """Why a trainer that said nothing ended: the signal that killed it, or its exit code and last error line
    (progress bars and warnings left out)."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"the trainer process was killed by {name}"
    errors = [ln for ln in stderr_tail if "\r" not in ln and "it/s]" not in ln and "Warning" not in ln]
    return f"the trainer exited with code {rc}" + (f": {errors[-1]}" if errors else "")


async def _tail(stream: Any, keep: list[str], path: Path) -> None:
    """Keep the trainer's stderr in a file beside its job, and its last lines for the failure message."""
    with open(path, "ab") as fh:  # small appends of log lines
        async for raw in stream:
            fh.write(raw)
            line = raw.decode(errors="replace").strip()
            if line:
                keep.append(line[-300:])
                del keep[:-20]


def _replace(spec: TrainSpec, **changes: Any) -> TrainSpec:
    import msgspec

    return msgspec.structs.replace(spec, **changes)
