"""Claude Code and Codex as they ship from npm (`@anthropic-ai/claude-code` and `@openai/codex`, pinned and installed
into `.venv/agents` by scripts/setup with the dev extra), run unchanged and non-interactively against a real stack:
no proxy, no patched client, only the settings their docs give for another endpoint.

- A plain turn on the real K-quant GGUF (Gemma 3 270M behind llama-server), each CLI with its whole system prompt
  and tools. The base model never ends its turn by itself, and an agent reads an answer cut at the output ceiling
  as an error, so the models file ends its turns with `stop` sequences, as an operator would.
- A tool round trip on the echo engine's scripted mode (no small tool-trained model ships offline): it calls the
  CLI's own file or shell tool on a file holding a random secret, the CLI runs it, and the answer it is sent back
  carries the secret. Claude Code runs its Read tool; Codex its shell tool (`exec_command`).

What each CLI prints is read, not its exit code: `codex exec` can exit 0 when every request failed."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.procs import run_interruptible
from coderai.testing.stack import running_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / ".venv" / "agents" / "node_modules" / ".bin"
KEY = "sk-agents-0123456789abcdef"
GEMMA, SCRIPTED = "gemma3-270m", "agent-tools"
REPLY = "The file says:"
TURN_S = 300  # a CLI's whole run: the real model reads a 3-5k token prompt on 2 cores


def _cli(name: str) -> Path:
    path = AGENTS / name
    if not path.exists():
        pytest.skip(
            f"no {name}: scripts/setup installs the agent CLIs into .venv/agents with the dev extra (needs npm)"
        )
    return path


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Path, str]:
    """The folder the CLIs work in, with a file that holds a secret only a tool run can read."""
    folder = tmp_path_factory.mktemp("agent-project")
    secret = f"pelican-{secrets.token_hex(4)}"
    (folder / "notes.txt").write_text(f"The secret word is {secret}.\n")
    return folder, secret


@pytest.fixture(scope="module")
def stack(tmp_path_factory, project):
    from coderai.engine_worker.engines.llama_server import find_binary
    from coderai.testing.real_gguf import MISSING, gemma3_q4km

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    try:
        gemma = gemma3_q4km()
    except ImportError:
        pytest.skip(MISSING)
    folder, _ = project
    keys = tmp_path_factory.mktemp("agent-keys") / "keys.toml"
    write_keys(str(keys), [KeyRecord("agents", hash_key(KEY), ["inference"])])
    script = {
        "Read": {"file_path": str(folder / "notes.txt")},  # Claude Code's
        "exec_command": {"cmd": "cat notes.txt"},
        "shell": {"command": ["cat", "notes.txt"]},
    }  # Codex's
    models = [
        # no chat template in this GGUF: llama-server's ChatML, whose end marker the base model writes as text.
        # Greedy (`temp` 0, the server's default for requests that name none: neither CLI does), so that the turn
        # is the same every run: sampled, a fresh run once drew a newline first, and Codex got an empty answer
        {
            "name": GEMMA,
            "engine": "llama-server",
            "path": str(gemma),
            "max_output_tokens": 256,
            "stop": ["\n", "<|im_end|>"],
            "params": {"parallel": 1, "n_ctx": 8192, "n_threads": 2, "temp": 0},
        },
        {"name": SCRIPTED, "engine": "echo", "path": "-", "params": {"reply": REPLY, "tool_calls": script}},
    ]
    with running_stack(
        tmp_path_factory.mktemp("agents"),
        models,
        gateway_args=("--api-keys-file", str(keys)),
        extra_env={"CODERAI_WORKER_FAMILIES": "llama-server,echo"},
        headers={"Authorization": f"Bearer {KEY}"},
    ) as s:
        s.wait_model_ready(SCRIPTED, headers={"Authorization": f"Bearer {KEY}"})
        yield s


def _events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _claude(stack, project, tmp_path, model: str, prompt: str) -> list[dict]:
    """`claude -p` with the settings its docs give for another endpoint; its stream-json events."""
    folder, _ = project
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": stack.http_url,
        "ANTHROPIC_AUTH_TOKEN": KEY,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    r = run_interruptible(
        [str(_cli("claude")), "-p", prompt, "--output-format", "stream-json", "--verbose"], TURN_S, cwd=folder, env=env
    )
    events = _events(r.stdout)
    assert events, f"claude printed no events (exit {r.returncode}):\n{r.stderr[-3000:]}"
    return events


def _codex(stack, project, tmp_path, model: str, prompt: str) -> list[dict]:
    """`codex exec --json` with a `model_providers` entry for coderai (wire_api "responses"); its events."""
    folder, _ = project
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "coderai"\n\n[model_providers.coderai]\nname = "coderai"\n'
        f'base_url = "{stack.base_url}"\nenv_key = "CODERAI_API_KEY"\nwire_api = "responses"\n'
    )
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home), "CODERAI_API_KEY": KEY}
    r = run_interruptible(
        [str(_cli("codex")), "exec", "--json", "--skip-git-repo-check", "-s", "danger-full-access", prompt],
        TURN_S,
        cwd=folder,
        env=env,
    )
    events = _events(r.stdout)
    assert any(e.get("type") == "turn.completed" for e in events), (
        f"codex completed no turn (exit {r.returncode}): {events[-5:]}\n{r.stderr[-3000:]}"
    )
    assert not [e for e in events if e.get("type") in ("turn.failed", "error")], events
    return events


def _result(events: list[dict]) -> dict:
    results = [e for e in events if e.get("type") == "result"]
    assert results, events[-3:]
    return results[-1]


def test_claude_code_answers_a_plain_turn_on_the_real_gguf(stack, project, tmp_path):
    events = _claude(stack, project, tmp_path, GEMMA, "Say hello.")
    result = _result(events)
    assert result["subtype"] == "success" and not result["is_error"], result
    texts = [
        b["text"]
        for e in events
        if e.get("type") == "assistant"
        for b in e["message"]["content"]
        if b.get("type") == "text"
    ]
    assert texts and texts[-1].strip() and result["result"] == texts[-1], texts
    assert result["usage"]["input_tokens"] + result["usage"].get("cache_read_input_tokens", 0) > 1000  # its prompt


def test_claude_code_runs_its_read_tool_and_answers_with_the_result(stack, project, tmp_path):
    _, secret = project
    events = _claude(stack, project, tmp_path, SCRIPTED, "What is the secret word in notes.txt?")
    blocks = [
        b
        for e in events
        if e.get("type") in ("assistant", "user")
        for b in e["message"]["content"]
        if isinstance(b, dict)
    ]
    uses = [b for b in blocks if b.get("type") == "tool_use"]
    assert [u["name"] for u in uses] == ["Read"], blocks
    results = [b for b in blocks if b.get("type") == "tool_result" and b.get("tool_use_id") == uses[0]["id"]]
    assert results and secret in json.dumps(results[0]["content"]) and not results[0].get("is_error"), results
    result = _result(events)
    assert not result["is_error"] and result["result"].startswith(REPLY) and secret in result["result"], result


def test_codex_answers_a_plain_turn_on_the_real_gguf(stack, project, tmp_path):
    events = _codex(stack, project, tmp_path, GEMMA, "Say hello.")
    said = [
        e["item"]["text"]
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]
    assert said and said[-1].strip(), events
    usage = next(e["usage"] for e in events if e.get("type") == "turn.completed")
    assert usage["input_tokens"] > 1000 and usage["output_tokens"] > 0, usage


def test_codex_runs_its_shell_tool_and_answers_with_the_result(stack, project, tmp_path):
    _, secret = project
    events = _codex(stack, project, tmp_path, SCRIPTED, "What is the secret word in notes.txt?")
    runs = [
        e["item"] for e in events if e.get("type") == "item.completed" and e["item"].get("type") == "command_execution"
    ]
    assert runs and "cat notes.txt" in runs[0]["command"] and runs[0]["exit_code"] == 0, events
    assert secret in runs[0]["aggregated_output"]
    said = [
        e["item"]["text"]
        for e in events
        if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
    ]
    assert said and said[-1].startswith(REPLY) and secret in said[-1], said
