"""compose/: every command is a real entry point, every CODERAI_* variable one the service reads, ports and
volumes agree with each other and with the settings, and .env.example documents exactly what the files use."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pytest
from coderai.cli import COMMANDS
from coderai.models_file import load_models

from tests.deploy.conftest import TEST_TOKEN

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
FILES = ("head.yml", "node.yml", "gpu.yml")
DATA_DIR = "/var/lib/coderai"


def _is_coderai(svc: dict, env: dict[str, str]) -> bool:
    return str(svc.get("image", "")).startswith(env["IMAGE_PREFIX"] + "-")


def _kind(svc: dict) -> str:
    """ "gateway", "worker", ... for `coderai <service>`; "init" and "nats" for the helpers."""
    cmd = svc["command"]
    names = {"coderai": cmd[1] if len(cmd) > 1 else "", "coderai-init": "init", "nats-server": "nats"}
    return names.get(cmd[0], cmd[0])


def _mounts(svc: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume entry."""
    out = []
    for entry in svc.get("volumes", []):
        source, target = entry.split(":")[:2]
        out.append((source, target))
    return out


def _port(mapping: str) -> tuple[str, int, int]:
    ip, host, container = mapping.split(":")
    return ip, int(host), int(container)


def _default(settings_cls, field: str):
    return {f.name: f.default for f in msgspec.structs.fields(settings_cls)}[field]


def _service(doc: dict, kind: str) -> dict:
    [svc] = [s for s in doc["services"].values() if "command" in s and _kind(s) == kind]
    return svc


def test_commands_are_real_entry_points(head, node, compose_env, head_init, envdoc):
    seen = set()
    for doc in (head, node):
        for name, svc in doc["services"].items():
            cmd = svc["command"]
            assert isinstance(cmd, list) and cmd, f"{name}: command must be an exec-form list"
            if not _is_coderai(svc, compose_env):
                assert name == "redis" and cmd[:2] == ["sh", "-c"] and "exec redis-server /tmp/redis.conf" in cmd[2], (
                    name
                )
                continue
            kind = _kind(svc)
            seen.add(kind)
            if cmd[0] == "coderai":
                assert kind in COMMANDS and kind not in ("up", "keys"), f"{name}: `coderai {kind}` is not a service"
                assert importlib.util.find_spec(COMMANDS[kind][0]) is not None
                assert name == kind, f"service {name} runs `coderai {kind}`"
            elif kind == "init":
                args = head_init.parser().parse_args(cmd[1:])  # exits (fails the test) on a bad flag
                assert args.nats_conf and args.keys_dir
            elif kind == "nats":
                init_args = head_init.parser().parse_args(_service(head, "init")["command"][1:])
                assert cmd[1:] == ["-c", str(init_args.nats_conf)], "nats must read the config init writes"
            else:
                pytest.fail(f"{name}: unknown command {cmd}")
    assert seen == {"init", "nats", *envdoc.SERVICES}, "head.yml runs every service and a worker"
    assert [_kind(s) for s in node["services"].values()] == ["worker"]


def test_redis_keeps_an_append_only_file_and_its_password_out_of_sight(head, head_init):
    redis = head["services"]["redis"]
    script = redis["command"][2]
    assert "--appendonly yes" in script and "--dir /data" in script and ("redis-data", "/data") in _mounts(redis)
    assert "ports" not in redis, "Redis holds key hashes and budgets: never publish it"
    # its password from the file init made, into a config file: not in its command line, nor its environment
    init_args = head_init.parser().parse_args(head["services"]["init"]["command"][1:])
    assert ("secrets", "/secrets") in _mounts(redis) and "cat /secrets/redis.password" in script
    assert ("secrets", str(init_args.secrets_dir)) in _mounts(head["services"]["init"])
    assert "environment" not in redis and "redis.password" in redis["healthcheck"]["test"][1]


