"""pyright (basic mode) over libs/ and services/, as the installed package lays them out.

pyproject.toml maps `coderai.gateway` to `services/gateway` and so on ([tool.setuptools] package-dir). A static
checker cannot follow that map (the editable install resolves it with an import hook), so this script builds the
package as Python sees it: `build/typecheck/coderai/` holds one link per entry of `libs/coderai/` and one per
mapped service package, and pyright checks that tree. Diagnostics are printed with the real paths.

    .venv/bin/python scripts/typecheck.py            # what scripts/test runs; exit 1 on any error
    .venv/bin/python scripts/typecheck.py --outputjson
    .venv/bin/python scripts/typecheck.py services/gateway/openai libs/coderai/stack/main.py   # those alone
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def package_dirs() -> dict[str, Path]:
    """The top-level remaps of pyproject's package-dir: the package's own dir and each service under it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    # a remapped package inside another remapped one (coderai.engine_worker.engines) comes with its parent's link
    return {
        n: p
        for n, p in dirs.items()
        if not any(n.startswith(o + ".") and p.is_relative_to(q) for o, q in dirs.items() if o != n)
    }


def build_tree() -> dict[Path, Path]:
    """Links every module to build/typecheck/coderai/...; returns {link prefix: real prefix} for the output.

    One link per file in real directories (pyright does not descend into a linked directory). The tree is brought
    up to date in place, so two runs at once see the same tree."""
    prefixes: dict[Path, Path] = {}
    for name, path in package_dirs().items():
        into = TREE.joinpath(*name.split("."))
        for source in path.rglob("*.py"):
            if "__pycache__" not in source.parts:
                link = into / source.relative_to(path)
                link.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    link.symlink_to(source)
        prefixes[into] = path
    for link in TREE.rglob("*.py"):
        if not link.exists():  # its module was moved or deleted
            link.unlink(missing_ok=True)
    config = {
        "include": ["coderai"],
        "exclude": ["**/__pycache__"],
        "typeCheckingMode": "basic",
        "pythonVersion": "3.11",
        "venvPath": str(ROOT),
        "venv": ".venv",
        "extraPaths": [str(TREE)],
    }
    staged = TREE / f"pyrightconfig.{os.getpid()}"
    staged.write_text(json.dumps(config, indent=1))
    staged.replace(TREE / "pyrightconfig.json")
    return prefixes


def main(argv: list[str]) -> int:
    prefixes = build_tree()
    # a path of the sources given (services/gateway/openai) is checked alone, through its link in the tree
    for i, arg in enumerate(argv):
        real = (ROOT / arg).resolve()
        for link, prefix in prefixes.items():
            if not arg.startswith("-") and real.exists() and real.is_relative_to(prefix):
                argv[i] = str(link / real.relative_to(prefix))
    pyright = shutil.which("pyright", path=str(Path(sys.executable).parent)) or "pyright"
    done = subprocess.run([pyright, "-p", str(TREE / "pyrightconfig.json"), *argv], capture_output=True, text=True)
    out = done.stdout
    # longest link first, so a service's link wins over the package's own
    for link, real in sorted(prefixes.items(), key=lambda kv: -len(str(kv[0]))):
        out = out.replace(str(link) + "/", os.path.relpath(real, ROOT) + "/")
    sys.stdout.write(out)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
