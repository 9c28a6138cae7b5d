"""The services `coderai up` runs as supervised children, each with the environment it needs and no more: its own
NATS user, and only the secret that is its own (the scheduler the cluster token, the pod broker the RunPod key)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from coderai.runtime import members
from coderai.runtime.cluster import fingerprint, with_user
from coderai.runtime.embedded import NatsServer
from coderai.runtime.supervisor import Child, Supervisor
from coderai.stack import heads
from coderai.stack.datadir import ensure_default_model, ensure_scrape_token
from coderai.stack.plan import Plan
from coderai.stack.servers import Servers

SECRET_ENV = ("CODERAI_CLUSTER_TOKEN", "RUNPOD_API_KEY", "CODERAI_POD_BROKER_RUNPOD_API_KEY")
"""Secrets in `coderai up`'s environment that only the child that needs them is given (the scheduler the cluster
token, the pod broker the RunPod key), never every service."""

Env = dict[str, str]


def given_wins(env: Env) -> Env:
    """`env` without the `X_FILE` of each `X` it holds: what `coderai up` hands a child itself (its NATS URL, the
    token to the scheduler) wins over a file of `up`'s own environment, which the child would otherwise find
    beside it (both set: runtime/settings.py refuses to guess)."""
    return {k: v for k, v in env.items() if not (k.endswith("_FILE") and k.removesuffix("_FILE") in env)}


def common_env(plan: Plan, servers: Servers) -> Env:
    """What every child is given: `coderai up`'s own environment less its secrets, and where the stack answers."""
    redis_url, metrics_port = servers.redis_url(plan.redis_password), plan.metrics_port
    scrape_token = ensure_scrape_token(plan.data)
    return (
        {
            k: v
            for k, v in os.environ.items()
            if k.removesuffix("_FILE") not in SECRET_ENV  # a secret's file, as the secret: only to who needs it
            and k not in ("CODERAI_NATS_PASSWORD_FILE", "CODERAI_NATS_USER")
        }
        | {
            "CODERAI_NATS_URL": servers.started_nats.url,
            "CODERAI_DATA_DIR": str(plan.data),
            "CODERAI_NODE_ID": plan.worker_id,  # this head's id: what its scheduler and pod broker hold their leases as
            "CODERAI_LOG_FORMAT": "json",
            "CODERAI_METRICS_REDIS_URL": redis_url,
            "CODERAI_METRICS_PORT": str(metrics_port),
            "CODERAI_METRICS_SCRAPE_TOKEN": scrape_token,
            "CODERAI_GATEWAY_REDIS_URL": redis_url,
            "CODERAI_GATEWAY_METRICS_URL": f"http://127.0.0.1:{metrics_port}/metrics",
            "CODERAI_GATEWAY_SCRAPE_TOKEN": scrape_token,
        }
        | ({"CODERAI_NATS_CA": str(plan.tls.ca)} if plan.tls else {})
        | ({"CODERAI_NATS_REPLICAS": str(heads.replicas(servers.known))} if plan.me is not None else {})
    )


def worker_env(plan: Plan, env: Env, nats: NatsServer) -> Env | None:
    """This box's worker, a node like any other: its own user, no token, no service rights. On a head that joined
    by invite it joins with the cluster token like any node (the leader, on whichever head, makes its user), and
    without a token that head runs none (None)."""
    if not plan.own_worker:
        return (
            env
            | {
                "CODERAI_NATS_URL": nats.url,
                "CODERAI_CLUSTER_TOKEN": plan.token,
                "CODERAI_WORKER_NODE_ID": plan.worker_id,
                "CODERAI_WORKER_MDNS": "false",
            }
            if plan.token and not plan.args.no_worker
            else None
        )
    out = env | {
        "CODERAI_NATS_URL": with_user(nats.url, members.node_user(plan.worker_id), plan.worker_password),
        "CODERAI_WORKER_NODE_ID": plan.worker_id,
        "CODERAI_WORKER_BUS_EXEC": "true",
    }  # its models come from this box's own models file
    if plan.token:  # this box's worker tells the LAN where to join (the fingerprint names the cluster)
        out["CODERAI_WORKER_ANNOUNCE_NATS_PORT"] = str(nats.port)
        out["CODERAI_WORKER_ANNOUNCE_FINGERPRINT"] = fingerprint(plan.token)
        if plan.args.mdns_interface:
            out["CODERAI_WORKER_MDNS_INTERFACES"] = ",".join(plan.args.mdns_interface)
    return out


def start(sup: Supervisor, plan: Plan, servers: Servers) -> Path:
    """Add every service this machine runs to `sup` (which starts each); the models file they serve."""
    args, data, nats = plan.args, plan.data, servers.started_nats
    models_file = Path(args.models_file).resolve() if args.models_file else ensure_default_model(data)
    env = common_env(plan, servers)
    gateway_args = ["--host", args.host, "--port", str(args.port)]
    gateway_args += ["--no-auth"] if args.no_auth else ["--api-keys-file", str(plan.keys_file)]
    # the scheduler keeps the member registry: joins (it alone holds the token), revocations, pods' users
    scheduler_env = env | {
        "CODERAI_CLUSTER_TOKEN": plan.token,
        "CODERAI_SCHEDULER_MEMBERS_FILE": str(data / "nats" / "members.json"),
        "CODERAI_SCHEDULER_NATS_USERS_FILE": str(data / "nats" / "users.conf"),
        "CODERAI_SCHEDULER_NATS_PID_FILE": str(nats.pid_file),
    }
    # the broker alone holds the RunPod key, and runs only with one: its ledger, reservations and budgets are
    # in this box's Redis (without a key, /admin/pods says why no pods are rented)
    broker_env = env | {
        "CODERAI_POD_BROKER_RUNPOD_API_KEY": plan.runpod_key,
        "CODERAI_POD_BROKER_REDIS_URL": env["CODERAI_GATEWAY_REDIS_URL"],
    }
    if args.pod_nats_url:
        broker_env["CODERAI_POD_BROKER_POD_NATS_URL"] = args.pod_nats_url
    # each service logs in as its own user, with its own password and rights (members.service_permissions);
    # none is handed the `service` login, which has every right (this process's own bootstrap keeps it)
    passwords = {
        role: members.read_secret(data / "secrets" / members.service_secret(role)) for role in members.SERVICE_ROLES
    }
    for name, module, extra, child_env in [
        ("router", "coderai.router", [], env),
        ("scheduler", "coderai.scheduler", ["--models-file", str(models_file)], scheduler_env),
        ("pod-broker", "coderai.pod_broker", [], broker_env if plan.runpod_key else None),
        ("metrics", "coderai.metrics", [], env),
        ("worker", "coderai.engine_worker", [], worker_env(plan, env, nats)),
        ("gateway", "coderai.gateway", gateway_args, env),
    ]:
        if child_env is not None:
            if name in members.SERVICE_ROLES:
                own = with_user(nats.url, members.service_user(name), passwords[name])
                child_env = child_env | {"CODERAI_NATS_URL": own}
            child_env = given_wins(child_env)
            sup.add(Child(name, [sys.executable, "-m", module, *extra], child_env, data / "logs" / f"{name}.log"))
    return models_file
