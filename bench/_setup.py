"""What the overhead bench needs besides coderai: wrk, llama-cpp-python's server extra, a LiteLLM venv.

Each `ensure_*` returns a path or True when the tool is ready, or a reason string saying why it is not (and
installs it first when `install` is true). Nothing here is needed by coderai itself.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """Where the bench keeps the baselines it installs (`$CODERAI_BENCH_CACHE`, default
    `$XDG_CACHE_HOME/coderai-bench`), read when asked, so a changed environment is seen."""
    if os.environ.get("CODERAI_BENCH_CACHE"):
        return Path(os.environ["CODERAI_BENCH_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coderai-bench"


SERVER_MODULES = ("fastapi", "uvicorn", "sse_starlette", "pydantic_settings", "starlette_context")


def _run(cmd: list[str], what: str) -> str | None:
    """Run an install step, its output to the terminal's stderr; an error message or None."""
    print(f"[bench] {what}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
    return None if r.returncode == 0 else f"{what} failed (exit {r.returncode})"


def ensure_wrk(install: bool) -> str | None:
    """Debian's `wrk`: its path, or None (with a note on stderr) when it is absent and cannot be installed."""
    found = shutil.which("wrk")
    if found or not install:
        return found
    if os.geteuid() != 0:
        print("[bench] wrk is missing; install it with: sudo apt-get install -y wrk", file=sys.stderr)
        return None
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "install", "-y", "-qq", "wrk"],
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "wrk"],
    ):
        print(f"[bench] {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
        if shutil.which("wrk"):
            break
    return shutil.which("wrk")


def llama_server_ready(install: bool) -> bool | str:
    """`python -m llama_cpp.server` can start in this interpreter (installs the `server` extra's deps if asked).

    The extra is installed pinned to the llama-cpp-python already here, so pip never rebuilds llama.cpp.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'coderai[llama]')"
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return True
    if not install:
        return f"llama_cpp.server needs {', '.join(missing)} (pip install 'coderai[bench]')"
    version = importlib.metadata.version("llama_cpp_python")
    err = _run(
        [sys.executable, "-m", "pip", "install", "-q", f"llama-cpp-python[server]=={version}"],
        "installing llama-cpp-python's server extra",
    )
    importlib.invalidate_caches()
    return err or True


def litellm_bin(install: bool, cache: Path | None = None) -> Path | str:
    """The `litellm` proxy command from its own venv under the cache dir, or why there is none."""
    cache = cache or cache_dir()
    venv = cache / "litellm-venv"
    exe = venv / "bin" / "litellm"
    if exe.exists():
        return exe
    if not install:
        return f"no LiteLLM venv at {venv} (run the full bench once to install it)"
    cache.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    err = _run([base, "-m", "venv", str(venv)], "creating the LiteLLM venv") or _run(
        [str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"], "installing litellm[proxy]"
    )
    if err:
        return err
    return exe if exe.exists() else f"litellm[proxy] installed but {exe} is missing"


ROUTERS = {"sglang-router": "sglang-router", "vllm-router": "vllm-router"}  # command -> PyPI package


def rust_routers(install: bool, cache: Path | None = None) -> dict[str, Path] | str:
    """The `sglang-router` and `vllm-router` commands (the Rust routers people put in front of llama.cpp or vLLM
    replicas) from their own venv under the cache dir, or why there are none."""
    venv = (cache or cache_dir()) / "routers-venv"
    exes = {name: venv / "bin" / name for name in ROUTERS}
    if all(e.exists() for e in exes.values()):
        return exes
    if not install:
        return f"no router venv at {venv} (run the full bench once to install sglang-router and vllm-router)"
    venv.parent.mkdir(parents=True, exist_ok=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    err = _run([base, "-m", "venv", str(venv)], "creating the routers venv") or _run(
        [str(venv / "bin" / "pip"), "install", "-q", *ROUTERS.values()], "installing sglang-router and vllm-router"
    )
    if err:
        return err
    missing = [str(e) for e in exes.values() if not e.exists()]
    return exes if not missing else f"routers installed but {', '.join(missing)} missing"


def router_versions(exes: dict[str, Path]) -> dict[str, str]:
    py = next(iter(exes.values())).parent / "python"
    code = "import importlib.metadata as m; print(m.version('sglang-router'), m.version('vllm-router'))"
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        return {}
    sgl, vllm = r.stdout.split()
    return {"sglang-router": sgl, "vllm-router": vllm}


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = f"{mem_kb / 1024 / 1024:.0f} GiB"
    except (OSError, IndexError, ValueError):
        mem = "unknown"
    return {"nproc": str(os.cpu_count()), "cpu": model, "memory": mem, "python": sys.version.split()[0]}


def versions(litellm: Path | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for dist in ("llama_cpp_python", "granian", "litestar", "nats-py"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if litellm is not None:
        r = subprocess.run(
            [str(litellm.parent / "python"), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
            capture_output=True,
            text=True,
        )
        if r.returncode == 0:
            out["litellm"] = r.stdout.strip()
    wrk = shutil.which("wrk")
    if wrk:
        r = subprocess.run([wrk, "-v"], capture_output=True, text=True)
        out["wrk"] = (r.stdout or r.stderr).split("[")[0].replace("wrk", "").strip()
    return out


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU since boot, from /proc/stat: two readings give how busy the machine was."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def load_note(before: tuple[int, int], after: tuple[int, int]) -> str:
    """How loaded the machine was between two `cpu_times()` readings, and its load average now: printed beside
    each table, so a number taken on a busy machine says so."""
    busy, total = after[0] - before[0], after[1] - before[1]
    one, five, _ = os.getloadavg()
    share = 100 * busy / total if total else float("nan")
    return f"machine during this part: CPUs {share:.0f} % busy (every process, the bench's own included); load average {one:.2f} (1 min), {five:.2f} (5 min)"


def run_main(main: Callable[[], int], what: str) -> None:
    """A bench's entry point: unbuffered output, `main()`'s exit code, and how long it took (on stderr)."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.monotonic()
    rc = main()
    print(f"[bench] {what} took {time.monotonic() - t0:.0f}s", file=sys.stderr)
    sys.exit(rc)
