"""`contracts/families.py:FAMILIES` is the one table about engine families: every other table about them is a view
of it, and a family added from outside (`CODERAI_FAMILIES`) that is not a well-formed declaration stops the process
saying why (tests/integration/test_added_family.py adds one end to end)."""

from __future__ import annotations

import os
import subprocess
import sys
import typing

from coderai.catalog.entries import KIND
from coderai.contracts.families import (
    CPU_FAMILIES,
    CPU_UNLESS_ASKED,
    DEFAULT_OPS,
    FAMILIES,
    GGUF_FAMILIES,
    BuiltinFamily,
    EngineFamily,
)
from coderai.contracts.ops import OPS
from coderai.engine_params import EXEC_PARAMS, FAMILY_PARAMS
from coderai.engine_worker.engines import EXPLICIT_ONLY
from coderai.engine_worker.engines import FAMILIES as RUNNERS


def test_the_tables_about_families_are_views_of_it():
    assert set(FAMILIES) == set(typing.get_args(BuiltinFamily)) == set(typing.get_args(EngineFamily))
    assert set(DEFAULT_OPS) == set(FAMILY_PARAMS) == set(RUNNERS) == set(FAMILIES)
    for name, spec in FAMILIES.items():
        assert spec.name == name and spec.ops and set(spec.ops) <= set(OPS)
        assert RUNNERS[name] == (spec.needs, spec.runner) and FAMILY_PARAMS[name] is spec.params
        assert (name in GGUF_FAMILIES) == spec.gguf and (name in EXPLICIT_ONLY) == spec.test_only
        assert (name in CPU_FAMILIES) == (spec.device == "cpu")
        assert (name in CPU_UNLESS_ASKED) == (spec.device == "cpu_unless_asked")
        assert KIND.get(name, spec.ops[0]) == spec.ops[0]
    assert GGUF_FAMILIES == {"llama", "llama-server"} and EXPLICIT_ONLY == {"echo"}


def test_only_families_that_start_a_program_take_params_that_choose_it():
    """EXEC params (a program, its environment, its arguments, remote code) are for the families that run a child
    server; a family that runs in the worker's own process has no use for them."""
    takers = {name for name, spec in FAMILIES.items() if EXEC_PARAMS & set(spec.params)}
    assert takers == {"llama-server", "vllm", "sglang", "mlx"}


def _import_with(plugins: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CODERAI_FAMILIES": plugins, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-c", "import coderai.contracts"], env=env, capture_output=True, text=True, timeout=60
    )


def test_a_module_that_declares_no_family_or_an_existing_one_is_refused_by_name(tmp_path):
    (tmp_path / "nothing_here.py").write_text("X = 1\n")
    (tmp_path / "again_llama.py").write_text(
        "from coderai.contracts.families import FamilySpec\n"
        "FAMILY = FamilySpec('llama', 'again_llama:E', '', ('chat',), params={})\n"
    )
    missing = _import_with("nothing_here", tmp_path)
    assert missing.returncode != 0 and "nothing_here (named in CODERAI_FAMILIES) declares no FAMILY" in missing.stderr
    taken = _import_with("again_llama", tmp_path)
    assert taken.returncode != 0 and "declares family 'llama', which exists" in taken.stderr
