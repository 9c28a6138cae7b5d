"""Apple's MLX through mlx_lm's own OpenAI server (`mlx_lm.server`), run as a supervised child on loopback: chat
(the model's chat template, tool calls) and completions, whole or streamed, batched by the server.

MLX runs on Apple silicon (Metal) and, with `mlx[cpu]`, on a Linux CPU; the worker offers the family where mlx_lm
imports. The server is started through `mlx_serve.py` (the server itself, with an API key, the model pinned to
the command line's, a real readiness probe and OpenAI error objects patched in: see there), by path, under this
interpreter, with `HF_HUB_OFFLINE=1` and an empty hub cache folder of its own (its `/v1/models` fails without an
existing one). The jobs go to it as OpenAI requests (openai_server), with these differences:
- `model` is always the model folder's path (offline, any other name is a folder it fails to find, and a name it
  did find would replace the loaded model for every request), and a request's `adapters`, `draft_model` and
  `num_draft_tokens` are dropped (paths and knobs of the loaded model, the operator's).
- A stream always asks for usage (`stream_options.include_usage`, without which it sends none): it comes in a last
  event with `choices: []` (whose `object` is `chat.completion`, even for a completion), read as any usage event;
  the `: keepalive` comments it sends while reading a long prompt are skipped as SSE comments.
- What it would not honour is refused with a 400 before it runs, never silently dropped: `n > 1` (one choice per
  request), `logprobs` (its shape is not OpenAI's, and streams carry none), `response_format` (no constrained
  decoding), a `tool_choice` other than `auto` or `none` (`none` sends the tools not at all), `echo`, and any content
  part but text (it fetches an `http(s)` image URL itself, and reads images only with a vision model).

Model params: `max_tokens` (the default answer length, mlx_lm's 512 when unset), `chat_template`,
`chat_template_args` (a table, sent as JSON), `trust_remote_code`, `temp`, `top_p`, `top_k`, `min_p`,
`decode_concurrency` (requests decoded together, default 32: also how many jobs the worker runs on it at once),
and the others of `FAMILIES["mlx"]` become `--kebab-case` server flags (`true` a bare flag); `extra_args` is appended
as is, `env` added to its environment; `load_timeout_s` (default 600) and the crash-loop params are the engine's.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Any

from coderai.contracts import ChatJob, CompletionJob, ModelConfig
from coderai.engine_worker.engines.base import BadInput, EngineLoadError, refuse_media
from coderai.engine_worker.engines.openai_server import OpenAIServerEngine, param_flags

KEY_ENV = "CODERAI_MLX_KEY"  # mlx_serve.py's: it imports nothing of coderai, so the name is written twice
SERVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlx_serve.py")
# run mlx_serve.py by path without putting its folder first on sys.path (its neighbours would shadow modules)
BOOT = "import runpy, sys; runpy.run_path(sys.argv.pop(1), run_name='__main__')"
OWN_PARAMS = frozenset({"load_timeout_s", "extra_args", "env", "chat_template_args", "crash_limit", "crash_window_s"})
DROPPED = ("adapters", "draft_model", "num_draft_tokens")  # what a request body could choose of the loaded model
DEFAULT_CONCURRENCY = 32  # mlx_lm.server's --decode-concurrency


def server_command(python: str, model_path: str, port: int, params: dict[str, Any]) -> list[str]:
    """The argv that starts mlx_lm.server (through mlx_serve.py) for one model folder on loopback."""
    cmd = [python, "-c", BOOT, SERVE, "--model", model_path, "--host", "127.0.0.1", "--port", str(port)]
    if params.get("chat_template_args"):
        cmd += ["--chat-template-args", json.dumps(params["chat_template_args"])]
    return cmd + param_flags(params, OWN_PARAMS)


def model_folder(config: ModelConfig) -> str:
    """The model's folder as an absolute path: what the server is started with and every request names."""
    return os.path.abspath(os.path.expanduser(config.path))


class MlxEngine(OpenAIServerEngine):
    """One model folder served by an mlx_lm.server child that this engine starts, owns, supervises and stops."""

    family = "mlx"
    label = "mlx_lm.server"
    key_env = KEY_ENV
    streams_choices = prompt_lists = False  # one choice, one prompt per request
    logit_bias = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.max_concurrency = config.param_int("decode_concurrency") or DEFAULT_CONCURRENCY
        self.hub_cache = ""  # the empty hub cache folder the server is given (made on load)

    def media_takes(self) -> frozenset[str]:
        return frozenset()

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        cmd = server_command(sys.executable, model_folder(self.config), port, dict(self.config.params))
        return cmd, {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": self.hub_cache,
            **{k: str(v) for k, v in self.config.param_table("env").items()},
        }

    def load(self) -> None:
        if not os.path.isdir(model_folder(self.config)):
            raise EngineLoadError(
                f"no such model folder: {self.config.path} (the mlx family loads a Hugging Face or MLX model folder)"
            )
        self.hub_cache = tempfile.mkdtemp(prefix="coderai-mlx-hub-")
        try:
            self.start_server()
        except EngineLoadError:
            self._drop_hub_cache()  # whether or not the worker closes an engine that failed to load
            raise
        # the supervisor restarts a child that dies (and starts every later one, which then dies with it)
        self.supervise()

    def close(self) -> None:
        super().close()
        self._drop_hub_cache()

    def _drop_hub_cache(self) -> None:
        if self.hub_cache:
            shutil.rmtree(self.hub_cache, ignore_errors=True)
            self.hub_cache = ""

    def chat_body(self, job: ChatJob, stream: bool) -> dict[str, Any]:
        refuse_media(job.messages, self.config.name, self.media_takes())
        self._refuse(job)
        if job.response_format:
            raise BadInput(
                f"{self.label} cannot constrain an answer to a format: send no response_format", "response_format"
            )
        choice = job.tool_choice
        if choice not in (None, "auto", "none"):
            raise BadInput(f"{self.label} cannot force a tool call: send tool_choice auto or none", "tool_choice")
        body = self._pinned(super().chat_body(job, stream))
        if choice == "none":
            body.pop("tools", None)
        body.pop("tool_choice", None)
        return body

    def completion_body(self, job: CompletionJob, stream: bool) -> dict[str, Any]:
        self._refuse(job)
        if job.echo:
            raise BadInput(f"{self.label} does not echo the prompt: send echo false", "echo")
        return self._pinned(super().completion_body(job, stream))

    def _refuse(self, job: ChatJob | CompletionJob) -> None:
        if job.params.n > 1:
            raise BadInput(f"{self.label} answers one choice per request: send n = 1, or one request per choice", "n")
        if job.params.logprobs:
            raise BadInput(f"{self.label} does not return logprobs as OpenAI does: send logprobs false", "logprobs")

    def _pinned(self, body: dict[str, Any]) -> dict[str, Any]:
        for key in DROPPED:
            body.pop(key, None)
        return {**body, "model": model_folder(self.config)}
