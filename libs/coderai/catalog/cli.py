"""`coderai models`: pull a model by name (with progress), list, remove, and see what a model needs and where it
fits; add, change and stop serving models on the running stack (or in the models file when none runs)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from coderai.catalog.entries import BUILTIN
from coderai.catalog.errors import CatalogError
from coderai.catalog.place import append_model, model_entry
from coderai.catalog.pull import Progress, pull
from coderai.catalog.store import MB, ModelStore, fits


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
        text = (
            f"{p.name} {p.state:<11} {p.percent:5.1f}%  {_size(p.bytes_done)}/{_size(p.bytes_total)}  "
            f"{_size(p.rate_bps)}/s  {p.file}"
        )
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
    reply = _on_head(args, lambda bus: bus.request(subject, msg, timeout=5.0))
    if isinstance(reply, Exception):
        return f"the scheduler did not answer ({type(reply).__name__}: {reply})"
    return reply


def _on_head(args: argparse.Namespace, work: Callable[[Any], Awaitable[Any]]) -> Any:
    """`work(bus)` on the running stack's bus: its result, the BusError the stack answered with, or a string saying
    why no stack answered (no NATS URL, no connection, nobody serving the subject)."""
    from coderai.contracts import BusError

    url = getattr(args, "nats_url", "") or os.environ.get("CODERAI_NATS_URL", "")
    up = (_data_dir(args) / "run" / "up.json").exists()
    if not url and not up:
        return "no NATS URL (pass --nats-url, or run `coderai up`)"

    async def run() -> Any:
        from coderai.up import head_bus

        bus = await head_bus("coderai-models", url, _data_dir(args))
        try:
            return await work(bus)
        finally:
            await bus.close()

    try:
        return asyncio.run(run())
    except BusError as exc:
        return f"the scheduler did not answer (BusError: {exc})" if exc.code in ("no_engine", "timeout") else exc
    except Exception as exc:  # the caller still has its answer without the cluster
        return f"the scheduler did not answer ({type(exc).__name__}: {exc})"


def _nodes(args: argparse.Namespace) -> list[Any] | str:
    """Live nodes from the scheduler over the bus, or why there are none to show."""
    from coderai.contracts.admin import NodesRequest
    from coderai.contracts.subjects import CMD_SCHEDULER_NODES

    reply = _ask_scheduler(args, CMD_SCHEDULER_NODES, NodesRequest())
    return reply if isinstance(reply, str) else list(reply.nodes)


def _info(args: argparse.Namespace, store: ModelStore) -> dict[str, Any]:
    """`info` (or `show`): what a model is, what one copy needs (as the scheduler estimates it: a pulled GGUF from
    its header, with the params it was pulled with), and where it fits."""
    from coderai.contracts import ModelConfig
    from coderai.contracts.families import EngineFamily
    from coderai.sizing import estimate

    try:
        rec = store.get(args.name)
        est = estimate(
            ModelConfig(
                name=rec.name,
                engine=cast(EngineFamily, rec.engine),  # a family's name, as the pull guessed it: only sized here
                path=str(store.model_path(rec)),
                params=rec.params,
                memory_mb=rec.memory_mb,
            )
        )
        out: dict[str, Any] = {
            "name": rec.name,
            "repo": rec.repo,
            "revision": rec.revision,
            "commit": rec.commit,
            "engine": rec.engine,
            "kind": rec.kind,
            "path": str(store.model_path(rec)),
            "size": rec.size,
            "files": len(rec.files),
            "pulled": True,
        }
    except CatalogError:
        if args.name not in BUILTIN:
            raise
        e = BUILTIN[args.name]
        engine = cast(EngineFamily, e.engine)  # a catalogue entry's: one of the built-in families
        est = estimate(ModelConfig(name=e.name, engine=engine, path="", memory_mb=e.memory_mb), e.size_mb * MB)
        out = {
            "name": e.name,
            "repo": e.repo,
            "engine": e.engine,
            "kind": e.kind,
            "size": e.size_mb * MB,
            "pulled": False,
        }
    need = est.total
    out["memory_mb"] = need // MB
    out["memory"] = {
        "weights_mb": est.weights // MB,
        "kv_cache_mb": est.kv_cache // MB,
        "overhead_mb": est.overhead // MB,
        "from": est.source,
    }
    nodes = _nodes(args) if not args.no_nodes else "not asked (--no-nodes)"
    if isinstance(nodes, str):
        out["nodes"], out["nodes_note"] = [], nodes
    else:
        out["nodes"] = fits(need, nodes)
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="coderai models",
        description="Pull models from the Hugging Face Hub by name, "
        "and add, change or stop serving models on the running stack.",
    )
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"),
        help="state directory; models go to <data-dir>/models (default ~/.coderai)",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pull", help="download a catalogue name, <owner>/<repo> or <owner>/<repo>:<file>")
    p.add_argument("spec")
    p.add_argument("--name", default="", help="the model's name (default: the catalogue name or the file's stem)")
    p.add_argument(
        "--place", action="store_true", help="add it to the models file and, when a stack is running, serve it at once"
    )
    p.add_argument("--nats-url", default=os.environ.get("CODERAI_NATS_URL", ""), help="the running stack's NATS")
    p.add_argument("--models-file", default="", help="the scheduler's models file (default <data-dir>/models.toml)")
    p.add_argument("--endpoint", default="", help="a Hub mirror (default HF_ENDPOINT, else huggingface.co)")
    sub.add_parser("list", help="what was pulled").add_argument("--json", action="store_true")
    sub.add_parser("catalog", help="the built-in catalogue").add_argument("--json", action="store_true")
    stack = argparse.ArgumentParser(add_help=False)
    stack.add_argument("--nats-url", default=os.environ.get("CODERAI_NATS_URL", ""), help="the running stack's NATS")
    stack.add_argument(
        "--models-file", default="", help="the models file edited when no stack runs (default <data-dir>/models.toml)"
    )
    a = sub.add_parser(
        "add",
        parents=[stack],
        help="serve a new model: on the running stack at once (its scheduler "
        "writes it to its models file), else into the models file, served when the stack starts",
    )
    a.add_argument("name")
    a.add_argument("--engine", required=True, help="llama, llama-server, embed, whisper, tts, diffusers, ...")
    a.add_argument("--path", required=True, help="the model's file or folder")
    a.add_argument("--param", action="append", default=[], metavar="K=V", help="an engine parameter (repeat it)")
    a.add_argument("--resident", choices=["always", "on_demand"], help="default: loaded while it fits")
    a.add_argument("--keep-alive", type=float, metavar="S", help="idle seconds before it is unloaded")
    a.add_argument(
        "--set",
        dest="fields",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="any other field (repeat it); " + _FIELDS_HELP,
    )
    s = sub.add_parser("set", parents=[stack], help="change fields of a served model (it reloads with them)")
    s.add_argument("name")
    s.add_argument("fields", nargs="+", metavar="FIELD=VALUE", help=_FIELDS_HELP)
    r = sub.add_parser(
        "rm",
        parents=[stack],
        help="stop serving a model: new requests get a 404 at once, requests "
        "in flight finish first; --files also deletes its pulled files",
    )
    r.add_argument("name")
    r.add_argument(
        "--files",
        action="store_true",
        help="also delete the model's files from <data-dir>/models (a model only pulled, never served: just that)",
    )
    i = sub.add_parser(
        "info",
        aliases=["show"],
        help="size, engine, memory (weights, KV cache, overhead), and the live nodes it fits on",
    )
    i.add_argument("name")
    i.add_argument("--nats-url", default=os.environ.get("CODERAI_NATS_URL", ""))
    i.add_argument("--no-nodes", action="store_true", help="do not ask the scheduler")
    c = sub.add_parser(
        "check",
        parents=[stack],
        help="can the model burst to a rented pod, and if not, why not: its "
        "policy, where a pod gets its weights (asks the Hub), and whether a RunPod GPU type holds it",
    )
    c.add_argument("name")
    c.add_argument("--endpoint", default="", help="a Hub mirror (default HF_ENDPOINT, else huggingface.co)")
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


_FIELDS_HELP = (
    "any field of a models-file entry (docs/models.md): the value is JSON when it parses as JSON (2, true, "
    '["a"]), else a string; params.K=V sets one engine parameter; FIELD= resets a field to its default'
)


def _fields(table: dict[str, Any], pairs: list[str]) -> dict[str, Any]:
    """`table` with FIELD=VALUE `pairs` applied (see _FIELDS_HELP)."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise CatalogError(f"{pair!r} is not FIELD=VALUE")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        field, _, inner = key.partition(".")
        where, name = (out.setdefault(field, {}), inner) if inner else (out, field)
        if not isinstance(where, dict):
            raise CatalogError(f"{field} is not a table, so {key} cannot be set")
        if raw == "":
            where.pop(name, None)
        else:
            where[name] = value
    return out


