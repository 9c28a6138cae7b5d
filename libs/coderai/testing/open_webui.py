"""Open WebUI as it ships on PyPI, for tests: installed into a venv of its own, started offline against a gateway
over both of its connections (OpenAI and Ollama, each with a key), and the models and recordings its tests share.

Open WebUI pins torch with CUDA and ~150 other packages: about 7.4 GB and 4.5 minutes to install on 2 cores, so
the suite runs it only when asked (`CODERAI_TEST_OPEN_WEBUI=1`); what it sent to coderai is recorded under
`tests/integration/data/open_webui_<version>/` and replayed by the fast suite."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from coderai.runtime.embedded import free_port
from coderai.runtime.supervisor import signal_group
from coderai.testing.procs import ProcessDied, wait_until

VERSION = "0.12.4"
FLAG = "CODERAI_TEST_OPEN_WEBUI"
ROOT = Path(__file__).resolve().parents[3]
VENV = ROOT / ".venv" / "openwebui"  # inside .venv: ignored by git, and kept between runs like the agent CLIs
RECORDINGS = ROOT / "tests" / "integration" / "data" / f"open_webui_{VERSION}"

# The stack both the browser test and the replay run: the names are in the recorded requests.
ECHO, TEXT_ONLY = "echo", "tiny"
REPLY = "Hello from the coderai echo engine, streamed word by word."
# A catalogue name, served by the fake Hub with the tiny GGUF's bytes (the catalogue keeps its repo and file).
CATALOGUE_NAME, CATALOGUE_REPO, CATALOGUE_FILE = (
    "qwen2.5-0.5b-instruct",
    "Qwen/Qwen2.5-0.5B-Instruct-GGUF",
    "qwen2.5-0.5b-instruct-q4_k_m.gguf",
)


def models(tiny_gguf: Path, token_delay_s: float = 0.0) -> list[dict]:
    """The echo engine (paced, so that a stream is seen growing in the page) and a text-only GGUF behind
    llama-server (no projector: an image for it is refused on arrival)."""
    # Open WebUI's title, tags and follow-up tasks ask for 1,000 tokens each; a ceiling keeps them short, as
    # docs/clients.md advises for small models (paced at 0.15 s a token, 1,000 would take 150 s)
    return [
        {
            "name": ECHO,
            "engine": "echo",
            "path": "-",
            "max_output_tokens": 16,
            "params": {"reply": REPLY, "token_delay_s": token_delay_s},
        },
        {
            "name": TEXT_ONLY,
            "engine": "llama-server",
            "path": str(tiny_gguf),
            "max_output_tokens": 8,
            "params": {"n_ctx": 2048, "parallel": 1, "n_threads": 2},
        },
    ]


def installed_version(venv: Path = VENV) -> str:
    """The open-webui version in `venv`, or '' when there is none."""
    python = venv / "bin" / "python"
    if not python.exists():
        return ""
    r = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('open-webui'))"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    return r.stdout.strip() if r.returncode == 0 else ""


def ensure_installed(venv: Path = VENV, version: str = VERSION, timeout_s: float = 1800) -> Path:
    """`venv` holding open-webui==`version` (made, or changed to that version, when it is not): its `open-webui`."""
    if installed_version(venv) != version:
        if not (venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"open-webui=={version}"],
            check=True,
            timeout=timeout_s,
        )
    return venv / "bin" / "open-webui"


def env(root: Path, gateway: str, key: str) -> dict[str, str]:
    """Open WebUI's settings (env names read from its config.py and env.py): offline, no embedding model, its data and
    home under `root`, and two connections to `gateway`, each with `key`. The OpenAI one prefixes its model ids with
    `openai.`, so that a model both connections list shows twice rather than collapsing into one entry."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(root / "home"),
        "DATA_DIR": str(root / "data"),
        "WEBUI_SECRET_KEY": "coderai-open-webui-test-secret-0123456789",
        "OFFLINE_MODE": "true",  # no version check, HF_HUB_OFFLINE, no pip installs for tools
        "HF_HUB_OFFLINE": "1",
        "RAG_EMBEDDING_MODEL": "",  # no SentenceTransformer is loaded (or downloaded) at start
        "BYPASS_EMBEDDING_AND_RETRIEVAL": "true",
        "ENABLE_WEB_SEARCH": "false",
        "ANONYMIZED_TELEMETRY": "false",
        "DO_NOT_TRACK": "true",
        "SCARF_NO_ANALYTICS": "true",
        "ENABLE_OLLAMA_API": "true",
        "OLLAMA_BASE_URLS": gateway,
        "OLLAMA_API_CONFIGS": json.dumps({"0": {"key": key}}),
        "ENABLE_OPENAI_API": "true",
        "OPENAI_API_BASE_URLS": f"{gateway}/v1",
        "OPENAI_API_KEYS": key,
        "OPENAI_API_CONFIGS": json.dumps({"0": {"prefix_id": "openai"}}),
    }


@contextlib.contextmanager
def serving(root: Path, gateway: str, key: str, venv: Path = VENV, timeout_s: float = 300) -> Iterator[str]:
    """`open-webui serve` on a free loopback port until the block ends; yields its URL once `/health` answers."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "home").mkdir(exist_ok=True)
    port = free_port()
    log_path = root / "open-webui.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [str(venv / "bin" / "open-webui"), "serve", "--host", "127.0.0.1", "--port", str(port)],
            env=env(root, gateway, key),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise ProcessDied(f"open-webui exited {proc.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout_s, "open-webui /health")
        yield url
    finally:
        signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait(10)


def recording_names() -> list[str]:
    """The recorded scenarios, by file name without `.json`."""
    return sorted(p.stem for p in RECORDINGS.glob("*.json"))


def load_recording(name: str) -> list[dict]:
    return json.loads((RECORDINGS / f"{name}.json").read_text())["exchanges"]
