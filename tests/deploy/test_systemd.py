"""helm-free-deploy/: install.sh --no-start --skip-install into a temporary prefix writes units that run what the
prefix holds, as the right user, after NATS; systemd-analyze accepts them where it exists; uninstall.sh undoes it."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from coderai.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "helm-free-deploy"
TOKEN = "test-token_0123456789"
SERVICES = ["gateway", "router", "scheduler", "pod-broker", "metrics", "worker"]


def _install(tmp_path: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        str(DEPLOY / "install.sh"),
        "--prefix",
        str(tmp_path / "opt"),
        "--units-dir",
        str(tmp_path / "units"),
        "--no-start",
        "--skip-install",
        *args,
    ]
    env = {k: v for k, v in os.environ.items() if k != "CODERAI_CLUSTER_TOKEN"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, check=False)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def _parse(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as section -> key -> values (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = out.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert section is not None
        section.setdefault(key, []).append(value)
    return out


def _words(unit: dict, section: str, key: str) -> set[str]:
    return {w for v in unit.get(section, {}).get(key, []) for w in v.split()}


@pytest.fixture
def installed_head(tmp_path):
    models = tmp_path / "models.toml"
    models.write_text((ROOT / "compose" / "models.example.toml").read_text())
    redis = tmp_path / "bin" / "redis-server"  # a stand-in: the tests need no Redis installed
    redis.parent.mkdir()
    redis.write_text("#!/bin/sh\n")
    redis.chmod(0o755)
    r = _install(
        tmp_path,
        "--role",
        "head",
        "--token",
        TOKEN,
        "--user",
        "svc-coderai",
        "--nats-port",
        "4333",
        "--redis-server",
        str(redis),
        "--models-file",
        str(models),
    )
    return tmp_path, r


def test_head_units(installed_head):
    tmp, result = installed_head
    prefix, units_dir = tmp / "opt", tmp / "units"
    env_file = prefix / "etc" / "coderai.env"
    names = sorted(p.name for p in units_dir.iterdir())
    assert names == sorted(
        ["coderai.target", "coderai-nats.service", "coderai-redis.service", *(f"coderai-{s}.service" for s in SERVICES)]
    )
    for name in names:
        text = (units_dir / name).read_text()
        assert "@" not in text.replace("$MAINPID", ""), f"{name}: a placeholder is left"
        if name == "coderai.target":
            continue
        unit = _parse(units_dir / name)
        svc = unit["Service"]
        assert svc["User"] == ["svc-coderai"] and svc["Group"] == ["svc-coderai"], name
        assert svc["Restart"] == ["on-failure"], name
        assert unit["Install"]["WantedBy"] == ["coderai.target"] and unit["Unit"]["PartOf"] == ["coderai.target"]
        for key in ("ExecStart", "ExecStartPre"):
            for line in svc.get(key, []):
                exe = shlex.split(line)[0]
                if name == "coderai-redis.service":
                    assert exe == str(tmp / "bin" / "redis-server")
                else:
                    assert exe.startswith(f"{prefix}/venv/bin/"), f"{name}: {exe} is not the prefix's venv"
                    if key == "ExecStartPre":
                        assert shlex.split(line)[1] == f"{prefix}/lib/coderai-init"
        if name != "coderai-redis.service":
            assert svc["EnvironmentFile"] == [str(env_file)], name
        service = name.removeprefix("coderai-").removesuffix(".service")
        if service in SERVICES:
            argv = shlex.split(svc["ExecStart"][0])
            assert argv[1:] == [service] and service in COMMANDS, name
            assert "coderai-nats.service" in _words(unit, "Unit", "After"), f"{name} must start after NATS"
            assert "coderai-nats.service" in _words(unit, "Unit", "Requires"), f"{name} needs NATS"
        if service in ("gateway", "metrics"):
            assert "coderai-redis.service" in _words(unit, "Unit", "After")
    assert "--appendonly yes" in _parse(units_dir / "coderai-redis.service")["Service"]["ExecStart"][0]
    assert "--nats-port 4333" in _parse(units_dir / "coderai-nats.service")["Service"]["ExecStartPre"][0]
    assert "systemctl enable --now coderai.target" in result.stdout, "--no-start says what to run"


def test_head_env_file(installed_head, head_init, envdoc):
    tmp, _ = installed_head
    prefix = tmp / "opt"
    env_file = prefix / "etc" / "coderai.env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600, "it holds the cluster token"
    env = dict(ln.split("=", 1) for ln in env_file.read_text().splitlines() if ln and not ln.startswith("#"))
    assert env["CODERAI_CLUSTER_TOKEN"] == TOKEN
    unknown = {k for k in env if k.startswith("CODERAI_")} - envdoc.variables()
    assert not unknown, f"not a setting: {unknown}"
    assert env["CODERAI_NATS_URL"] == "nats://127.0.0.1:4333"
    assert env["CODERAI_WORKER_ANNOUNCE_NATS_PORT"] == "4333"
    assert env["CODERAI_SCHEDULER_MODELS_FILE"] == f"{prefix}/etc/models.toml"
    assert Path(env["CODERAI_SCHEDULER_MODELS_FILE"]).exists()
    assert len(env["CODERAI_SCRAPE_TOKEN"]) >= 24
    state = Path(env["CODERAI_DATA_DIR"])
    assert env["CODERAI_GATEWAY_API_KEYS_FILE"] == f"{state}/keys.toml"
    gateway = _parse(tmp / "units" / "coderai-gateway.service")["Service"]
    args = head_init.parser().parse_args(shlex.split(gateway["ExecStartPre"][0])[2:])
    assert args.keys_dir == state, "the gateway's keys file is the one coderai-init writes"
    redis = _parse(tmp / "units" / "coderai-redis.service")["Service"]["ExecStart"][0].split()
    password = env["REDIS_PASSWORD"]
    assert len(password) >= 32 and redis[redis.index("--requirepass") + 1] == "${REDIS_PASSWORD}"
    assert env["CODERAI_REDIS_URL"] == f"redis://:{password}@127.0.0.1:{redis[redis.index('--port') + 1]}/0"
    assert env["CODERAI_NATS_PASSWORD_FILE"] == f"{state}/secrets/nats-service.password"  # the operator's CLI
    for svc in ("gateway", "router", "scheduler", "pod-broker", "metrics"):  # each service its own NATS user
        var = f"CODERAI_{svc.upper().replace('-', '_')}_NATS_PASSWORD_FILE"
        assert env[var] == f"{state}/secrets/nats-svc-{svc}.password"
    assert env["CODERAI_SCHEDULER_NATS_PID_FILE"] == f"{state}/nats/nats.pid"
    assert os.access(prefix / "lib" / "coderai-init", os.X_OK)
    again = _install(tmp, "--role", "head", "--token", TOKEN, "--redis-server", str(tmp / "bin" / "redis-server"))
    assert again.returncode == 0
    env2 = dict(ln.split("=", 1) for ln in env_file.read_text().splitlines() if ln and not ln.startswith("#"))
    assert env2["CODERAI_SCRAPE_TOKEN"] == env["CODERAI_SCRAPE_TOKEN"], "a re-install keeps the scrape token"
    assert env2["REDIS_PASSWORD"] == env["REDIS_PASSWORD"], "and the Redis password"


def test_node_units(tmp_path):
    _install(tmp_path, "--role", "node", "--token", TOKEN, "--nats-url", "nats://10.0.0.5:4222")
    assert sorted(p.name for p in (tmp_path / "units").iterdir()) == ["coderai-worker.service", "coderai.target"]
    unit = _parse(tmp_path / "units" / "coderai-worker.service")
    assert "coderai-nats.service" not in _words(unit, "Unit", "After") | _words(unit, "Unit", "Requires"), (
        "a node has no local NATS"
    )
    assert "network-online.target" in _words(unit, "Unit", "After")
    assert unit["Service"]["User"] == ["coderai"]
    env = (tmp_path / "opt" / "etc" / "coderai.env").read_text()
    assert "CODERAI_NATS_URL=nats://10.0.0.5:4222" in env and "CODERAI_REDIS_URL" not in env


@pytest.mark.parametrize(
    "args",
    [
        ["--token", TOKEN],  # no role
        ["--role", "head"],  # no token
        ["--role", "node", "--token", "has space"],
        ["--role", "node", "--token", 'q"uote'],
        ["--role", "node", "--token", TOKEN, "--nats-port", "x"],
        ["--role", "node", "--token", TOKEN, "--bogus"],
    ],
)
def test_bad_arguments_are_refused(tmp_path, args):
    r = _install(tmp_path, *args, check=False)
    assert r.returncode == 2 and "install.sh:" in r.stderr
    assert not (tmp_path / "units").exists() or not any((tmp_path / "units").iterdir())


def test_token_from_a_file(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    _install(tmp_path, "--role", "node", "--token-file", str(token_file))
    assert f"CODERAI_CLUSTER_TOKEN={TOKEN}\n" in (tmp_path / "opt" / "etc" / "coderai.env").read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(installed_head):
    tmp, _ = installed_head
    prefix, units_dir = tmp / "opt", tmp / "units"
    (prefix / "venv" / "bin").mkdir(parents=True)
    for exe in ("python", "coderai", "nats-server"):  # --skip-install left no venv: stand-ins with the real paths
        path = prefix / "venv" / "bin" / exe
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    units = sorted(str(p) for p in units_dir.iterdir())
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{units_dir}:", "SYSTEMD_LOG_LEVEL": "notice"}
    r = subprocess.run(
        ["systemd-analyze", "verify", *units], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if "coderai" in ln]
    assert r.returncode == 0 and not complaints, "\n".join(complaints) or r.stderr


def test_uninstall(installed_head):
    tmp, _ = installed_head
    prefix = tmp / "opt"
    state = prefix / "var"
    (state / "keep-me").write_text("x")
    r = subprocess.run(
        [str(DEPLOY / "uninstall.sh"), "--prefix", str(prefix), "--no-stop"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    assert not any((tmp / "units").iterdir()), "every unit file is gone"
    assert not (prefix / "etc").exists() and not (prefix / "lib").exists()
    assert (state / "keep-me").exists(), "the state stays without --purge"
    _install(tmp, "--role", "node", "--token", TOKEN)
    r = subprocess.run(
        [str(DEPLOY / "uninstall.sh"), "--prefix", str(prefix), "--no-stop", "--purge"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0 and not prefix.exists()