def _config(table: dict[str, Any]) -> Any:
    import msgspec

    from coderai.contracts import ModelConfig

    try:
        return msgspec.convert(table, ModelConfig)
    except msgspec.ValidationError as exc:
        raise CatalogError(f"not a valid model: {exc}") from None


def _models_file(args: argparse.Namespace) -> str:
    return args.models_file or str(_data_dir(args) / "models.toml")


def _in_file(args: argparse.Namespace, name: str) -> Any:
    """Model `name` of the models file, or None."""
    from coderai.models_file import ModelsFileError, load_models

    path = _models_file(args)
    if not os.path.exists(path):
        return None
    try:
        return next((m for m in load_models(path) if m.name == name), None)
    except ModelsFileError as exc:
        raise CatalogError(str(exc)) from None


def _write_file(args: argparse.Namespace, name: str, cfg: Any) -> str:
    from coderai.models_file import ModelsFileError, entry, set_entry

    try:
        set_entry(_models_file(args), name, None if cfg is None else entry(cfg))
    except (ModelsFileError, ValueError) as exc:
        raise CatalogError(str(exc)) from None
    return _models_file(args)


def _add(args: argparse.Namespace) -> str:
    """`coderai models add`: a running stack serves it at once (a taken name is refused), else the models file has it."""
    from coderai.contracts import BusError
    from coderai.contracts.admin import AddModelRequest
    from coderai.contracts.subjects import CMD_SCHEDULER_ADD

    table: dict[str, Any] = {"name": args.name, "engine": args.engine, "path": args.path}
    table = _fields(table, [f"params.{p}" for p in args.param])
    table |= {k: v for k, v in (("resident", args.resident), ("keep_alive_s", args.keep_alive)) if v is not None}
    cfg = _config(_fields(table, args.fields))
    reply = _on_head(
        args, lambda bus: bus.request(CMD_SCHEDULER_ADD, AddModelRequest(model=cfg, replace=False), timeout=5.0)
    )
    if isinstance(reply, BusError):
        hint = "; `coderai models set` changes it" if reply.code == "conflict" else ""
        raise CatalogError(f"{reply.message}{hint}")
    if not isinstance(reply, str):
        return f"added {cfg.name}: the running stack serves it as soon as a node has loaded it"
    if _in_file(args, cfg.name) is not None:
        raise CatalogError(
            f"{_models_file(args)} has a model named {cfg.name!r} already; `coderai models set` changes it"
        )
    return f"no running stack reached ({reply}); added {cfg.name} to {_write_file(args, cfg.name, cfg)}: served when the stack starts"


