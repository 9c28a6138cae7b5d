"""The design's layering: libs never import services, and product code never imports the test helpers. And the
layout's size rule: no gateway module over 300 lines.

Only import statements count: naming a service's module to start it as a process (cli.py, up.py, testing/stack.py)
is how libs run services, not a dependency on their code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBS = ROOT / "libs" / "coderai"
GATEWAY = ROOT / "services" / "gateway"
GATEWAY_MAX_LINES = 300  # issue 41: a gateway module holds one responsibility; past this it is split by meaning
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
    bad = [f"{p.relative_to(LIBS)}:{line} imports {m}"
           for p in sorted(LIBS.rglob("*.py")) for line, m in _imports(p)
           if any(_under(m, f"coderai.{s}") for s in SERVICES)]
    assert not bad, "\n".join(bad)


def test_product_code_imports_no_test_helper():
    bad = [f"{p.relative_to(LIBS)}:{line} imports {m}"
           for p in sorted(LIBS.rglob("*.py")) if "testing" not in p.relative_to(LIBS).parts
           for line, m in _imports(p) if _under(m, "coderai.testing")]
    assert not bad, "\n".join(bad)


def test_gateway_modules_are_at_most_300_lines():
    over = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted(GATEWAY.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > GATEWAY_MAX_LINES]
    assert not over, f"gateway modules over {GATEWAY_MAX_LINES} lines (split them by responsibility):\n" + "\n".join(over)
