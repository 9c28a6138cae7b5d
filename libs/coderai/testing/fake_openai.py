"""A stand-in OpenAI-compatible server: `/health`, `/v1/models`, `/v1/chat/completions` and `/v1/completions`, whole or streamed
(SSE over chunked HTTP/1.1), answering a fixed reply word by word. Run it in a thread (`FakeOpenAI().start()`) or as
a child process (`python -m coderai.testing.fake_openai PORT`, its key from `$FAKE_OPENAI_KEY`).

- With a key set, a request without it gets 401; `/health` stays open (as llama-server's and vLLM's do).
- The answer has `max_tokens` words (the reply repeated as needed; the whole reply when not given): a long stream
  to cancel is one with a large `max_tokens`.
- A last message (or prompt) `fail:400` or `fail:500` gets that error answer, naming the param `messages`.
- A prompt seen before is reported cached in full (`prompt_tokens_details.cached_tokens`), as a prompt cache would.
- Every request is kept in `seen` (path, headers, body); a stream whose client went away sets `dropped`.
- `usage=False`: a server that reports no usage (no `usage` in a whole answer, none in a stream, even when asked).
Any path that ends in one of the routes is served, so a base URL with a prefix can be tested.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REPLY = "Hello from the fake server"


class FakeOpenAI:
    """The server; `base_url` is its root (the routes start with /v1)."""

    def __init__(self, port: int = 0, key: str = "", reply: str = REPLY, usage: bool = True) -> None:
        self.key = key
        self.usage = usage
        self.reply = reply.split()
        self.seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.prompts: set[str] = set()
        self.dropped = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), type("Handler", (_Handler,), {"fake": self}))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    def start(self) -> FakeOpenAI:
        """Serve from a thread of its own until `close`."""
        # a short poll: `close` (shutdown) waits for the loop to look
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="fake-openai", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def words(self, n: int) -> list[str]:
        return [self.reply[i % len(self.reply)] for i in range(n)]


def _prompt_text(body: dict[str, Any], chat: bool) -> str:
    if not chat:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else " ".join(prompt or [])
    return " ".join(str(m.get("content") or "") for m in body.get("messages") or [])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeOpenAI

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        elif self.path.endswith("/v1/models"):
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "fake"}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "code": 404}})

    def do_POST(self) -> None:
        fake = self.fake
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        fake.seen.append((self.path, dict(self.headers.items()), body))
        if fake.key and self.headers.get("Authorization") != f"Bearer {fake.key}":
            return self._json(401, {"error": {"message": "invalid api key", "code": 401}})
        if self.path.endswith("/v1/chat/completions"):
            chat = True
        elif self.path.endswith("/v1/completions"):
            chat = False
        else:
            return self._json(404, {"error": {"message": f"no route {self.path}", "code": 404}})
        text = _prompt_text(body, chat)
        last = text.split()[-1] if text.split() else ""
        if last.startswith("fail:"):
            code = int(last[5:])
            return self._json(
                code, {"error": {"message": f"failed as asked ({code})", "param": "messages", "code": code}}
            )
        n = int(body.get("max_tokens") or len(fake.reply))
        prompt_tokens = len(text.split())
        cached = prompt_tokens if text in fake.prompts else 0
        fake.prompts.add(text)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        finish = "stop" if n == len(fake.reply) else "length"
        if body.get("stream"):
            return self._stream(body, chat, n, finish, usage)
        content = " ".join(fake.words(n))
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": content, "finish_reason": finish}
        )
        self._json(
            200,
            {
                "id": "fake-1",
                "object": "chat.completion" if chat else "text_completion",
                "model": body.get("model"),
                "choices": [choice],
                **({"usage": usage} if fake.usage else {}),
            },
        )

    def _stream(self, body: dict[str, Any], chat: bool, n: int, finish: str, usage: dict[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(choices: list[dict], **extra: Any) -> bytes:
            obj = "chat.completion.chunk" if chat else "text_completion"
            return f"data: {json.dumps({'id': 'fake-1', 'object': obj, 'choices': choices, **extra})}\n\n".encode()

        def piece(text: str | None, why: str | None, first: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant"} if first else {}
                return {"index": 0, "delta": {**delta, **({"content": text} if text else {})}, "finish_reason": why}
            return {"index": 0, "text": text or "", "finish_reason": why}

        try:
            for i, word in enumerate(self.fake.words(n)):
                self._chunk(event([piece(("" if i == 0 else " ") + word, None, first=i == 0)]))
            self._chunk(event([piece(None, finish)]))
            if self.fake.usage and (body.get("stream_options") or {}).get("include_usage"):
                self._chunk(event([], usage=usage))
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.fake.dropped.set()
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def main() -> None:
    """`python -m coderai.testing.fake_openai PORT`: serve until killed (a child server for tests)."""
    fake = FakeOpenAI(int(sys.argv[1]), key=os.environ.get("FAKE_OPENAI_KEY", ""))
    print(f"fake OpenAI server on port {fake.port}", flush=True)
    fake.server.serve_forever()


if __name__ == "__main__":
    main()
