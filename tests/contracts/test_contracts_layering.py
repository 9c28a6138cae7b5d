"""The contracts import each other in one direction, at module top only, and every literal set that a table of
the contracts keys agrees with its `Literal`. Reads the sources with `ast` (the graph) and the modules (the sets)."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

from coderai.contracts.jobs import EngineOp, Op
from coderai.contracts.families import DEFAULT_OPS, FAMILIES, GGUF_FAMILIES, EngineFamily
from coderai.contracts.ops import LLM_OPS, OPS
from coderai.contracts.pods import LIVE_POD, PodState
from coderai.contracts.stages import NEEDS, StageKind
from coderai.contracts.training import TERMINAL, JobStatus

PACKAGE = "coderai.contracts"
DIR = Path(__file__).resolve().parents[2] / "libs" / "coderai" / "contracts"
MODULES = sorted(p.stem for p in DIR.glob("*.py"))  # "__init__" is the package itself


def _target(name: str) -> str | None:
    """The contracts module a dotted import name lands in: `__init__` for the package, None outside it."""
    if name == PACKAGE:
        return "__init__"
    if name.startswith(PACKAGE + "."):
        return name[len(PACKAGE) + 1 :].split(".", 1)[0]
    return None


def _imports(module: str) -> list[tuple[str, bool]]:
    """(contracts module imported, inside a function) for every import statement of `module`."""
    tree = ast.parse((DIR / f"{module}.py").read_text(encoding="utf-8"))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((t, inner) for a in child.names if (t := _target(a.name)) is not None)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: from the package this module is in
                    base = PACKAGE.rsplit(".", child.level - 1)[0] if child.level > 1 else PACKAGE
                    name = f"{base}.{child.module}" if child.module else base
                else:
                    name = child.module or ""
                target = _target(name)
                if target == "__init__":  # `from coderai.contracts import x`: the submodule x, or a name of the package
                    found.extend((a.name if a.name in MODULES else "__init__", inner) for a in child.names)
                elif target is not None:
                    found.append((target, inner))
            visit(child, inner)

    visit(tree, False)
    return found


def _graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in _imports(m) if t != m} for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := dfs(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := dfs(m)):
            return found
    return None


def test_the_graph_finds_the_imports():
    graph = _graph()
    assert len(MODULES) > 15 and {"jobs", "models", "work"} <= graph["__init__"]
    assert {"admin", "ops", "work", "jobs"} <= graph["subjects"] and "base" in graph["jobs"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_contracts_import_each_other_in_one_direction():
    cycle = _cycle(_graph())
    assert cycle is None, "contracts import cycle: " + " -> ".join(cycle or ())


def test_no_contracts_module_is_imported_inside_a_function():
    late = [(m, t) for m in MODULES for t, inner in _imports(m) if inner]
    assert late == [], f"function-level imports of contracts modules (module, imported): {late}"


def _args(literal: object) -> set[str]:
    return set(typing.get_args(literal))


def test_every_op_of_the_table_is_its_literal():
    assert set(OPS) == _args(EngineOp)
    assert _args(Op) == _args(EngineOp) | {"train"}  # `train`: a fine-tuning job's op, answered by no engine


def test_every_engine_family_serves_ops_by_default():
    assert set(FAMILIES) == set(DEFAULT_OPS) == _args(EngineFamily)
    assert all(LLM_OPS <= set(DEFAULT_OPS[f]) for f in GGUF_FAMILIES)  # a GGUF family is a language model's


def test_each_stage_kind_has_its_needs():
    assert set(NEEDS) == _args(StageKind)


def test_subsets_of_states_are_states():
    assert LIVE_POD < _args(PodState)
    assert TERMINAL < _args(JobStatus)