def test_every_coderai_variable_is_read_by_its_service(head, node, compose_env, envdoc):
    for doc in (head, node):
        for name, svc in doc["services"].items():
            env = svc.get("environment") or {}
            assert isinstance(env, dict), f"{name}: environment as a mapping"
            names = {k for k in env if k.startswith("CODERAI_")}
            kind = _kind(svc) if "command" in svc else name
            assert not any(TEST_TOKEN in str(v) for v in env.values()), f"{name}: the token in its environment"
            if kind == "init":
                assert names == {"CODERAI_CLUSTER_TOKEN_FILE"} and svc["secrets"] == ["cluster_token"]
            elif kind in envdoc.SERVICES:
                unknown = names - envdoc.variables(kind)
                assert not unknown, f"{name} does not read {sorted(unknown)} (docs/env.md lists what it reads)"
                assert "CODERAI_NATS_URL" in env
                # the token only where joins happen: the worker joins with it, the scheduler answers joins; from the
                # compose secret's file, never the environment (`docker inspect` prints that)
                if kind in ("worker", "scheduler"):
                    assert env["CODERAI_CLUSTER_TOKEN_FILE"] == "/run/secrets/cluster_token"
                    assert svc["secrets"] == ["cluster_token"]
                else:
                    assert "cluster_token" not in svc.get("secrets", []), f"{name} has no use for the cluster token"
                assert not {"CODERAI_CLUSTER_TOKEN", "CODERAI_REDIS_URL"} & names, (
                    f"{name}: a secret in its environment"
                )
                if kind != "worker":
                    # its own NATS user (svc-<kind>, named by the file), never `service`'s every right
                    assert env["CODERAI_NATS_PASSWORD_FILE"] == f"{DATA_DIR}/secrets/nats-svc-{kind}.password"
                    assert env["CODERAI_NATS_CA"] == f"{DATA_DIR}/secrets/nats-ca.pem"  # NATS speaks TLS
                    assert ("secrets", f"{DATA_DIR}/secrets") in _mounts(svc)
            else:
                assert not names, f"{name} is not a coderai service"


def test_env_example_documents_exactly_what_the_files_use(env_example, helpers, envdoc):
    used = set()
    for name in FILES:
        used |= helpers.compose_variables((COMPOSE / name).read_text())
    assert used - set(env_example) == set(), "used by compose but missing from .env.example"
    assert set(env_example) - used == set(), "in .env.example but used by no compose file"
    unknown = {k for k in env_example if k.startswith("CODERAI_")} - envdoc.variables()
    assert not unknown, f"not a setting: {sorted(unknown)}"
    commented = False
    for line in (COMPOSE / ".env.example").read_text().splitlines():
        if not line.strip():
            commented = False
        elif line.startswith("#"):
            commented = True
        else:
            assert commented, f"undocumented: {line}"
    for name in ("head.yml", "node.yml"):  # the token's file: a compose secret, the .env names its path only
        doc = helpers.load_compose(name, env_example)
        assert doc["secrets"]["cluster_token"]["file"] == env_example["CLUSTER_TOKEN_FILE"]


def test_ports_match_the_settings(head, head_init, compose_env, envdoc):
    from coderai.gateway.settings import GatewaySettings
    from coderai.metrics.settings import MetricsSettings

    services = head["services"]
    for name, cls in (("gateway", GatewaySettings), ("metrics", MetricsSettings)):
        env = services[name]["environment"]
        prefix = envdoc.prefix(name)
        port = int(env.get(prefix + "PORT", _default(cls, "port")))
        [(_ip, _host_port, container_port)] = [_port(p) for p in services[name]["ports"]]
        assert container_port == port, f"{name} listens on {port}, compose publishes {container_port}"
        assert env.get(prefix + "HOST", _default(cls, "host")) == "0.0.0.0", f"{name} must listen beyond loopback"
    assert _port(services["gateway"]["ports"][0])[1] == int(compose_env["GATEWAY_PORT"])
    assert _port(services["metrics"]["ports"][0])[0] == "127.0.0.1", "metrics is published on loopback only"

    init_args = head_init.parser().parse_args(services["init"]["command"][1:])
    [(_ip, nats_host_port, nats_container_port)] = [_port(p) for p in services["nats"]["ports"]]
    assert nats_container_port == init_args.nats_port
    assert nats_host_port == int(compose_env["NATS_PORT"])

    for name, svc in services.items():
        url = (svc.get("environment") or {}).get("CODERAI_NATS_URL")
        if url is None:
            continue
        parts = urlsplit(url)
        if svc.get("network_mode") == "host":
            assert (parts.hostname, parts.port) == ("127.0.0.1", nats_host_port), name
            assert int(svc["environment"]["CODERAI_WORKER_ANNOUNCE_NATS_PORT"]) == nats_host_port
        else:
            assert (parts.hostname, parts.port) == ("nats", nats_container_port), name

    metrics_url = urlsplit(services["gateway"]["environment"]["CODERAI_GATEWAY_METRICS_URL"])
    metrics_port = _port(services["metrics"]["ports"][0])[2]
    assert (metrics_url.hostname, metrics_url.port, metrics_url.path) == ("metrics", metrics_port, "/metrics")
    for name in ("gateway", "metrics", "pod-broker"):  # the URL init writes, with the password it made
        assert services[name]["environment"]["CODERAI_REDIS_URL_FILE"] == f"{init_args.secrets_dir}/redis.url"
    assert init_args.redis == "redis:6379" and "--port" not in services["redis"]["command"][2]


