"""The suite runs as on a new machine: what a developer's real home holds is never seen by it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def planted():
    """Files planted where the code would look in the real home: the bench's cache (a LiteLLM venv) and the
    built-model cache. Removed afterwards."""
    outside = Path(os.environ["CODERAI_TEST_OUTSIDE_HOME"])
    tag = uuid.uuid4().hex[:8]
    paths = [
        outside / ".cache" / "coderai-bench" / f"planted-{tag}",
        outside / ".cache" / "coderai" / "models" / f"planted-{tag}-1",
    ]
    made = []
    for path in paths:
        try:
            path.mkdir(parents=True)
        except OSError:
            continue  # a read-only home cannot leak into the suite either
        (path / "marker").write_text("from outside the suite\n")
        made.append(path)
    yield tag
    for path in made:
        (path / "marker").unlink(missing_ok=True)
        path.rmdir()


def test_the_suite_home_is_empty_and_its_own(suite_home):
    outside = Path(os.environ["CODERAI_TEST_OUTSIDE_HOME"])
    assert suite_home != outside and not suite_home.is_relative_to(outside)
    assert Path.home() == suite_home
    for var in ("XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME"):
        assert Path(os.environ[var]).is_relative_to(suite_home)
    assert "CODERAI_DATA_DIR" not in os.environ and "CODERAI_MODEL_CACHE" not in os.environ


def test_a_file_planted_in_the_real_caches_is_not_seen(planted, suite_home):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import _setup
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from coderai.tiny_models.cache import cache_root

    bench_cache = _setup.cache_dir()
    assert bench_cache.is_relative_to(suite_home)
    assert not (bench_cache / f"planted-{planted}").exists()
    assert cache_root().is_relative_to(suite_home)
    assert not list(cache_root().glob(f"planted-{planted}-*"))
    # the bench's smoke mode finds no LiteLLM venv from outside and says why
    assert isinstance(_setup.litellm_bin(install=False), str)


def test_processes_the_suite_starts_get_the_empty_home(planted, suite_home):
    code = (
        "import os, pathlib; from coderai.tiny_models.cache import cache_root; "
        "print(pathlib.Path.home()); print(cache_root()); "
        f"print(sorted(p.name for p in cache_root().iterdir() if '{planted}' in p.name))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert Path(out[0]) == suite_home
    assert Path(out[1]).is_relative_to(suite_home)
    assert out[2] == "[]"
