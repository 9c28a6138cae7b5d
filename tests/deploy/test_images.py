"""docker/: every Dockerfile is multi-stage, runs as a non-root user, has the health check, installs real extras
with the right torch, and sends a small build context; scripts/images knows every flavor compose can ask for."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile.*") if p.suffix != ".dockerignore")
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if buf.strip():
                word, _, rest = buf.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def _extras_in(text: str) -> set[str]:
    return {e for part in re.findall(r"EXTRAS=([\w,-]+)", text) for e in part.split(",")} | {
        e for part in re.findall(r"/src\[([\w,-]+)", text) for e in part.split(",")
    }


def test_there_is_a_dockerfile_per_family():
    names = {p.name for p in DOCKERFILES}
    assert names == {"Dockerfile.cpu", "Dockerfile.llama-cuda", "Dockerfile.media", "Dockerfile.vllm"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_shape(dockerfile: Path, envdoc):
    ins = _instructions(dockerfile)
    froms = [rest for word, rest in ins if word == "FROM"]
    assert len(froms) >= 2 and " AS build" in froms[0], "multi-stage: build tools stay in the build stage"
    final = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM") :]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "the final stage runs as a non-root user"
    assert any(w == "RUN" and "useradd" in r and "--uid 10001" in r for w, r in final)
    [health] = [rest for word, rest in final if word == "HEALTHCHECK"]
    assert health.endswith('CMD ["coderai-healthcheck"]')
    assert [rest for word, rest in final if word == "CMD"][-1] == '["coderai", "worker"]', "a bare run is a worker"
    copies = " ".join(rest for word, rest in final if word == "COPY")
    assert "docker/healthcheck.py /opt/coderai/bin/coderai-healthcheck" in copies
    assert "docker/head_init.py /opt/coderai/bin/coderai-init" in copies
    assert "--from=build /opt/coderai/venv /opt/coderai/venv" in copies
    env = " ".join(rest for word, rest in final if word == "ENV")
    assert "/opt/coderai/venv/bin" in env and "/opt/coderai/bin" in env
    unknown = set(re.findall(r"\b(CODERAI_[A-Z_]+)=", env)) - envdoc.variables()
    assert not unknown, f"not a setting: {unknown}"
    text = dockerfile.read_text()
    assert _extras_in(text) <= EXTRAS, f"unknown extras {_extras_in(text) - EXTRAS}"
    assert re.search(r'pip install "/src\[', text), "installs the project from the build context"


def test_torch_comes_from_the_index_the_image_needs():
    media = (DOCKER / "Dockerfile.media").read_text()
    assert re.search(r"ARG TORCH_INDEX=https://download.pytorch.org/whl/cu\d+", media), "GPU images: CUDA torch"
    assert media.index("torch==${TORCH_VERSION}") < media.index('pip install "/src['), "torch before the extras"
    cpu = (DOCKER / "Dockerfile.cpu").read_text()
    assert "torch" not in cpu and "-DGGML_NATIVE=OFF" in cpu
    assert "-DGGML_CUDA=ON" in (DOCKER / "Dockerfile.llama-cuda").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_is_small(dockerfile: Path):
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    rules = [ln.strip() for ln in ignore if ln.strip() and not ln.startswith("#")]
    assert rules[0] == "**", "exclude everything, then allow what the image needs"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    copied = set()
    for word, rest in _instructions(dockerfile):
        if word == "COPY" and "--from=" not in rest:
            copied |= {p.rstrip("/") for p in shlex.split(rest)[:-1] if not p.startswith("--") and p != "./"}
    assert copied <= allowed, f"copied but not in the context: {copied - allowed}"


def _flavors() -> list[str]:
    out = subprocess.run(
        [str(ROOT / "scripts" / "images"), "--dry-run", "--prefix", "reg.example/coderai", "--tag", "9.9"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return out.splitlines()


def test_the_images_script_knows_every_flavor_compose_asks_for(env_example):
    lines = _flavors()
    flavors = {}
    for line in lines:
        argv = shlex.split(line)
        if argv[:2] == ["env", "DOCKER_BUILDKIT=1"]:  # no buildx on this machine: the daemon's BuildKit
            argv = ["docker", "buildx", *argv[3:]]
        assert argv[:3] == ["docker", "buildx", "build"] and argv[-1] == str(ROOT), "context: the repository root"
        tag = argv[argv.index("-t") + 1]
        assert tag.startswith("reg.example/coderai-") and tag.endswith(":9.9")
        dockerfile = Path(argv[argv.index("-f") + 1])
        assert dockerfile.exists()
        args = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")
        assert set(args.get("EXTRAS", "").split(",")) - {""} <= EXTRAS
        flavors[tag.removeprefix("reg.example/coderai-").removesuffix(":9.9")] = args
    assert flavors["media-cpu"]["TORCH_INDEX"].endswith("/whl/cpu")
    assert "TORCH_INDEX" not in flavors["media"], "the default (CUDA) index"
    assert env_example["WORKER_FLAVOR"] in flavors
    comment = next(
        ln
        for ln in (ROOT / "compose" / ".env.example").read_text().splitlines()
        if ln.startswith("# The worker's image:")
    )
    named = set(re.split(r",\s*|\s+or\s+", comment.split(":", 1)[1].split("(")[0].strip()))
    assert named == set(flavors), "the .env.example comment lists the flavors scripts/images builds"


@pytest.mark.parametrize("name", ["Dockerfile.llama-cuda", "Dockerfile.vllm"])
def test_a_pod_image_can_fetch_weights_by_source(name):
    """A rented pod fetches its model's weights with the catalogue's pull (docs/pods.md): huggingface_hub is in."""
    assert "catalog" in _extras_in((DOCKER / name).read_text())


def _dry_run(*args: str, env: dict[str, str] | None = None) -> tuple[list[list[str]], str]:
    """scripts/images --dry-run: (the build command lines, what it would run before them)."""
    res = subprocess.run(
        [str(ROOT / "scripts" / "images"), "--dry-run", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
    )
    return [shlex.split(line) for line in res.stdout.splitlines()], res.stderr


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.media", "Dockerfile.vllm"])
def test_an_image_installs_from_a_staged_wheelhouse_with_no_index(name):
    """What scripts/images stages in docker/local is installed with pip's --no-index, dependencies before the
    source (a code change reuses their layer); without it, the index."""
    text = (DOCKER / name).read_text()
    assert "COPY docker/local /local" in text
    deps = text.index("pip install -q --no-index /local/wheels/*.whl")
    assert deps < text.index("COPY libs libs")
    assert 'pip install -q --no-index --find-links /local/wheels --no-build-isolation "/src[${EXTRAS}]"' in text
    ignore = Path(f"{DOCKER / name}.dockerignore").read_text().splitlines()
    assert "docker/local/cache/" in ignore, "every flavor's cached wheelhouse stays out of the build context"


def test_llama_server_is_copied_or_built_once_for_every_cpu_llama_image():
    """coderai-cpu and the media flavors get llama.cpp's llama-server from one script (the staged binary, else one
    portable build), before the source; none compiles llama-cpp-python (the in-process engine, an optional extra)."""
    for name in ("Dockerfile.cpu", "Dockerfile.media"):
        text = (DOCKER / name).read_text()
        run = text.index('RUN sh /opt/coderai/llama_server.sh "${CMAKE_ARGS}"')
        assert run < text.index("COPY libs libs"), "a change to coderai's code does not rebuild llama-server"
        assert "-DGGML_NATIVE=OFF" in text and "llama-python" not in _extras_in(text)
    script = (DOCKER / "llama_server.sh").read_text()
    assert "/local/bin/llama-server" in script and "--target llama-server ggml-rpc-server" in script
    builds, _ = _dry_run("--prefix", "p", "--tag", "t", "media", "media-cpu", "diffusers", "whisper")
    for argv in builds:
        extras = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")["EXTRAS"]
        assert "llama-python" not in extras.split(","), argv


def test_every_flavor_but_llama_cuda_stages_its_wheels_in_its_own_base(tmp_path):
    """The wheelhouse is resolved by pip inside the image's base (its Python's markers), with the build's own
    extras, one per flavor; media-cpu's torch is the CPU build (a local +cpu wheel where PIP_FIND_LINKS has one,
    else the CPU index), never CUDA's."""
    import os

    links = tmp_path / "wheels"
    links.mkdir()
    env = {**os.environ, "PIP_FIND_LINKS": str(links)}
    builds, staged = _dry_run("--base", "debian", "--prefix", "p", "--tag", "t", env=env)
    steps = [shlex.split(line) for line in staged.splitlines() if line.startswith("docker run ")]
    by_flavor = {}
    for argv in steps:
        script = argv[-1]
        flavor = re.search(r"-w /out/cache/([\w-]+)\.tmp", script).group(1)
        by_flavor[flavor] = (argv[argv.index("--entrypoint") + 2], script)
    built = {}
    for argv in builds:
        args = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--build-arg")
        built[argv[argv.index("-t") + 1].removeprefix("p-").removesuffix(":t")] = args
    assert set(by_flavor) == set(built) - {"llama-cuda"}
    for flavor, (base, script) in by_flavor.items():
        assert built[flavor]["BASE_IMAGE"] == base, "resolved in the base the image is built on"
        assert f"[{built[flavor]['EXTRAS']}]" in script
        assert base == "coderai-base:bookworm", flavor
    assert "/whl/cpu" in by_flavor["media-cpu"][1] and "/whl/cu" not in by_flavor["media-cpu"][1]
    assert "/whl/cu128" in by_flavor["media"][1]
    assert "debootstrap" in staged
    (links / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    _, staged = _dry_run("--base", "debian", "--prefix", "p", "--tag", "t", "media-cpu", env=env)
    [script] = [shlex.split(line)[-1] for line in staged.splitlines() if line.startswith("docker run ")]
    assert "torch==2.13.0" in script and "--extra-index-url" not in script, "the local CPU wheel, no index"
    assert f"-v {links}:{links}:ro" in staged and f"PIP_FIND_LINKS={links}" in staged
