"""Session fixtures: an empty home for the whole suite, a real nats-server (JetStream) and redis-server on
random loopback ports, and a tiny GGUF.

The suite runs as on a new machine wherever it runs: before anything is collected, `pytest_configure` points
`HOME`, the XDG folders and the `CODERAI_*` cache and data settings at new empty folders under one temp dir,
so this process and every process a test starts (they inherit the environment) find nothing a developer's
home holds. What the suite needs is built there, or in the repo's `.venv`, during the run. The one thing kept
from outside is pip's cache (`PIP_CACHE_DIR`), which `scripts/setup` fills. `suite_home` names the folders.

A test module that leaves a process, a network namespace or a listening socket behind errors at its end, naming
what it left, which is then killed (`nothing_left_behind`, coderai.testing.leftovers): a leftover is a failure of
its own, and never fails the next test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from coderai.runtime.embedded import NatsServer
from coderai.runtime.embedded_redis import RedisServer
from coderai.testing.leftovers import Snapshot, clean, left_behind, snapshot

# settings that name a cache or a data dir: dropped, so their defaults (under the empty home) apply
_OUTSIDE_SETTINGS = (
    "CODERAI_DATA_DIR",
    "CODERAI_MODEL_CACHE",
    "CODERAI_BENCH_CACHE",
    "CODERAI_BUILD_CACHE",
    "CODERAI_CONFIG",
    "HF_HOME",
    "HF_HUB_CACHE",
    "TRANSFORMERS_CACHE",
    "TORCH_HOME",
)
_suite_root: Path | None = None


def pytest_configure(config):
    global _suite_root
    if _suite_root is not None:
        return
    # an xdist worker inherits the controller's environment, whose HOME is the controller's own new home: the home
    # from outside is the one the controller was started with
    real_home = Path(os.environ.get("CODERAI_TEST_OUTSIDE_HOME") or os.path.expanduser("~"))
    pip_cache = os.environ.get("PIP_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or real_home / ".cache") / "pip"
    )
    _suite_root = Path(tempfile.mkdtemp(prefix="coderai-suite-"))
    home = _suite_root / "home"
    for name in _OUTSIDE_SETTINGS:
        os.environ.pop(name, None)
    os.environ.update(
        {
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "PIP_CACHE_DIR": pip_cache,
            "CODERAI_TEST_OUTSIDE_HOME": str(real_home),  # only for the test that proves the isolation
            "CODERAI_TEST_NETNS_DIR": str(_suite_root / "netns"),  # the namespaces labs make (coderai.testing.netns)
        }
    )
    for sub in (".cache", ".local/share", ".config", ".local/state"):
        (home / sub).mkdir(parents=True, exist_ok=True)


def pytest_unconfigure(config):
    if _suite_root is not None and not os.environ.get("CODERAI_TEST_KEEP_HOME"):
        shutil.rmtree(_suite_root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def suite_home() -> Path:
    """The suite's own empty home (see the module docstring); every test runs with it as `HOME`."""
    home = Path(os.environ["HOME"])
    assert _suite_root is not None and home.is_relative_to(_suite_root), "the suite must run in its own home"
    return home


_outliving = Snapshot()  # what session-scoped fixtures started: it outlives the module that first asked for it


@contextlib.contextmanager
def outliving_modules():
    """Around the start of what a session-scoped fixture runs (the session's nats-server and redis-server): what
    it starts outlives the module that happened to ask for it first, whose check must not count it as left
    behind. (Not a `pytest_fixture_setup` hook: pytest calls that hook for a session-scoped fixture through the
    session's plugins, which do not include this conftest, so it never saw them, and a module whose first tests
    ran before a later one asked for the session's NATS had it killed as its leftover.)"""
    global _outliving
    before = snapshot()
    try:
        yield
    finally:
        _outliving = _outliving.plus(snapshot().minus(before))


@pytest.fixture(scope="module", autouse=True)
def nothing_left_behind(request):
    """Fail a module that leaves a process, a network namespace or a listening socket behind once its own
    fixtures are torn down (an error at the teardown of its last test, naming each), and kill what it left, so
    the next module starts clean. Autouse and module-scoped, it is set up before the module's other fixtures
    and torn down after them."""
    before = snapshot()
    yield
    left = left_behind(before, _outliving)
    if left:
        clean(left)
        pytest.fail(f"{request.node.nodeid} left behind:\n{left.describe()}", pytrace=False)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    with outliving_modules():
        server = NatsServer(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server):
    """A bus connection on the session's nats-server."""
    from coderai.runtime.bus import Bus

    b = await Bus.connect(nats_server.url, "test")
    yield b
    await b.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with outliving_modules():
        server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    pytest.importorskip("gguf")
    from coderai.tiny_models.llm import build_tiny_gguf

    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    build_tiny_gguf(path)
    return path


@pytest.fixture(scope="session")
def tool_gguf() -> Path:
    """The overfitted tiny GGUF that calls `get_weather` by itself (coderai.testing.tool_gguf; ~1 min to train)."""
    for mod in ("gguf", "torch", "transformers", "llama_cpp"):
        pytest.importorskip(mod)
    from coderai.testing.tool_gguf import tool_gguf as build

    return build()


@pytest.fixture
def unique() -> str:
    """A token for per-test subjects and buckets."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def artifacts(request) -> Path:
    """A folder kept after the run for what a test saves for people to look at (screenshots):
    `$CODERAI_TEST_ARTIFACTS/<test>`, by default `test-artifacts/<test>` in the repository (git ignores it)."""
    import os
    import re

    root = Path(os.environ.get("CODERAI_TEST_ARTIFACTS") or Path(__file__).resolve().parent.parent / "test-artifacts")
    path = root / re.sub(r"[^\w.-]+", "_", request.node.name)
    path.mkdir(parents=True, exist_ok=True)
    return path


_spent = {"slow": 0.0, "fast": 0.0}


def pytest_runtest_logreport(report):
    _spent["slow" if "slow" in report.keywords else "fast"] += report.duration


def pytest_terminal_summary(terminalreporter):
    """The split CI's time is reported in: fast tests, slow tests (set-up, call and tear-down of each)."""
    terminalreporter.write_line(f"time in tests: fast {_spent['fast']:.0f} s, slow {_spent['slow']:.0f} s")
