"""What `coderai up` starts, read from its arguments and its data dir before any server runs: the ports and
addresses, the cluster token and the secrets, this machine's node id and whether it runs a worker, the TLS files and,
for a head, the heads it knows and its NATS routes. Making the plan writes what a first run or an invite adds to the
data dir (members, passwords, the admin key, the heads file)."""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from coderai.runtime import members
from coderai.runtime.cluster import WeakToken, check_token
from coderai.runtime.embedded import Routes, free_port
from coderai.runtime.node_id import stable_node_id
from coderai.runtime.settings import SettingsError, env_or_file
from coderai.runtime.tls import TlsFiles, ensure_certs
from coderai.stack import heads
from coderai.stack.datadir import ensure_api_key, ensure_members, port_free, runpod_api_key

DESCRIPTION = "`coderai up`: the whole stack on this machine, with nothing installed by hand beyond the package."


class StackError(Exception):
    """`coderai up` cannot start as asked (a bad invite, a weak token, a server that does not start): said on stderr,
    exit status 2."""


def parser() -> argparse.ArgumentParser:
    """`coderai up`'s arguments."""
    ap = argparse.ArgumentParser(prog="coderai up", description=DESCRIPTION)
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"),
        help="state directory (default ~/.coderai)",
    )
    ap.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    ap.add_argument("--nats-port", type=int, default=0, help="NATS port (default: a free one)")
    ap.add_argument("--redis-port", type=int, default=0, help="Redis port (default: a free one)")
    ap.add_argument("--metrics-port", type=int, default=9464, help="Prometheus port (default 9464, else a free one)")
    ap.add_argument("--models-file", help="TOML of [[models]] to serve (default: the built-in tiny model)")
    ap.add_argument("--no-auth", action="store_true", help="no API key (only with a loopback --host)")
    ap.add_argument(
        "--cluster-token",
        default=None,
        help="let other machines join: NATS then requires credentials derived from this token and "
        "listens on --nats-host; workers started with the same token find this head by mDNS "
        "(default: CODERAI_CLUSTER_TOKEN, or the file CODERAI_CLUSTER_TOKEN_FILE names)",
    )
    ap.add_argument(
        "--nats-host", default="", help="NATS listen address (default: 0.0.0.0 with a token, else 127.0.0.1)"
    )
    ap.add_argument("--mdns-interface", action="append", default=[], help="address to announce mDNS on (repeat)")
    ap.add_argument("--node-id", default="", help="this machine's node id (default: made once, kept in the data dir)")
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for the first answer")
    ap.add_argument(
        "--runpod-key-file",
        default=os.environ.get("CODERAI_RUNPOD_KEY_FILE", ""),
        help="a file holding a RunPod API key (else RUNPOD_API_KEY): with one, the pod broker runs, with "
        "this box's Redis for its ledger and budgets; without one, it is not started",
    )
    ap.add_argument(
        "--pod-nats-url",
        default=os.environ.get("CODERAI_POD_BROKER_POD_NATS_URL", ""),
        help="how a rented pod reaches this head's NATS (a public address); pods stay off without it",
    )
    ap.add_argument(
        "--head",
        action="store_true",
        help="be one head of several (docs/ha.md): NATS routed to the other heads, Redis with a replica and "
        "a sentinel on each; needs --address",
    )
    ap.add_argument(
        "--address", default="", help="with --head: this head's address, as the other heads and workers reach it"
    )
    ap.add_argument("--join", default="", help="with --head: the invite `coderai heads invite` made on a running head")
    ap.add_argument(
        "--route-port", type=int, default=heads.ROUTE_PORT, help="with --head: NATS route port (default 6222)"
    )
    ap.add_argument(
        "--sentinel-port",
        type=int,
        default=heads.SENTINEL_PORT,
        help="with --head: Redis Sentinel port (default 26379)",
    )
    ap.add_argument(
        "--no-worker", action="store_true", help="run no worker on this machine (a head of the control plane only)"
    )
    return ap