def _served(args: argparse.Namespace, name: str) -> Any:
    """Model `name` as the running stack serves it, None when it serves no such model, or why no stack answered
    (a string, or the BusError it answered with)."""
    from coderai.contracts import ModelConfig, decode, model_key
    from coderai.contracts.topology import MODELS

    async def served(bus: Any) -> Any:
        from nats.js.errors import KeyNotFoundError

        try:
            got = await (await bus.kv(MODELS)).get(model_key(name))
        except KeyNotFoundError:
            return None
        return decode(got.value, ModelConfig) if got.value else None

    return _on_head(args, served)


def _check(args: argparse.Namespace, store: ModelStore) -> bool:
    """`coderai models check`: the model as the running stack serves it (else as the models file has it), checked
    by catalog/burst.py; prints a line per finding and returns whether it can burst."""
    import msgspec

    from coderai.catalog.burst import BrokerView, check_model, runpod_gpus
    from coderai.contracts import ModelConfig
    from coderai.runtime.settings import SettingsError, load_settings

    cfg = _served(args, args.name)
    if not isinstance(cfg, ModelConfig):
        cfg = _in_file(args, args.name)
    if cfg is None:
        raise CatalogError(f"no model {args.name!r} on the running stack or in {_models_file(args)}")
    try:
        view = load_settings(BrokerView, "pod-broker")
    except SettingsError as exc:
        raise CatalogError(str(exc)) from None
    if not view.runpod_api_key and os.environ.get("RUNPOD_API_KEY"):  # as `coderai up` takes it
        view = msgspec.structs.replace(view, runpod_api_key=os.environ["RUNPOD_API_KEY"])
    findings = check_model(
        cfg,
        store_root=store.root,
        endpoint=args.endpoint or os.environ.get("HF_ENDPOINT") or None,
        token=os.environ.get("HF_TOKEN") or view.hf_token or None,
        gpus=runpod_gpus(view),
    )
    ok = all(f.status != "no" for f in findings)
    skipped = sum(f.status == "skipped" for f in findings)
    said = (
        "cannot burst"
        if not ok
        else f"can burst, as far as was checked ({skipped} skipped)"
        if skipped
        else "can burst"
    )
    print(f"{cfg.name}: {said}")
    for f in findings:
        print(f"  {f.topic:<8} {f.status:<8} {f.text}")
    return ok


