"""scripts/sign-images.sh signs by digest with version and commit annotations (cosign and the digest tools are
stand-ins on PATH: no registry, no network)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "sign-images.sh"


@pytest.fixture
def fake_bin(tmp_path):
    """docker without buildx and a failing skopeo (nothing reaches a registry), crane answering a digest per
    ref, cosign logging its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "docker": "#!/bin/sh\nexit 1\n",
        "skopeo": "#!/bin/sh\nexit 1\n",
        "crane": '#!/bin/sh\n[ "$1" = digest ] || exit 3\necho "sha256:$(printf %s "$2" | sha256sum | cut -c1-64)"\n',
        "cosign": (
            '#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done >> "$COSIGN_LOG"\necho --- >> "$COSIGN_LOG"\n'
        ),
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run(fake_bin: Path, tmp_path: Path, *args: str, key: str | None = "cosign.key"):
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "COSIGN_LOG": str(tmp_path / "cosign.log")}
    env.pop("COSIGN_KEY", None)
    if key is not None:
        env["COSIGN_KEY"] = key
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env, check=False)


def _calls(tmp_path: Path) -> list[list[str]]:
    text = (tmp_path / "cosign.log").read_text()
    return [block.strip("\n").split("\n") for block in text.split("---\n") if block.strip()]


def test_signs_each_image_by_digest(fake_bin, tmp_path):
    r = _run(
        fake_bin,
        tmp_path,
        "--version",
        "1.2.3",
        "--commit",
        "abc123",
        "localhost:5000/coderai-cpu:1.2.3",
        "ghcr.io/you/coderai-vllm:1.2.3",
        "ghcr.io/you/coderai-media@sha256:" + "f" * 64,
    )
    assert r.returncode == 0, r.stderr
    digest = "sha256:" + hashlib.sha256(b"localhost:5000/coderai-cpu:1.2.3").hexdigest()
    calls = _calls(tmp_path)
    assert calls[0] == [
        "sign",
        "--yes",
        "--key",
        "cosign.key",
        "-a",
        "version=1.2.3",
        "-a",
        "commit=abc123",
        f"localhost:5000/coderai-cpu@{digest}",
    ]
    assert calls[1][-1].startswith("ghcr.io/you/coderai-vllm@sha256:")
    assert calls[2][-1] == "ghcr.io/you/coderai-media@sha256:" + "f" * 64, "a digest given is used as it is"


def test_version_defaults_to_pyproject(fake_bin, tmp_path):
    r = _run(fake_bin, tmp_path, "--commit", "abc", "reg/x:1")
    assert r.returncode == 0, r.stderr
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"version={version}" in _calls(tmp_path)[0]


def test_dry_run_prints_and_signs_nothing(fake_bin, tmp_path):
    r = _run(fake_bin, tmp_path, "--dry-run", "--commit", "abc", "reg/x:1")
    assert r.returncode == 0 and r.stdout.startswith("cosign sign --yes --key cosign.key")
    assert not (tmp_path / "cosign.log").exists()


@pytest.mark.parametrize(
    ("args", "key", "says"),
    [
        (["reg/x:1"], None, "COSIGN_KEY"),
        ([], "k", "at least one"),
    ],
)
def test_refuses_without_key_or_image(fake_bin, tmp_path, args, key, says):
    r = _run(fake_bin, tmp_path, "--commit", "abc", *args, key=key)
    assert r.returncode == 2 and says in r.stderr


def test_unresolvable_image_fails(tmp_path, fake_bin):
    (fake_bin / "crane").write_text("#!/bin/sh\nexit 1\n")
    r = _run(fake_bin, tmp_path, "--commit", "abc", "reg/missing:1")
    assert r.returncode != 0 and "cannot resolve a digest" in r.stderr
    assert not (tmp_path / "cosign.log").exists()
