"""`coderai up`: the whole stack on this machine, with nothing installed by hand beyond the package.

Starts an embedded `nats-server` (JetStream) and `redis-server`, then every service as a supervised child
process and one worker for this machine. On first run it builds a small GGUF model offline and creates an
API key; it prints the base URL, the key and an SDK example. Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec

from coderai import heads
from coderai.runtime import members
from coderai.runtime.cluster import WeakToken, check_token, fingerprint, with_user
from coderai.runtime.embedded import EmbeddedServerError, NatsServer, RedisServer, Routes, free_port
from coderai.runtime.logging import setup_logging
from coderai.runtime.private import private_process, private_tree
from coderai.runtime.store_watch import StoreWatch
from coderai.runtime.supervisor import Child, Supervisor
from coderai.runtime.tls import ensure_certs



SECRET_ENV = ("CODERAI_CLUSTER_TOKEN", "RUNPOD_API_KEY", "CODERAI_POD_BROKER_RUNPOD_API_KEY")
"""Secrets in `coderai up`'s environment that only the child that needs them is given (the scheduler the cluster
token, the pod broker the RunPod key), never every service."""


def runpod_api_key(key_file: str) -> str:
    """The RunPod API key: the first line of `key_file`, else RUNPOD_API_KEY (the `runpod` SDK's variable), else
    CODERAI_POD_BROKER_RUNPOD_API_KEY; "" with none."""
    if key_file:
        try:
            return Path(os.path.expanduser(key_file)).read_text().strip().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise SystemExit(f"coderai up: cannot read the RunPod API key from {key_file}: {exc}") from None
    return os.environ.get("RUNPOD_API_KEY") or os.environ.get("CODERAI_POD_BROKER_RUNPOD_API_KEY", "")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: a closed socket's TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ensure_default_model(data: Path) -> Path:
    """Write, once, a models file serving the tiny defaults: a GGUF chat model and one model per installed
    modality (coderai.defaults); building them is offline and takes seconds to a minute."""
    models_file = data / "models.toml"
    if not models_file.exists():
        try:
            from coderai.defaults import default_models
            from coderai.models_file import write_models_file
        except ImportError:
            raise SystemExit("coderai up: building the default model needs the llama extra: pip install 'coderai[llama]'")
        models = default_models(data, say=lambda m: print(m, flush=True))
        write_models_file(models_file, models)
        text = models_file.read_text()
        models_file.write_text("# Models this box serves. Add your own by path; see docs/modalities.md.\n" + text)
    return models_file


def ensure_api_key(data: Path) -> tuple[Path, str]:
    """Create an admin key on first run: its hash in keys.toml, the key itself in admin.key (mode 0600). A head that
    joined by invite has the first head's keys.toml already: its own admin key is added beside that head's, so the
    first head's admin key works at every gateway."""
    from coderai.accounts.keyfile import KeyRecord, hash_key, load_keys, new_key, write_keys

    keys_file, key_file = data / "keys.toml", data / "admin.key"
    if keys_file.exists() and key_file.exists():
        return keys_file, key_file.read_text().strip()
    key = new_key()
    others = list(load_keys(str(keys_file)).values()) if keys_file.exists() else []
    name = f"admin-{secrets.token_hex(3)}" if any(r.name == "admin" for r in others) else "admin"
    write_keys(str(keys_file), [*others, KeyRecord(name=name, sha256=hash_key(key), scopes=["inference", "admin"])])
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    return keys_file, key


def ensure_scrape_token(data: Path) -> str:
    """A token for Prometheus to read /metrics with (kept in scrape.token, mode 0600), made on first run."""
    path = data / "scrape.token"
    if path.exists():
        return path.read_text().strip()
    token = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    return token


def ensure_members(data: Path, token: str, worker_id: str, own_worker: bool = True) -> tuple[str, str]:
    """NATS' users for this head: the registry (kept across restarts, so joined nodes stay members), the service
    password (made once, in secrets/nats-service.password) and a password for this box's own worker, which is a
    node like any other (made once, in secrets/worker.password: a restart changes no member, so the registry the
    other heads share stays what it was). Writes the users file nats-server reads; returns (service, worker)
    passwords."""
    import bcrypt

    reg, password = members.ensure_registry(data / "nats", data / "secrets" / "nats-service.password", token)
    if not own_worker:  # a head that joined: its worker (if any) joins like any node, through the leader
        members.save(data / "nats" / "members.json", reg)
        members.write_users(data / "nats" / "users.conf", reg)
        return password, ""
    secret = data / "secrets" / "worker.password"
    mine = reg.members.get(worker_id)
    worker_password = members.read_secret(secret) if secret.exists() else ""
    if (mine is None or mine.kind != "node" or not worker_password
            or not bcrypt.checkpw(worker_password.encode(), mine.password_hash.encode())):
        worker_password = members.add_node(reg, worker_id)
        members.write_secret(secret, worker_password)
    members.save(data / "nats" / "members.json", reg)
    members.write_users(data / "nats" / "users.conf", reg)
    return password, worker_password


async def service_bus(data: Path, name: str):
    """A bus connection as a service to the `coderai up` running on `data` (its password, its CA), for the CLI."""
    from coderai.runtime.bus import Bus
    from coderai.runtime.tls import client_context

    ca = data / "nats" / "tls" / "ca.pem"
    tls = client_context(ca.read_text()) if ca.exists() else None
    return await Bus.connect(service_urls(data)[0], name, connect_timeout_s=5.0, tls=tls)


async def head_bus(name: str, nats_url: str = "", data: Path | None = None):
    """The CLI's connection to a head as a service: `nats_url` with CODERAI_NATS_PASSWORD_FILE and CODERAI_NATS_CA
    from the environment, else the `coderai up` running on `data`."""
    if not nats_url:
        return await service_bus(data, name)
    from coderai.runtime.bus import Bus
    from coderai.runtime.settings import CommonSettings

    settings = CommonSettings(nats_url=nats_url, nats_password_file=os.environ.get("CODERAI_NATS_PASSWORD_FILE", ""),
                              nats_ca=os.environ.get("CODERAI_NATS_CA", ""))
    return await Bus.connect_as(settings, name, connect_timeout_s=5.0)


def service_urls(data: Path) -> tuple[str, str]:
    """(NATS URL as a service, Redis URL with its password) of the `coderai up` running on `data`, for the CLI."""
    up = json.loads((data / "run" / "up.json").read_text())
    nats_url = with_user(up["nats_url"], members.SERVICE_USER, members.read_secret(data / "secrets" / "nats-service.password"))
    redis_password = members.read_secret(data / "secrets" / "redis.password")
    return nats_url, up["redis_url"].replace("://", f"://:{redis_password}@", 1)


def wait_ready(base: str, key: str, model: str, sup: Supervisor, timeout_s: float, chat: bool = True) -> None:
    """Ready means a real one-token chat answer came back through the whole stack; without a worker on this
    machine (`chat=False`: a head of the control plane only), that the gateway answers."""
    if not chat:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sup.tick()
            try:
                with urllib.request.urlopen(f"{base[:-3]}/healthz", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the gateway did not answer within {timeout_s:.0f}s")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        sup.tick()
        req = urllib.request.Request(f"{base}/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.25)
    raise TimeoutError(f"the stack did not answer a chat request within {timeout_s:.0f}s (last: {last})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="coderai up", description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=os.environ.get("CODERAI_DATA_DIR", "~/.coderai"), help="state directory (default ~/.coderai)")
    ap.add_argument("--host", default="127.0.0.1", help="gateway address (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    ap.add_argument("--nats-port", type=int, default=0, help="NATS port (default: a free one)")
    ap.add_argument("--redis-port", type=int, default=0, help="Redis port (default: a free one)")
    ap.add_argument("--metrics-port", type=int, default=9464, help="Prometheus port (default 9464, else a free one)")
    ap.add_argument("--models-file", help="TOML of [[models]] to serve (default: the built-in tiny model)")
    ap.add_argument("--no-auth", action="store_true", help="no API key (only with a loopback --host)")
    ap.add_argument("--cluster-token", default=os.environ.get("CODERAI_CLUSTER_TOKEN", ""),
                    help="let other machines join: NATS then requires credentials derived from this token and "
                         "listens on --nats-host; workers started with the same token find this head by mDNS")
    ap.add_argument("--nats-host", default="", help="NATS listen address (default: 0.0.0.0 with a token, else 127.0.0.1)")
    ap.add_argument("--mdns-interface", action="append", default=[], help="address to announce mDNS on (repeat)")
    ap.add_argument("--node-id", default="", help="this machine's node id (default: made once, kept in the data dir)")
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for the first answer")
    ap.add_argument("--runpod-key-file", default=os.environ.get("CODERAI_RUNPOD_KEY_FILE", ""),
                    help="a file holding a RunPod API key (else RUNPOD_API_KEY): with one, the pod broker runs, with "
                         "this box's Redis for its ledger and budgets; without one, it is not started")
    ap.add_argument("--pod-nats-url", default=os.environ.get("CODERAI_POD_BROKER_POD_NATS_URL", ""),
                    help="how a rented pod reaches this head's NATS (a public address); pods stay off without it")
    ap.add_argument("--head", action="store_true",
                    help="be one head of several (docs/ha.md): NATS routed to the other heads, Redis with a replica and "
                         "a sentinel on each; needs --address")
    ap.add_argument("--address", default="", help="with --head: this head's address, as the other heads and workers reach it")
    ap.add_argument("--join", default="", help="with --head: the invite `coderai heads invite` made on a running head")
    ap.add_argument("--route-port", type=int, default=heads.ROUTE_PORT, help="with --head: NATS route port (default 6222)")
    ap.add_argument("--sentinel-port", type=int, default=heads.SENTINEL_PORT, help="with --head: Redis Sentinel port (default 26379)")
    ap.add_argument("--no-worker", action="store_true", help="run no worker on this machine (a head of the control plane only)")
    args = ap.parse_args(argv)
    if (args.join or args.address) and not args.head:
        ap.error("--join and --address are for a head: add --head")
    if args.head and not (args.address or args.join):
        ap.error("--head needs --address (this head's address, as the other heads reach it)")

    data = Path(os.path.expanduser(args.data_dir)).resolve()
    # the data dir holds key hashes, usage, prompts in logs, models and tenants' files: this user's only, and so
    # is everything NATS, Redis, the services and the engines write there (Redis's append-only file too)
    private_process()
    private_tree(data)
    (data / "logs").mkdir(mode=0o700, parents=True, exist_ok=True)
    setup_logging("up", fmt="text")
    if not _port_free(args.host, args.port):
        print(f"coderai up: port {args.port} on {args.host} is in use; pass --port", file=sys.stderr)
        return 2
    metrics_port = args.metrics_port if _port_free("127.0.0.1", args.metrics_port) else free_port()

    stopping = False

    def _stop(signum, _frame):
        nonlocal stopping
        if stopping:
            return
        stopping = True
        print("\nstopping ...", flush=True)

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)

    nats = redis = sentinel = keeper = None
    sup = Supervisor()
    try:
        invite = None
        if args.join:
            try:
                invite = msgspec.json.decode(Path(os.path.expanduser(args.join)).read_bytes(), type=heads.Invite)
            except (OSError, msgspec.DecodeError) as exc:
                print(f"coderai up: cannot read the invite {args.join}: {exc}", file=sys.stderr)
                return 2
            if invite.expires_at < time.time():
                print(f"coderai up: the invite {args.join} is past its time: make a new one (coderai heads invite)",
                      file=sys.stderr)
                return 2
            if args.address and args.address != invite.address:
                print(f"coderai up: the invite is for a head at {invite.address}, not {args.address}", file=sys.stderr)
                return 2
            heads.install(data, invite)
        joined = (data / "secrets" / "joined").exists() or invite is not None  # a head that came in by an invite
        token = args.cluster_token
        if not token and args.head and (data / "secrets" / "cluster.token").exists():
            token = members.read_secret(data / "secrets" / "cluster.token")
        if token:
            try:
                check_token(token)
            except WeakToken as exc:
                print(f"coderai up: {exc}", file=sys.stderr)
                return 2
            if args.head:  # an invite made here hands it on, so every head answers joins
                members.write_secret(data / "secrets" / "cluster.token", token)
        runpod_key = runpod_api_key(args.runpod_key_file)
        nats_host = args.nats_host or ("0.0.0.0" if token or args.head else "127.0.0.1")
        nats_port = args.nats_port or (heads.NATS_PORT if token or args.head else None)
        from coderai.runtime.node_id import stable_node_id

        worker_id = stable_node_id(data, args.node_id)
        own_worker = not args.no_worker and not joined
        service_password, worker_password = ensure_members(data, token, worker_id, own_worker)
        redis_password = members.ensure_secret(data / "secrets" / "redis.password")
        keys_file, key = ensure_api_key(data) if not args.no_auth else (None, "")  # before an invite can be made
        address = invite.address if invite else args.address
        # beyond loopback NATS speaks TLS only, with a certificate of this head's own CA (joining workers pin it)
        tls = (ensure_certs(data / "nats" / "tls", names=[address] if address else None)
               if nats_host not in ("127.0.0.1", "localhost", "::1") else None)
        me = cluster = None
        known: list[heads.Head] = []
        if args.head:
            me = heads.Head(worker_id, address, nats_port=nats_port, route_port=args.route_port,
                            redis_port=args.redis_port or heads.REDIS_PORT, sentinel_port=args.sentinel_port)
            known = heads.merge(heads.load(data), [me])
            heads.save(data, known)  # what an invite made here names, before this head's JetStream answers
            # its own route too: nats-server skips a route to itself, and JetStream's cluster mode wants one even
            # on the first head, whose peers connect to it later
            cluster = Routes(worker_id, me.route, tuple(h.route for h in known),
                             members.ensure_secret(data / "secrets" / "route.password"), tls=tls)
        try:
            nats = NatsServer(data / "nats", port=nats_port, host=nats_host, users_file=data / "nats" / "users.conf",
                              tls=tls, cluster=cluster).start(log_file=data / "logs" / "nats.log")
        except EmbeddedServerError as exc:
            print(f"coderai up: {exc}", file=sys.stderr)
            return 2
        service_url = with_user(nats.url, members.SERVICE_USER, service_password)  # this process's bootstrap only
        service_passwords = {role: members.read_secret(data / "secrets" / members.service_secret(role))
                             for role in members.SERVICE_ROLES}
        if args.head:
            known = asyncio.run(heads.take_place(service_url, tls, me, data))
            if invite is not None:
                members.write_secret(data / "secrets" / "joined", args.join)
            master = heads.sentinel_master(known, exclude=worker_id)
            if master is None and joined:  # no sentinel answers: the heads the invite named have the master
                master = next((h.redis for h in known if h.node_id != worker_id), None)
            redis = RedisServer(data / "redis", port=me.redis_port, host=address, durable=True, password=redis_password,
                                replicaof=master if master and master != me.redis else "")
            sentinel = heads.sentinel_for(data, known, master or me.redis, me, redis_password)
        else:
            redis = RedisServer(data / "redis", port=args.redis_port or None, durable=True, password=redis_password)
        try:
            redis.start(log_file=data / "logs" / "redis.log")
            if redis.replicaof:  # its services start once it holds the master's data, so a failover finds it current
                try:
                    redis.wait_synced()
                except EmbeddedServerError as exc:
                    # the master the sentinels named may have moved on (a failover while this head was down): the
                    # sentinels, this head's among them, point this replica at the master there is; the services
                    # reach the master through the sentinels whatever this replica holds, so the head starts
                    print(f"coderai up: {exc}; starting anyway: the sentinels point it at the current master",
                          file=sys.stderr, flush=True)
            if sentinel is not None:
                sentinel.start(log_file=data / "logs" / "sentinel.log")
                heads.set_quorum(known, worker_id)
        except EmbeddedServerError as exc:
            print(f"coderai up: {exc}", file=sys.stderr)
            return 2
        redis_url = (heads.sentinel_url(known, redis_password) if args.head
                     else redis.url.replace("redis://", f"redis://:{redis_password}@", 1))
        models_file = Path(args.models_file).resolve() if args.models_file else ensure_default_model(data)
        scrape_token = ensure_scrape_token(data)
        gateway_args = ["--host", args.host, "--port", str(args.port)]
        if args.no_auth:
            gateway_args.append("--no-auth")
        else:
            gateway_args += ["--api-keys-file", str(keys_file)]
        # each service logs in as its own user, with its own password and rights (members.service_permissions);
        # none is handed the `service` login, which has every right (this process's own bootstrap keeps it)
        env = {k: v for k, v in os.environ.items()
               if k not in SECRET_ENV and k not in ("CODERAI_NATS_PASSWORD_FILE", "CODERAI_NATS_USER")} | {
            "CODERAI_NATS_URL": nats.url,
            "CODERAI_DATA_DIR": str(data),
            "CODERAI_NODE_ID": worker_id,  # this head's id: what its scheduler and pod broker hold their leases as
            "CODERAI_LOG_FORMAT": "json",
            "CODERAI_METRICS_REDIS_URL": redis_url,
            "CODERAI_METRICS_PORT": str(metrics_port),
            "CODERAI_METRICS_SCRAPE_TOKEN": scrape_token,
            "CODERAI_GATEWAY_REDIS_URL": redis_url,
            "CODERAI_GATEWAY_METRICS_URL": f"http://127.0.0.1:{metrics_port}/metrics",
            "CODERAI_GATEWAY_SCRAPE_TOKEN": scrape_token,
        } | ({"CODERAI_NATS_CA": str(tls.ca)} if tls else {}) | (
            {"CODERAI_NATS_REPLICAS": str(heads.replicas(known))} if args.head else {})
        # the scheduler keeps the member registry: joins (it alone holds the token), revocations, pods' users
        scheduler_env = env | {"CODERAI_CLUSTER_TOKEN": token, "CODERAI_SCHEDULER_MEMBERS_FILE": str(data / "nats" / "members.json"),
                               "CODERAI_SCHEDULER_NATS_USERS_FILE": str(data / "nats" / "users.conf"),
                               "CODERAI_SCHEDULER_NATS_PID_FILE": str(nats.pid_file)}
        # this box's worker is a node like any other: its own user, no token, no service rights; on a head that
        # joined by invite it joins with the cluster token like any node (the leader, on whichever head, makes its
        # user), and without a token that head runs none
        worker_env = env | {"CODERAI_NATS_URL": with_user(nats.url, members.node_user(worker_id), worker_password),
                            "CODERAI_WORKER_NODE_ID": worker_id,
                            "CODERAI_WORKER_BUS_EXEC": "true"}  # its models come from this box's own models file
        if not own_worker:
            worker_env = (env | {"CODERAI_NATS_URL": nats.url, "CODERAI_CLUSTER_TOKEN": token, "CODERAI_WORKER_NODE_ID": worker_id,
                                 "CODERAI_WORKER_MDNS": "false"}
                          if token and not args.no_worker else None)
        if token and own_worker:  # this box's worker tells the LAN where to join (the fingerprint names the cluster)
            worker_env["CODERAI_WORKER_ANNOUNCE_NATS_PORT"] = str(nats.port)
            worker_env["CODERAI_WORKER_ANNOUNCE_FINGERPRINT"] = fingerprint(token)
            if args.mdns_interface:
                worker_env["CODERAI_WORKER_MDNS_INTERFACES"] = ",".join(args.mdns_interface)
        # the broker alone holds the RunPod key, and runs only with one: its ledger, reservations and budgets are
        # in this box's Redis (without a key, /admin/pods says why no pods are rented)
        broker_env = env | {"CODERAI_POD_BROKER_RUNPOD_API_KEY": runpod_key, "CODERAI_POD_BROKER_REDIS_URL": redis_url}
        if args.pod_nats_url:
            broker_env["CODERAI_POD_BROKER_POD_NATS_URL"] = args.pod_nats_url
        py = [sys.executable, "-m"]
        for name, module, extra, child_env in [
            ("router", "coderai.router", [], env),
            ("scheduler", "coderai.scheduler", ["--models-file", str(models_file)], scheduler_env),
            ("pod-broker", "coderai.pod_broker", [], broker_env if runpod_key else None),
            ("metrics", "coderai.metrics", [], env),
            ("worker", "coderai.engine_worker", [], worker_env),
            ("gateway", "coderai.gateway", gateway_args, env),
        ]:
            if child_env is not None:
                if name in members.SERVICE_ROLES:
                    child_env = child_env | {"CODERAI_NATS_URL": with_user(nats.url, members.service_user(name),
                                                                            service_passwords[name])}
                sup.add(Child(name, py + [module, *extra], child_env, data / "logs" / f"{name}.log"))
        run = data / "run"
        run.mkdir(exist_ok=True)
        base = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/v1"
        (run / "up.json").write_text(json.dumps({
            "pid": os.getpid(), "base_url": base, "nats_url": nats.url,  # no secrets: see secrets/
            "redis_url": heads.sentinel_url(known, "").replace(":@", "", 1) if args.head else redis.url,
            "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
            "pids": {c.name: c.proc.pid for c in sup.children} | {"nats": nats.proc.pid, "redis": redis.proc.pid}
                    | ({"sentinel": sentinel.proc.pid} if sentinel else {}),
            "heads": [msgspec.to_builtins(h) for h in known] if args.head else [],
        }, indent=2))

        from coderai.models_file import load_models

        served = [m.name for m in load_models(str(models_file))]
        first = served[0]
        try:
            wait_ready(base, key, first, sup, args.ready_timeout, chat=worker_env is not None)
        except TimeoutError as exc:
            if not stopping:
                print(f"coderai up: {exc}; see the logs in {data / 'logs'}", file=sys.stderr)
                return 1
        if not stopping:
            print(banner(base, key, first, nats.url, metrics_port, data, tuple(served[1:]), pods=bool(runpod_key)),
                  flush=True)
            if token:
                print(f"\ncluster {fingerprint(token)[:8]}: on another machine run `coderai worker --cluster-token <token>`"
                      f" (found by mDNS), or add --nats-url nats://<this host>:{nats.port}", flush=True)
        store = StoreWatch(data / "logs" / "nats.log", data / "nats")
        if args.head:
            keeper = heads.Keeper(service_url, tls, me, data)
            keeper.start()
        while not stopping:
            sup.tick()
            keep_up(nats, redis, store, data / "logs", sentinel)
            time.sleep(0.25)
        return 0
    finally:
        if keeper:
            keeper.stop.set()
        sup.stop()
        if sentinel:
            sentinel.stop()
        if redis:
            redis.stop()
        if nats:
            nats.stop()
        print("stopped", flush=True)


def keep_up(nats: NatsServer, redis: RedisServer, store: StoreWatch, logs: Path, sentinel=None) -> None:
    """Start nats-server, redis-server or a head's sentinel again on its port if it died, and nats-server once its
    JetStream store failed on a full disk that has room again (`StoreWatch`): the services reconnect by themselves.
    A head's Redis comes back as it was configured; if another head's was promoted meanwhile, the sentinels make
    this one its replica."""
    for name, server, log in (("nats-server", nats, "nats"), ("redis-server", redis, "redis"),
                              ("redis-sentinel", sentinel, "sentinel")):
        if server is None:
            continue
        if server.proc is not None and server.proc.poll() is not None:
            print(f"{name} exited with {server.proc.returncode}; starting it again", file=sys.stderr, flush=True)
            try:
                server.start(log_file=logs / f"{log}.log")
            except EmbeddedServerError as exc:
                print(f"{name} did not start again: {exc}", file=sys.stderr, flush=True)
    if store.due():
        nats.stop()
        nats.start(log_file=logs / "nats.log")
        store.restarted()


def banner(base: str, key: str, model: str, nats_url: str, metrics_port: int, data: Path,
           others: tuple[str, ...] = (), pods: bool = False) -> str:
    # the key itself is not printed (terminals and their scrollback, CI logs and screen shares keep what is)
    shown_key = f"in {data / 'admin.key'}" if key else "anything (auth is off)"
    sdk_key = f'open("{data / "admin.key"}").read().strip()' if key else '"none"'
    also = f"\n  also       {', '.join(others)}   (GET /v1/models: each with its kind)" if others else ""
    return f"""
coderai is up.

  base URL   {base}
  API key    {shown_key}
  model      {model}{also}
  NATS       {nats_url}
  metrics    {base[:-3]}/metrics (admin key, or the token in {data / 'scrape.token'})
  pods       {"RunPod, through the pod broker (GET /admin/pods)" if pods else "off: no RunPod API key (--runpod-key-file)"}
  logs       {data / 'logs'}

Try it with the official SDK:

  from openai import OpenAI
  client = OpenAI(base_url="{base}", api_key={sdk_key})
  r = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(r.choices[0].message.content)

Ctrl-C stops everything.
ready"""


if __name__ == "__main__":
    raise SystemExit(main())
