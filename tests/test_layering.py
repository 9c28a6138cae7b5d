"""The design's layering: libs never import services, and product code never imports the test helpers. And the
layout's size rule: no gateway module over 300 lines. And `coderai up` as an app (`coderai.stack`): modules of at
most 300 lines, a `main` that reads as its steps, and no import back from the heads or the CLI into it.

Only import statements count: naming a service's module to start it as a process (cli.py, stack/children.py,
testing/stack.py) is how libs run services, not a dependency on their code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBS = ROOT / "libs" / "coderai"
GATEWAY = ROOT / "services" / "gateway"
GATEWAY_MAX_LINES = 300  # issue 41: a gateway module holds one responsibility; past this it is split by meaning
STACK = LIBS / "stack"
STACK_MAX_LINES = 300  # issue 41: `coderai up` is split by responsibility (plan, servers, children, ...)
STACK_MAIN_MAX_LINES = 80  # `main` reads as the sequence of those steps
SERVICES = ("gateway", "router", "scheduler", "pod_broker", "metrics", "engine_worker")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_libs_import_no_service():
    bad = [
        f"{p.relative_to(LIBS)}:{line} imports {m}"
        for p in sorted(LIBS.rglob("*.py"))
        for line, m in _imports(p)
        if any(_under(m, f"coderai.{s}") for s in SERVICES)
    ]
    assert not bad, "\n".join(bad)


def test_product_code_imports_no_test_helper():
    bad = [
        f"{p.relative_to(LIBS)}:{line} imports {m}"
        for p in sorted(LIBS.rglob("*.py"))
        if "testing" not in p.relative_to(LIBS).parts
        for line, m in _imports(p)
        if _under(m, "coderai.testing")
    ]
    assert not bad, "\n".join(bad)


def test_gateway_modules_are_at_most_300_lines():
    over = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted(GATEWAY.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > GATEWAY_MAX_LINES
    ]
    assert not over, f"gateway modules over {GATEWAY_MAX_LINES} lines (split them by responsibility):\n" + "\n".join(
        over
    )


def test_stack_modules_are_at_most_300_lines():
    over = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted(STACK.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > STACK_MAX_LINES
    ]
    assert not over, f"coderai.stack modules over {STACK_MAX_LINES} lines (split by responsibility):\n" + "\n".join(
        over
    )


def test_stack_main_is_a_page():
    tree = ast.parse((STACK / "main.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    lines = main.end_lineno - main.lineno + 1
    assert lines <= STACK_MAIN_MAX_LINES, f"coderai.stack.main.main is {lines} lines: move a step into its module"


def _function_level_imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for fn in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    out += [(node.lineno, a.name) for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    out.append((node.lineno, node.module))
    return out


def test_no_import_circle_between_up_and_the_heads():
    """heads.py and nodes_cli.py import `coderai up`'s helpers at the top, never inside a function (the circle issue
    41 removed), and nothing in `coderai.stack` imports the compatibility modules `coderai.up` or `coderai.heads`
    back."""
    up = ("coderai.up", "coderai.stack")
    bad = [
        f"{name}:{line} imports {m} inside a function"
        for name in ("heads.py", "nodes_cli.py")
        for line, m in _function_level_imports(LIBS / name)
        if any(_under(m, u) for u in up)
    ]
    bad += [
        f"{p.relative_to(LIBS)}:{line} imports {m}"
        for p in sorted(STACK.rglob("*.py"))
        for line, m in _imports_with_names(p)
        if any(_under(m, b) for b in ("coderai.up", "coderai.heads"))
    ]
    assert not bad, "\n".join(bad)


def _imports_with_names(path: Path) -> list[tuple[int, str]]:
    """Every module `path` imports, a `from a import b` counted as both `a` and `a.b` (`b` may be a module)."""
    out = _imports(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out