def _set(args: argparse.Namespace) -> str:
    """`coderai models set`: the served config (the stack's, else the models file's) with the fields changed."""
    from coderai.contracts import BusError
    from coderai.contracts.admin import AddModelRequest
    from coderai.contracts.subjects import CMD_SCHEDULER_ADD
    from coderai.models_file import entry

    if any(f.partition("=")[0] == "name" for f in args.fields):
        raise CatalogError("set does not rename a model: add it under the new name, then rm the old one")

    old = _served(args, args.name)
    if isinstance(old, (str, BusError)):
        cfg = _in_file(args, args.name)
        if cfg is None:
            raise CatalogError(f"no model {args.name!r} in {_models_file(args)}, and no running stack reached ({old})")
        new = _config(_fields(entry(cfg), args.fields))
        return f"no running stack reached ({old}); changed {args.name} in {_write_file(args, args.name, new)}"
    if old is None:
        raise CatalogError(f"the running stack serves no model {args.name!r}; `coderai models add` adds one")
    new = _config(_fields(entry(old), args.fields))
    reply = _on_head(args, lambda bus: bus.request(CMD_SCHEDULER_ADD, AddModelRequest(model=new), timeout=5.0))
    if isinstance(reply, (str, BusError)):
        raise CatalogError(f"not changed: {reply if isinstance(reply, str) else reply.message}")
    return f"changed {args.name}: its copies reload with the new config"


def _rm(args: argparse.Namespace, store: ModelStore) -> list[str]:
    """`coderai models rm`: stop serving it (the running stack, else the models file); `--files`: delete the pulled
    files too. Refused when neither happened."""
    from coderai.contracts import BusError
    from coderai.contracts.admin import RemoveModelRequest
    from coderai.contracts.subjects import CMD_SCHEDULER_REMOVE

    said: list[str] = []
    reply = _on_head(
        args, lambda bus: bus.request(CMD_SCHEDULER_REMOVE, RemoveModelRequest(name=args.name), timeout=5.0)
    )
    if isinstance(reply, str):
        if _in_file(args, args.name) is not None:
            said.append(
                f"no running stack reached ({reply}); removed {args.name} from {_write_file(args, args.name, None)}"
            )
        elif not args.files:
            raise CatalogError(
                f"no model {args.name!r} in {_models_file(args)}, and no running stack reached ({reply})"
            )
    elif isinstance(reply, BusError):
        if reply.code != "not_found" or not args.files:
            raise CatalogError(reply.message)
    else:
        said.append(f"stopped serving {args.name}: requests in flight finish, new ones get a 404")
    if args.files:
        rec = store.remove(args.name)
        said.append(f"removed {rec.name} ({_size(rec.size)})")
    return said


def main(argv: list[str] | None = None) -> int:
    """Entry point of `coderai models`."""
    args = _parser().parse_args(argv)
    store = ModelStore(args.data_dir)
    try:
        if args.cmd == "pull":
            t0 = time.monotonic()
            rec = pull(args.spec, store, Bar(), name=args.name, endpoint=args.endpoint or None)
            print(
                f"pulled {rec.name} ({rec.engine}, {_size(rec.size)}) in {time.monotonic() - t0:.1f}s: "
                f"{store.model_path(rec)}"
            )
            if args.place:
                entry = model_entry(rec, store)
                path = append_model(args.models_file or store.data / "models.toml", entry)
                print(f"added {rec.name} to {path}")
                print(_place_now(args, entry))
        elif args.cmd == "list":
            rows = store.list()
            if args.json:
                print(
                    json.dumps(
                        [
                            {
                                "name": r.name,
                                "repo": r.repo,
                                "engine": r.engine,
                                "kind": r.kind,
                                "size": r.size,
                                "path": str(store.model_path(r)),
                            }
                            for r in rows
                        ]
                    )
                )
            for r in [] if args.json else rows:
                print(f"{r.name:<32} {r.engine:<10} {r.kind:<11} {_size(r.size):>10}  {r.repo}")
        elif args.cmd == "catalog":
            for e in BUILTIN.values():
                print(
                    json.dumps(
                        {
                            "name": e.name,
                            "repo": e.repo,
                            "engine": e.engine,
                            "kind": e.kind,
                            "size_mb": e.size_mb,
                            "memory_mb": e.memory_mb,
                        }
                    )
                    if args.json
                    else f"{e.name:<28} {e.engine:<10} {e.kind:<11} ~{e.size_mb:>5} MB  {e.repo}"
                )
        elif args.cmd == "rm":
            print("\n".join(_rm(args, store)))
        elif args.cmd in ("add", "set"):
            print(_add(args) if args.cmd == "add" else _set(args))
        elif args.cmd == "check":
            return 0 if _check(args, store) else 1
        else:
            print(json.dumps(_info(args, store), indent=2))
    except CatalogError as exc:
        print(f"coderai models: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncoderai models: interrupted; pull again to resume", file=sys.stderr)
        return 130
    return 0
