"""The shared `main()` of a service: arguments, settings, logging, then the lifecycle."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import TypeVar

from coderai.contracts import BusError
from coderai.runtime.lifecycle import Starter, serve_until_stopped
from coderai.runtime.logging import log_fields, setup_logging
from coderai.runtime.private import private_process
from coderai.runtime.settings import CommonSettings, SettingsError, describe, load_settings
from coderai.runtime.tracing import setup_tracing

S = TypeVar("S", bound=CommonSettings)


def parser(service: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every service takes; each overrides its `CODERAI_*` variable."""
    ap = argparse.ArgumentParser(prog=f"coderai {service}", description=description)
    ap.add_argument("--nats-url", dest="nats_url", help="NATS server URL (CODERAI_NATS_URL)")
    ap.add_argument("--cluster-token", dest="cluster_token", help="the cluster's shared secret (CODERAI_CLUSTER_TOKEN)")
    ap.add_argument("--node-id", dest="node_id", help="this node's id (CODERAI_NODE_ID)")
    ap.add_argument("--log-level", dest="log_level", help="DEBUG, INFO, WARNING (CODERAI_LOG_LEVEL)")
    ap.add_argument("--data-dir", dest="data_dir", help="state directory (CODERAI_DATA_DIR)")
    return ap


def settings_from_args(settings_cls: type[S], service: str, args: argparse.Namespace) -> S:
    fields = set(settings_cls.__struct_fields__)
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    return load_settings(settings_cls, service, **overrides)


def memory_report_on_signal(service: str) -> None:
    """With `CODERAI_MEMORY_REPORT=<dir>` (or `CODERAI_<SERVICE>_MEMORY_REPORT`): trace allocations from now on, and on SIGUSR2 write the 40 source lines
    that hold the most memory, and what changed since the first report, to `<dir>/<service>-<pid>.txt`. For finding
    what grows (bench/soak.py's RSS target); it costs memory and speed, so it is off unless asked for."""
    import os

    svc = service.upper().replace("-", "_")
    folder = os.environ.get(f"CODERAI_{svc}_MEMORY_REPORT", "") or os.environ.get("CODERAI_MEMORY_REPORT", "")
    if not folder:
        return
    import signal
    import tracemalloc

    tracemalloc.start(8)
    first: list = []

    def report(_sig: int, _frame: object) -> None:
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        first[:] = first or [snap]
        lines = [f"{service} pid {os.getpid()}: traced {tracemalloc.get_traced_memory()[0] >> 10} KiB", "", "top:"]
        lines += [str(s) for s in snap.statistics("lineno")[:40]]
        lines += ["", "growth since the first report:"] + [str(s) for s in snap.compare_to(first[0], "lineno")[:40]]
        with open(os.path.join(folder, f"{service}-{os.getpid()}.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")

    signal.signal(signal.SIGUSR2, report)


def run(coro) -> None:
    """asyncio.run on uvloop where it is installed: every bus message costs fewer event-loop cycles there."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def run_service(
    service: str,
    description: str,
    settings_cls: type[S],
    make: Callable[[S], Starter],
    argv: list[str] | None = None,
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    drain_timeout_s: float = 15.0,
) -> int:
    """Parse flags, load settings (exit 2 naming the bad variable), set up logging and tracing, serve until
    signalled."""
    private_process()  # what a service writes (its data dir, logs, stores) is its user's only
    ap = parser(service, description)
    if add_args:
        add_args(ap)
    args = ap.parse_args(argv)
    try:
        settings = settings_from_args(settings_cls, service, args)
        setup_logging(service, getattr(settings, "node_id", ""), settings.log_level, settings.log_format)
        logging.getLogger(f"coderai.{service}").info("starting", extra=log_fields(settings=describe(settings)))
        setup_tracing(service, getattr(settings, "node_id", ""))
        memory_report_on_signal(service)
        starter = make(settings)
    except SettingsError as exc:
        print(f"coderai {service}: {exc}", file=sys.stderr)
        return 2
    try:
        run(serve_until_stopped(starter, drain_timeout_s=drain_timeout_s))
    except KeyboardInterrupt:
        pass
    except BusError as exc:  # e.g. NATS unreachable, or it refused our credentials
        print(f"coderai {service}: {exc.message}", file=sys.stderr)
        return 1
    return 0
