"""Every package in the tree is listed in pyproject.toml, so `pip install .` (not only `-e .`) ships it."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = set()
    for name, rel in dirs.items():
        base = ROOT / rel
        for init in base.rglob("__init__.py"):
            sub = init.parent.relative_to(base).parts
            found.add(".".join((name, *sub)))
    # a sub-folder mapped by its own package-dir entry is found twice under one name: fine
    assert found <= listed, sorted(found - listed)
    assert "coderai.gateway" in found
