"""python -m coderai.engine_worker"""

from coderai.runtime.node_id import stable_node_id
from coderai.engine_worker.service import Worker
from coderai.engine_worker.settings import WorkerSettings
from coderai.runtime.entry import run_service


def make(settings: WorkerSettings):
    return Worker(settings, stable_node_id(settings.data_dir, settings.node_id)).start


def _args(ap) -> None:
    ap.add_argument(
        "--mdns-interface",
        dest="mdns_interfaces",
        action="append",
        help="address to announce and browse mDNS on (repeat; default every interface)",
    )
    ap.add_argument(
        "--no-mdns", dest="mdns", action="store_const", const=False, help="no mDNS: join by --nats-url only"
    )
    ap.add_argument(
        "--families",
        dest="families",
        type=lambda s: [f for f in s.split(",") if f],
        help="engine families to offer, comma-separated (default: every installed one)",
    )
    ap.add_argument(
        "--rpc",
        dest="rpc",
        action="store_const",
        const=True,
        help="offer this machine's CPU as a ggml RPC server for models split over several nodes",
    )
    ap.add_argument("--rpc-bind", dest="rpc_bind", help="address for the RPC gate (default: the cluster interface)")
    ap.add_argument("--rpc-port", dest="rpc_port", type=int, help="port for the RPC gate (default 50052)")
    ap.add_argument(
        "--rpc-allow-any",
        dest="rpc_allow_any",
        action="store_const",
        const=True,
        help="allow binding the RPC gate to every interface (0.0.0.0); ggml RPC has no authentication",
    )


def main(argv: list[str] | None = None) -> int:
    return run_service(
        "worker",
        "Runs this machine's engines: loads what its assignment says, answers jobs, heartbeats. "
        "Join a cluster with --cluster-token alone (the head is found by mDNS) or with --nats-url too.",
        WorkerSettings,
        make,
        argv,
        add_args=_args,
        drain_timeout_s=30.0,
    )


if __name__ == "__main__":
    raise SystemExit(main())