def token_from_env(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--cluster-token` when given, else CODERAI_CLUSTER_TOKEN or the file CODERAI_CLUSTER_TOKEN_FILE names (both
    set, or a bad file: argparse's usage error). For `coderai up` and `coderai heads invite`."""
    if args.cluster_token is None:
        try:
            args.cluster_token = env_or_file("CODERAI_CLUSTER_TOKEN")
        except SettingsError as exc:
            ap.error(str(exc))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, with the head options checked against each other (argparse's usage error, status 2)."""
    ap = parser()
    args = ap.parse_args(argv)
    token_from_env(ap, args)
    if (args.join or args.address) and not args.head:
        ap.error("--join and --address are for a head: add --head")
    if args.head and not (args.address or args.join):
        ap.error("--head needs --address (this head's address, as the other heads reach it)")
    return args


@dataclass(kw_only=True)
class Plan:
    """What to start, decided before any server runs."""

    args: argparse.Namespace
    data: Path
    metrics_port: int
    token: str  # the cluster token, "" without one
    runpod_key: str
    nats_host: str
    nats_port: int | None  # None: a free one
    worker_id: str  # this machine's node id: its worker's, and its head's
    joined: bool  # a head that came in by an invite (now or at an earlier start)
    own_worker: bool  # a worker of this box's own (not a joined head's, which joins like any node)
    service_password: str
    worker_password: str
    redis_password: str
    keys_file: Path | None  # None with --no-auth
    key: str
    tls: TlsFiles | None  # NATS beyond loopback speaks TLS only
    invite: heads.Invite | None = None
    me: heads.Head | None = None  # with --head: this head
    known: list[heads.Head] = field(default_factory=list)  # with --head: the heads known before this one starts
    cluster: Routes | None = None  # with --head: its NATS routes


def read_invite(args: argparse.Namespace) -> heads.Invite:
    """The invite `--join` names, refused when unreadable, past its time or for another address."""
    try:
        invite = msgspec.json.decode(Path(os.path.expanduser(args.join)).read_bytes(), type=heads.Invite)
    except (OSError, msgspec.DecodeError) as exc:
        raise StackError(f"cannot read the invite {args.join}: {exc}") from None
    if invite.expires_at < time.time():
        raise StackError(f"the invite {args.join} is past its time: make a new one (coderai heads invite)")
    if args.address and args.address != invite.address:
        raise StackError(f"the invite is for a head at {invite.address}, not {args.address}")
    return invite


def cluster_token(args: argparse.Namespace, data: Path) -> str:
    """--cluster-token, else (on a head) the one kept in the data dir; refused when weak. A head keeps it, so an
    invite made there hands it on and every head answers joins."""
    token = args.cluster_token
    if not token and args.head and (data / "secrets" / "cluster.token").exists():
        token = members.read_secret(data / "secrets" / "cluster.token")
    if token:
        try:
            check_token(token)
        except WeakToken as exc:
            raise StackError(str(exc)) from None
        if args.head:
            members.write_secret(data / "secrets" / "cluster.token", token)
    return token


def make(args: argparse.Namespace, data: Path) -> Plan:
    """The plan for `args` on `data`; a head that joins installs its invite first."""
    metrics_port = args.metrics_port if port_free("127.0.0.1", args.metrics_port) else free_port()
    invite = read_invite(args) if args.join else None
    if invite is not None:
        heads.install(data, invite)
    joined = (data / "secrets" / "joined").exists() or invite is not None  # a head that came in by an invite
    token = cluster_token(args, data)
    runpod_key = runpod_api_key(args.runpod_key_file)
    nats_host = args.nats_host or ("0.0.0.0" if token or args.head else "127.0.0.1")
    nats_port = args.nats_port or (heads.NATS_PORT if token or args.head else None)
    worker_id = stable_node_id(data, args.node_id)
    own_worker = not args.no_worker and not joined
    service_password, worker_password = ensure_members(data, token, worker_id, own_worker)
    redis_password = members.ensure_secret(data / "secrets" / "redis.password")
    keys_file, key = ensure_api_key(data) if not args.no_auth else (None, "")  # before an invite can be made
    address = invite.address if invite else args.address
    tls = (
        ensure_certs(data / "nats" / "tls", names=[address] if address else None)
        if nats_host not in ("127.0.0.1", "localhost", "::1")
        else None
    )
    plan = Plan(
        args=args,
        data=data,
        metrics_port=metrics_port,
        token=token,
        runpod_key=runpod_key,
        nats_host=nats_host,
        nats_port=nats_port,
        worker_id=worker_id,
        joined=joined,
        own_worker=own_worker,
        service_password=service_password,
        worker_password=worker_password,
        redis_password=redis_password,
        keys_file=keys_file,
        key=key,
        tls=tls,
        invite=invite,
    )
    if args.head:
        plan.me = heads.Head(
            worker_id,
            address,
            nats_port=nats_port or heads.NATS_PORT,  # never None for a head (above)
            route_port=args.route_port,
            redis_port=args.redis_port or heads.REDIS_PORT,
            sentinel_port=args.sentinel_port,
        )
        plan.known = heads.merge(heads.load(data), [plan.me])
        heads.save(data, plan.known)  # what an invite made here names, before this head's JetStream answers
        # its own route too: nats-server skips a route to itself, and JetStream's cluster mode wants one even
        # on the first head, whose peers connect to it later
        plan.cluster = Routes(
            worker_id,
            plan.me.route,
            tuple(h.route for h in plan.known),
            members.ensure_secret(data / "secrets" / "route.password"),
            tls=tls,
        )
    return plan