def test_host_networking_for_workers_only(head, node):
    for doc in (head, node):
        for name, svc in doc["services"].items():
            if svc.get("network_mode") == "host":
                assert name == "worker" and "ports" not in svc and "networks" not in svc
    assert node["services"]["worker"]["network_mode"] == "host", "mDNS needs the host's network"
    assert head["services"]["worker"]["network_mode"] == "host", "the head's worker announces the head"


def test_volumes_are_declared_and_shared_where_they_must_be(head, node, compose_env, head_init):
    made = None  # directories every image creates for the coderai user
    for df in (ROOT / "docker").glob("Dockerfile.*"):
        if df.suffix != ".dockerignore":
            line = next(ln for ln in df.read_text().splitlines() if "mkdir -p /var/lib/coderai" in ln)
            here = {w for w in line.split() if w.startswith(DATA_DIR)} | {DATA_DIR}
            made = here if made is None else made & here
    for doc in (head, node):
        declared = set(doc.get("volumes") or {})
        used = set()
        for name, svc in doc["services"].items():
            for source, target in _mounts(svc):
                if source.startswith((".", "/")):
                    continue
                assert source in declared, f"{name} mounts undeclared volume {source}"
                used.add(source)
                if _is_coderai(svc, compose_env):
                    # a named volume starts with the ownership of the image's directory: it must exist there
                    assert target in made, f"{name}: {target} is not created (owned by coderai) in every image"
        assert used == declared, f"declared but unused: {declared - used}"

    services = head["services"]
    init_args = head_init.parser().parse_args(services["init"]["command"][1:])

    def volume_holding(svc: dict, path: str) -> tuple[str, str]:
        [(source, target)] = [(s, t) for s, t in _mounts(svc) if path == t or path.startswith(t.rstrip("/") + "/")]
        return source, target

    conf = str(init_args.nats_conf)
    assert volume_holding(services["init"], conf) == volume_holding(services["nats"], conf)
    store = init_args.store_dir
    assert volume_holding(services["init"], store) == volume_holding(services["nats"], store)
    keys_file = services["gateway"]["environment"]["CODERAI_GATEWAY_API_KEYS_FILE"]
    assert keys_file == f"{init_args.keys_dir}/keys.toml"
    assert volume_holding(services["gateway"], keys_file) == volume_holding(services["init"], keys_file)
    models = services["scheduler"]["environment"]["CODERAI_SCHEDULER_MODELS_FILE"]
    assert models in [t for _s, t in _mounts(services["scheduler"])]
    for doc in (head, node):
        assert (compose_env["MODELS_DIR"], "/models") in _mounts(doc["services"]["worker"])


def test_startup_order(head):
    services = head["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            want = "service_completed_successfully" if dep == "init" else "service_healthy"
            assert cond["condition"] == want, f"{name} -> {dep}"
    for name, svc in services.items():
        if name not in ("init", "nats", "redis"):
            assert "nats" in svc["depends_on"], f"{name} must wait for NATS"
    assert "init" in services["nats"]["depends_on"] and "init" in services["gateway"]["depends_on"]
    assert services["init"]["restart"] == "no" and services["init"]["healthcheck"] == {"disable": True}
    assert services["redis"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert "redis-cli ping" in services["redis"]["healthcheck"]["test"][1]


def test_gpu_override_fits_both_files(head, node, compose_env, helpers):
    gpu = helpers.load_compose("gpu.yml", compose_env)
    assert set(gpu["services"]) == {"worker"} and "worker" in head["services"] and "worker" in node["services"]
    [device] = gpu["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_the_example_models_file_loads():
    models = load_models(str(COMPOSE / "models.example.toml"))
    assert models and all(m.path.startswith("/models/") for m in models)


def test_coderai_images_are_never_pulled_unchecked(head, node, compose_env):
    """compose never fetches a coderai image itself: what runs was built on this machine or pulled by
    scripts/image-trust after its signature checked (PULL_POLICY in .env can say otherwise, and says so)."""
    for doc in (head, node):
        ours = [svc for svc in doc["services"].values() if _is_coderai(svc, compose_env)]
        assert ours and all(svc["pull_policy"] == "never" for svc in ours)
