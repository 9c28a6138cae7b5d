"""`coderai up`: the whole stack on this machine, with nothing installed by hand beyond the package.

Starts an embedded `nats-server` (JetStream) and `redis-server`, then every service as a supervised child
process and one worker for this machine. On first run it builds a small GGUF model offline and creates an
API key; it prints the base URL, the key and an SDK example. Ctrl-C stops everything. With `--head`, this
machine is one head of several (docs/ha.md): the same steps, with routed NATS, a Redis replica and a sentinel.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from coderai.models_file import load_models
from coderai.runtime.logging import setup_logging
from coderai.runtime.private import private_process, private_tree
from coderai.runtime.store_watch import StoreWatch
from coderai.runtime.supervisor import Supervisor
from coderai.stack import children, ha, local, plan
from coderai.stack.datadir import port_free
from coderai.stack.ready import banner, cluster_hint, wait_ready
from coderai.stack.servers import Servers


def main(argv: list[str] | None = None) -> int:
    """Run `coderai up` until Ctrl-C or SIGTERM: plan, servers, children, ready, then keep them up."""
    args = plan.parse_args(argv)
    data = _private_data_dir(args)
    if not port_free(args.host, args.port):
        print(f"coderai up: port {args.port} on {args.host} is in use; pass --port", file=sys.stderr)
        return 2
    stopping = _stop_on_signals()
    sup, servers, keeper = Supervisor(), Servers(data), None
    try:
        p = plan.make(args, data)
        servers.start(p)
        models_file = children.start(sup, p, servers)
        nats = servers.started_nats
        base = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/v1"
        local.write_record(
            data,
            base,
            nats.url,
            servers.redis_url(""),
            p.metrics_port,
            {c.name: c.proc.pid for c in sup.children if c.proc is not None} | servers.pids(),
            servers.known,
        )
        served = [m.name for m in load_models(str(models_file))]
        try:
            chat = any(c.name == "worker" for c in sup.children)  # without a worker here, the gateway answering
            wait_ready(base, p.key, served[0], sup, args.ready_timeout, chat=chat)
        except TimeoutError as exc:
            if not stopping.is_set():
                print(f"coderai up: {exc}; see the logs in {data / 'logs'}", file=sys.stderr)
                return 1
        if not stopping.is_set():
            print(
                banner(
                    base,
                    p.key,
                    served[0],
                    nats.url,
                    p.metrics_port,
                    data,
                    tuple(served[1:]),
                    pods=bool(p.runpod_key),
                ),
                flush=True,
            )
            if p.token:
                print(cluster_hint(p.token, nats.started_port()), flush=True)
        store = StoreWatch(data / "logs" / "nats.log", data / "nats")
        if p.me is not None:
            keeper = ha.Keeper(servers.service_url, p.tls, p.me, data)
            keeper.start()
        while not stopping.is_set():
            sup.tick()
            servers.keep_up(store)
            time.sleep(0.25)
        return 0
    except plan.StackError as exc:
        print(f"coderai up: {exc}", file=sys.stderr)
        return 2
    finally:
        if keeper:
            keeper.stop.set()
        sup.stop()
        servers.stop()
        print("stopped", flush=True)


def _private_data_dir(args: argparse.Namespace) -> Path:
    """The data dir, this user's only: it holds key hashes, usage, prompts in logs, models and tenants' files, and
    so is everything NATS, Redis, the services and the engines write there (Redis's append-only file too)."""
    data = Path(args.data_dir).expanduser().resolve()
    private_process()
    private_tree(data)
    (data / "logs").mkdir(mode=0o700, parents=True, exist_ok=True)
    setup_logging("up", fmt="text")
    return data


def _stop_on_signals() -> threading.Event:
    """An event set by the first SIGINT or SIGTERM (which says so once); the main loop then stops everything."""
    stopping = threading.Event()

    def stop(_signum, _frame) -> None:
        if not stopping.is_set():
            stopping.set()
            print("\nstopping ...", flush=True)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    return stopping


if __name__ == "__main__":
    raise SystemExit(main())
