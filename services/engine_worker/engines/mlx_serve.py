"""`mlx_lm.server` as the mlx engine runs it: the server itself, with what it lacks as a worker's child patched in
before it starts. Run under the interpreter that has mlx_lm, by path (engines/mlx.py builds the command), so it
imports nothing of coderai; its arguments are mlx_lm.server's own.

What mlx_lm.server (0.32) does by itself, and what this changes:
- No API key: any local user who finds its loopback port is served (unbilled), and may make it load any folder the
  worker can read (a request's `model`, `adapters` and `draft_model` are paths it loads). Here every route but
  `GET /health` wants `Authorization: Bearer <CODERAI_MLX_KEY>` (401 otherwise), and the server only ever runs its
  own model: whatever model, adapter or draft model a request names, the command line's are used.
- `/health` answers 200 as soon as the process listens, before the model is loaded, and the model loads in a thread
  that, when it fails, leaves the process serving 503s forever. Here `/health` is 200 once the model is loaded, and
  the process exits when that thread dies (a bad model folder, a crash later), so the worker sees it and says why.
- Errors are `{"error": "<text>"}` (or a bare `Not Found`), and a request the model cannot take (a content part it
  cannot read, a template that refuses the conversation) is a 404. Here they are OpenAI error objects, and such a
  request is a 400.
- An empty prompt kills the thread that generates for every request (its batch refuses it after the request was
  accepted). Here it is refused with the request (a 400).
- It fetches an `http(s)` image URL a request names, from the worker's network. Here it never does (such a part
  then fails as any part the model cannot read).
- A client that goes away mid-stream stops its generation (the next write fails and the request's context is
  stopped); here that is one log line instead of a traceback.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import sys
from http import HTTPStatus
from typing import Any

import mlx_lm
from mlx_lm import server

KEY_ENV = "CODERAI_MLX_KEY"
GENERATING = frozenset({"/v1/completions", "/v1/chat/completions", "/chat/completions"})
GONE = (BrokenPipeError, ConnectionResetError)
PATCHED = (
    (server.APIHandler, ("do_GET", "do_POST", "end_headers", "handle_completion", "_set_completion_headers")),
    (server.ModelProvider, ("load",)),
    (server.ResponseGenerator, ("_run_generate", "_tokenize", "generation_available")),
)
FETCHES = "_inline_image_urls"  # a function of the module
TESTED = "0.32.2"  # the mlx-lm these patches were written against (pyproject's `mlx` extra)
ORIGINAL: dict[str, Any] = {}


class ErrorShape:
    """The body of an error answer, rewritten as an OpenAI error object on its way to the socket."""

    def __init__(self, out: Any, status: int) -> None:
        self.out, self.status = out, status

    def write(self, data: bytes) -> int:
        try:
            body = json.loads(data)
            message = body.get("error") if isinstance(body, dict) else None
        except ValueError:
            message = None
        if not isinstance(message, str):
            message = data.decode("utf-8", "replace").strip() or HTTPStatus(self.status).phrase
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return self.out.write(
            json.dumps({"error": {"message": message, "type": kind, "param": None, "code": self.status}}).encode()
        )

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


def _authorized(handler: Any, key: bytes) -> bool:
    given = str(handler.headers.get("Authorization") or "").encode()
    if hmac.compare_digest(given, b"Bearer " + key):
        return True
    handler._set_completion_headers(401)
    handler.send_header("WWW-Authenticate", "Bearer")
    handler.end_headers()
    handler.wfile.write(json.dumps({"error": "a missing or wrong API key"}).encode())
    return False


def no_fetch(messages: Any) -> None:
    """What replaces mlx_lm.server's `_inline_image_urls`, which fetched each http(s) image URL of a request."""


def patch(key: bytes) -> None:
    """Patch mlx_lm.server's classes in place (its `run` builds them itself): see the module's docstring."""
    handler, provider, generator = server.APIHandler, server.ModelProvider, server.ResponseGenerator
    try:
        ORIGINAL.update((name, getattr(cls, name)) for cls, names in PATCHED for name in names)
        ORIGINAL[FETCHES] = getattr(server, FETCHES)
    except AttributeError as exc:
        sys.exit(f"this mlx_lm ({mlx_lm.__version__}) is not the one coderai's mlx engine knows ({TESTED}): {exc}")

    def do_get(self: Any) -> None:
        if self.path == "/health" or _authorized(self, key):
            ORIGINAL["do_GET"](self)

    def do_post(self: Any) -> None:
        if _authorized(self, key):
            ORIGINAL["do_POST"](self)

    def set_completion_headers(self: Any, status_code: int = 200) -> None:
        # a generation that could not start answers 404 here: the request's own fault (its route exists)
        if status_code == 404 and self.command == "POST" and self.path in GENERATING:
            status_code = 400
        self.coderai_error = status_code if status_code >= 400 else 0
        ORIGINAL["_set_completion_headers"](self, status_code)

    def end_headers(self: Any) -> None:
        ORIGINAL["end_headers"](self)
        status = getattr(self, "coderai_error", 0)
        if status:  # what follows is the error's body
            self.wfile = ErrorShape(self.wfile, status)

    def handle_completion(self: Any, request: Any, stop_words: Any) -> None:
        try:
            ORIGINAL["handle_completion"](self, request, stop_words)
        except GONE:
            logging.info("%s %s: the client went away; its generation was stopped", self.command, self.path)

    def load(self: Any, model_path: Any, adapter_path: Any = None, draft_model_path: Any = None) -> Any:
        return ORIGINAL["load"](self, "default_model", None, "default_model")  # the command line's, always

    def tokenize(self: Any, tokenizer: Any, request: Any, args: Any) -> Any:
        tokenized = ORIGINAL["_tokenize"](self, tokenizer, request, args)
        if not tokenized[0]:  # raised here, it fails the request; later, it kills the generation thread
            raise ValueError("the prompt is empty: there is nothing to continue")
        return tokenized

    def healthy(self: Any) -> bool:
        return ORIGINAL["generation_available"](self) and self.model_provider.model is not None

    def run_generate(self: Any) -> None:
        ORIGINAL["_run_generate"](self)
        if self._generation_failed:  # it logged why; a process that serves only 503s would hide it
            logging.error("mlx_lm.server's generation thread died: exiting")
            logging.shutdown()
            os._exit(3)

    handler.do_GET = do_get
    handler.do_POST = do_post
    handler._set_completion_headers = set_completion_headers
    handler.end_headers = end_headers
    handler.handle_completion = handle_completion
    provider.load = load
    server._inline_image_urls = no_fetch
    setattr(generator, "is_healthy", property(healthy))  # a property replaced on the class: no setter to type
    generator._run_generate = run_generate
    generator._tokenize = tokenize


def main() -> None:
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        sys.exit(f"{KEY_ENV} is not set: the mlx engine starts this server with a key of its own")
    patch(key.encode())
    server.main()


if __name__ == "__main__":
    main()
