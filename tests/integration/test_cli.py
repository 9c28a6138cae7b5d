"""Every service runs as `python -m coderai.<service> --help` and as `coderai <command> --help`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coderai import __version__

MODULES = ["gateway", "router", "scheduler", "pod_broker", "metrics", "engine_worker"]


@pytest.mark.parametrize("module", MODULES)
def test_python_m_service_help(module):
    r = subprocess.run(
        [sys.executable, "-m", f"coderai.{module}", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "--nats-url" in r.stdout and "usage:" in r.stdout


def test_coderai_command_lists_every_command():
    r = subprocess.run([sys.executable, "-m", "coderai.cli", "--help"], capture_output=True, text=True, timeout=30)
    for cmd in ("up", "gateway", "router", "scheduler", "pod-broker", "metrics", "worker", "version"):
        assert f"  {cmd} " in r.stdout


def test_coderai_version():
    r = subprocess.run([sys.executable, "-m", "coderai.cli", "version"], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == f"coderai {__version__}"


def test_unknown_command_fails_with_usage():
    r = subprocess.run([sys.executable, "-m", "coderai.cli", "nope"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_a_bad_setting_fails_fast_naming_the_variable():
    import os

    env = {**os.environ, "CODERAI_ROUTER_ENGINE_TTL_S": "soon"}
    r = subprocess.run([sys.executable, "-m", "coderai.router"], capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 2 and "CODERAI_ROUTER_ENGINE_TTL_S" in r.stderr


def test_gateway_refuses_no_auth_off_loopback():
    r = subprocess.run(
        [sys.executable, "-m", "coderai.gateway", "--no-auth", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "loopback" in r.stderr


def test_gateway_refuses_to_start_without_keys_or_no_auth():
    r = subprocess.run(
        [sys.executable, "-m", "coderai.gateway"],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in __import__("os").environ.items() if not k.startswith("CODERAI_")},
    )
    assert r.returncode == 2 and "CODERAI_GATEWAY_API_KEYS_FILE" in r.stderr
