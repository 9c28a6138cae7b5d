"""`coderai models`: pull a model by name (with progress), list, remove, and see what a model needs and where it
fits."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from coderai.catalog.entries import BUILTIN
from coderai.catalog.errors import CatalogError
from coderai.catalog.place import append_model, model_entry
from coderai.catalog.pull import Progress, pull
from coderai.catalog.store import MB, ModelStore, estimate_bytes, fits


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GB"


class Bar:
    """A one-line bar redrawn in place on a terminal; on a pipe, a line per state change and per 10 %."""

    def __init__(self, out: Any = sys.stderr) -> None:
        self.out = out
        self.tty = out.isatty()
        self.last: tuple[str, str, int] = ("", "", -1)

    def __call__(self, p: Progress) -> None:
        step = int(p.percent // 10)
        text = (f"{p.name} {p.state:<11} {p.percent:5.1f}%  {_size(p.bytes_done)}/{_size(p.bytes_total)}  "
                f"{_size(p.rate_bps)}/s  {p.file}")
        if self.tty:
            width = 30
            fill = int(width * p.percent / 100)
            self.out.write("\r\033[K[" + "#" * fill + "." * (width - fill) + "] " + text)
            if p.state in ("done", "failed"):
                self.out.write("\n")
        elif (p.state, p.file, step) != self.last:
            self.out.write(text.rstrip() + "\n")
        self.last = (p.state, p.file, step)
        self.out.flush()


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(os.path.expanduser(args.data_dir)).resolve()


def _ask_scheduler(args: argparse.Namespace, subject: Any, msg: Any) -> Any:
    """One request to the running stack's scheduler (its NATS URL from --nats-url or <data>/run/up.json);
    a string saying why when there is no answer."""
    url = getattr(args, "nats_url", "") or os.environ.get("CODERAI_NATS_URL", "")
    up = (_data_dir(args) / "run" / "up.json").exists()
    if not url and not up:
        return "no NATS URL (pass --nats-url, or run `coderai up`)"

    async def ask() -> Any:
        from coderai.up import head_bus

        bus = await head_bus("coderai-models", url, _data_dir(args))
        try:
            return await bus.request(subject, msg, timeout=5.0)
        finally:
            await bus.close()

    try:
        return asyncio.run(ask())
    except Exception as exc:  # noqa: BLE001 - the caller still has its answer without the cluster
        return f"the scheduler did not answer ({type(exc).__name__}: {exc})"


def _nodes(args: argparse.Namespace) -> list[Any] | str:
    """Live nodes from the scheduler over the bus, or why there are none to show."""
    from coderai.contracts.admin import NodesRequest
    from coderai.contracts.subjects import CMD_SCHEDULER_NODES

    reply = _ask_scheduler(args, CMD_SCHEDULER_NODES, NodesRequest())
    return reply if isinstance(reply, str) else list(reply.nodes)


def _info(args: argparse.Namespace, store: ModelStore) -> dict[str, Any]:
    try:
        rec = store.get(args.name)
        need = estimate_bytes(rec)
        out: dict[str, Any] = {"name": rec.name, "repo": rec.repo, "revision": rec.revision, "commit": rec.commit,
                               "engine": rec.engine, "kind": rec.kind, "path": str(store.model_path(rec)),
                               "size": rec.size, "files": len(rec.files), "memory_mb": need // MB, "pulled": True}
    except CatalogError:
        if args.name not in BUILTIN:
            raise
        e = BUILTIN[args.name]
        need = (e.memory_mb or int(e.size_mb * 1.2) + 256) * MB
        out = {"name": e.name, "repo": e.repo, "engine": e.engine, "kind": e.kind, "size": e.size_mb * MB,
               "memory_mb": need // MB, "pulled": False}
    nodes = _nodes(args) if not args.no_nodes else "not asked (--no-nodes)"
    if isinstance(nodes, str):
        out["nodes"], out["nodes_note"] = [], nodes
    else:
        out["nodes"] = fits(need, nodes)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="coderai models", description="Pull models from the Hugging Face Hub by name.")
    ap.add_argument("--data-dir", default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"),
                    help="state directory; models go to <data-dir>/models (default ~/.coderai)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pull", help="download a catalogue name, <owner>/<repo> or <owner>/<repo>:<file>")
    p.add_argument("spec")
    p.add_argument("--name", default="", help="the model's name (default: the catalogue name or the file's stem)")
    p.add_argument("--place", action="store_true",
                   help="add it to the models file and, when a stack is running, serve it at once")
    p.add_argument("--nats-url", default=os.environ.get("CODERAI_NATS_URL", ""), help="the running stack's NATS")
    p.add_argument("--models-file", default="", help="the scheduler's models file (default <data-dir>/models.toml)")
    p.add_argument("--endpoint", default="", help="a Hub mirror (default HF_ENDPOINT, else huggingface.co)")
    sub.add_parser("list", help="what was pulled").add_argument("--json", action="store_true")
    sub.add_parser("catalog", help="the built-in catalogue").add_argument("--json", action="store_true")
    r = sub.add_parser("rm", help="delete a pulled model")
    r.add_argument("name")
    i = sub.add_parser("info", help="size, engine, memory, and the live nodes it fits on")
    i.add_argument("name")
    i.add_argument("--nats-url", default=os.environ.get("CODERAI_NATS_URL", ""))
    i.add_argument("--no-nodes", action="store_true", help="do not ask the scheduler")
    return ap


def _place_now(args: argparse.Namespace, entry: dict[str, Any]) -> str:
    """Tell a running stack's scheduler to serve the model at once (the models file keeps it across restarts)."""
    import msgspec

    from coderai.contracts import ModelConfig
    from coderai.contracts.admin import AddModelRequest
    from coderai.contracts.subjects import CMD_SCHEDULER_ADD

    try:
        cfg = msgspec.convert(entry, ModelConfig)
    except msgspec.ValidationError as exc:
        return f"not placed now ({exc}); it is served after a restart"
    reply = _ask_scheduler(args, CMD_SCHEDULER_ADD, AddModelRequest(model=cfg))
    if isinstance(reply, str):
        return f"no running stack reached ({reply}); it is served when the scheduler (or `coderai up`) starts"
    return f"placed: the running stack serves {cfg.name} as soon as a node has loaded it"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `coderai models`."""
    args = _parser().parse_args(argv)
    store = ModelStore(args.data_dir)
    try:
        if args.cmd == "pull":
            t0 = time.monotonic()
            rec = pull(args.spec, store, Bar(), name=args.name, endpoint=args.endpoint or None)
            print(f"pulled {rec.name} ({rec.engine}, {_size(rec.size)}) in {time.monotonic() - t0:.1f}s: "
                  f"{store.model_path(rec)}")
            if args.place:
                entry = model_entry(rec, store)
                path = append_model(args.models_file or store.data / "models.toml", entry)
                print(f"added {rec.name} to {path}")
                print(_place_now(args, entry))
        elif args.cmd == "list":
            rows = store.list()
            if args.json:
                print(json.dumps([{"name": r.name, "repo": r.repo, "engine": r.engine, "kind": r.kind,
                                   "size": r.size, "path": str(store.model_path(r))} for r in rows]))
            for r in [] if args.json else rows:
                print(f"{r.name:<32} {r.engine:<10} {r.kind:<11} {_size(r.size):>10}  {r.repo}")
        elif args.cmd == "catalog":
            for e in BUILTIN.values():
                print(json.dumps({"name": e.name, "repo": e.repo, "engine": e.engine, "kind": e.kind,
                                  "size_mb": e.size_mb, "memory_mb": e.memory_mb}) if args.json else
                      f"{e.name:<28} {e.engine:<10} {e.kind:<11} ~{e.size_mb:>5} MB  {e.repo}")
        elif args.cmd == "rm":
            rec = store.remove(args.name)
            print(f"removed {rec.name} ({_size(rec.size)})")
        else:
            print(json.dumps(_info(args, store), indent=2))
    except CatalogError as exc:
        print(f"coderai models: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncoderai models: interrupted; pull again to resume", file=sys.stderr)
        return 130
    return 0
