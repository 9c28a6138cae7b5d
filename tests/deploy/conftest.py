"""Fixtures for the deploy files: the compose files as compose would see them, and the helper scripts."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
DOCKER = ROOT / "docker"
TEST_TOKEN = "test-token_0123456789-abcdefghij"

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def compose_variables(text: str) -> set[str]:
    """Names a compose file interpolates (`${NAME}`, `${NAME:-default}`, `${NAME:?message}`)."""
    return {m["name"] for m in _VAR.finditer(text)}


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution, enough for our files; a missing `:?` variable raises like compose does."""

    def sub(m: re.Match) -> str:
        name, op, arg = m["name"], m["op"], m["arg"] or ""
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?") and not value:
            raise KeyError(f"{name}: {arg}")
        return value or ""

    return _VAR.sub(sub, text)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a .env file (comments and blank lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def load_compose(name: str, env: dict[str, str]) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(interpolate((COMPOSE / name).read_text(), env))


def load_script(path: Path, name: str):
    """Import a helper script (docker/head_init.py, docker/healthcheck.py, scripts/envdoc.py) by path."""
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses (envdoc's Field) look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def env_example() -> dict[str, str]:
    return read_env_file(COMPOSE / ".env.example")


@pytest.fixture(scope="session")
def compose_env(env_example) -> dict[str, str]:
    """What a filled-in .env gives compose: the example as it is (the token is a file), and a token in the
    environment too, which no service may take from there."""
    return {**env_example, "CODERAI_CLUSTER_TOKEN": TEST_TOKEN}


@pytest.fixture(scope="session")
def head(compose_env) -> dict:
    return load_compose("head.yml", compose_env)


@pytest.fixture(scope="session")
def node(compose_env) -> dict:
    return load_compose("node.yml", compose_env)


@pytest.fixture(scope="session")
def head_init():
    return load_script(DOCKER / "head_init.py", "coderai_head_init")


@pytest.fixture(scope="session")
def healthcheck():
    return load_script(DOCKER / "healthcheck.py", "coderai_healthcheck")


@pytest.fixture(scope="session")
def envdoc():
    """scripts/envdoc.py: the variables every service reads, and docs/env.md rendered from the settings structs."""
    return load_script(ROOT / "scripts" / "envdoc.py", "coderai_envdoc")


@pytest.fixture(scope="session")
def helpers():
    """This module, for its functions (test modules cannot import a conftest under --import-mode=importlib)."""
    import sys

    return sys.modules[__name__]
