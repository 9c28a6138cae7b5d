"""The soak's clients (bench/soak.py): one request of each kind, timed and classified (ok, clean, bad, refused,
hang) into a ledger shared by every client thread."""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from coderai.contracts.topology import HDR_REQUEST_ID
from _words import WORDS

if TYPE_CHECKING:
    from soak import Soak

BACKOFF_S = 0.5  # a client's pause after an answer that was not ok
KEYS = ("soak-a", "soak-b", "soak-rude", "soak-probe")
EXACT_KEYS = ("soak-a", "soak-b", "soak-probe")  # whole answers: their ok counts must match the server's
MIX = {
    "chat": 20,
    "stream": 20,
    "conversation": 10,
    "embeddings": 12,
    "images": 6,
    "speech": 6,
    "transcription": 6,
    "disconnect": 5,
    "slow-reader": 5,
}
RUDE = ("disconnect", "slow-reader")
MODEL_OF = {
    "chat": "tiny",
    "stream": "tiny",
    "conversation": "tiny",
    "disconnect": "tiny",
    "slow-reader": "tiny",
    "probe": "tiny",
    "embeddings": "minilm",
    "images": "sd",
    "speech": "piper",
    "transcription": "whisper",
}
CLIENT_ID = "X-Client-Request-Id"  # each request's own id, which the server keeps with its usage event
_ids = itertools.count(1)  # next() on it is atomic under the GIL: an id per request across every client thread


# --- what the clients saw ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    key: str
    model: str
    t0: float
    t1: float
    result: str  # ok | clean | bad | hang | refused
    why: str = ""
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    request_id: str = ""  # the gateway's id for it (Coderai-Request-Id), where an answer's headers came
    client_id: str = ""  # the client's own (X-Client-Request-Id): known even when no answer came


@dataclass
class Fault:
    kind: str
    target: str
    t0: float
    t1: float = 0.0
    recovery_s: float | None = None
    detail: str = ""


class Ledger:
    """Every outcome, appended from many threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outcomes: list[Outcome] = []

    def add(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)

    def snapshot(self) -> list[Outcome]:
        with self.lock:
            return list(self.outcomes)


def _retry_after(r: httpx.Response) -> bool:
    with contextlib.suppress(ValueError):
        return int(r.headers.get("retry-after", "")) > 0
    return False


def classify_status(r: httpx.Response) -> tuple[str, str]:
    """A non-200 answer: clean or bad, and why."""
    try:
        err = r.json().get("error") or {}
        code = err.get("code") or err.get("type") or ""
    except Exception:  # a body that is not our error JSON is itself bad
        return "bad", f"{r.status_code} without error JSON"
    if r.status_code in (429, 503):
        return (
            ("clean", f"{r.status_code} {code}")
            if _retry_after(r)
            else ("bad", f"{r.status_code} {code} no Retry-After")
        )
    if 400 <= r.status_code < 500:
        return "clean", f"{r.status_code} {code}"
    return "bad", f"{r.status_code} {code}"


def read_sse(r: httpx.Response, stop_after: int = 0, pause_s: float = 0.0) -> tuple[str, str, dict]:
    """Read an SSE chat stream: (result, why, usage). `stop_after` > 0 leaves after that many data events;
    `pause_s` reads slowly."""
    events, usage = 0, {}
    for line in r.iter_lines():
        if not line or line.startswith(":"):
            continue
        if not line.startswith("data: "):
            return "bad", f"not SSE: {line[:60]!r}", usage
        data = line[6:]
        if data == "[DONE]":
            return ("ok", "", usage) if events else ("bad", "[DONE] before any event", usage)
        try:
            obj = json.loads(data)
        except ValueError:
            return "bad", f"malformed event {data[:60]!r}", usage
        if "error" in obj:
            return "clean", f"stream error {obj['error'].get('code')}", usage
        events += 1
        usage = obj.get("usage") or usage
        if stop_after and events >= stop_after:
            return "ok", "left the stream", usage
        if pause_s:
            time.sleep(pause_s)  # the slow reader: the pause is the load itself, not a wait for anything
    return "bad", f"stream ended without [DONE] after {events} events", usage


class Client:
    """One client thread's requests, each timed and classified into the ledger."""

    def __init__(self, soak: "Soak", key: str, rng: random.Random) -> None:
        self.soak, self.key, self.rng = soak, key, rng
        self._local = threading.local()  # the probe's requests share this client from several threads
        self.http = httpx.Client(
            base_url=soak.base_url,
            headers={"Authorization": f"Bearer {soak.secrets[key]}"},
            timeout=httpx.Timeout(soak.a.deadline_s + 10, connect=5),
        )

    @property
    def last_id(self) -> str:
        """The request id the gateway gave the calling thread's last request (its Coderai-Request-Id)."""
        return getattr(self._local, "last_id", "")

    @last_id.setter
    def last_id(self, value: str) -> None:
        self._local.last_id = value

    @property
    def ids(self) -> dict[str, str]:
        """The headers that name the calling thread's current request (its X-Client-Request-Id)."""
        return {CLIENT_ID: self._local.client_id}

    def close(self) -> None:
        self.http.close()

    def one(self, kind: str) -> None:
        if kind == "conversation":
            history = [{"role": "user", "content": self.text(8)}]
            for _turn in range(3):
                answer = self.timed("conversation", lambda h=list(history): self.chat(h))
                if answer is None:
                    return
                history += [{"role": "assistant", "content": answer}, {"role": "user", "content": self.text(6)}]
            return
        self.timed(kind, getattr(self, kind.replace("-", "_")))

    def timed(self, kind: str, send) -> str | None:
        """Run `send()` -> (result, why, status, usage, value) and record it; the value when ok."""
        t0 = time.monotonic()
        value = None
        self.last_id = ""
        self._local.client_id = cid = f"soak-{next(_ids)}"
        try:
            result, why, status, usage, value = send()
        except httpx.TimeoutException as exc:
            result, why, status, usage = "hang", f"client timeout ({type(exc).__name__})", 0, {}
        except httpx.ConnectError as exc:
            result, why, status, usage = "refused", f"connect: {exc}"[:120], 0, {}
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            result, why, status, usage = "bad", f"connection broke: {type(exc).__name__}", 0, {}
        t1 = time.monotonic()
        if result != "hang" and t1 - t0 > self.soak.a.deadline_s:
            result, why = "hang", f"answered after {t1 - t0:.1f}s"
        self.soak.ledger.add(
            Outcome(
                kind,
                self.key,
                MODEL_OF[kind],
                t0,
                t1,
                result,
                why,
                status,
                int(usage.get("prompt_tokens") or 0),
                int(usage.get("completion_tokens") or 0),
                self.last_id,
                cid,
            )
        )
        if result != "ok" and kind != "probe":
            self.soak.stop.wait(BACKOFF_S)  # as a real client does (the SDKs back off): no error storm
        return value if result == "ok" else None

    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    # --- one request of each kind: (result, why, http status, usage, value) ------------------------------------

    def _whole(self, path: str, body: dict, check) -> tuple:
        r = self.http.post(path, json=body, headers=self.ids)
        self.last_id = r.headers.get(HDR_REQUEST_ID, "")
        if r.status_code != 200:
            return (*classify_status(r), r.status_code, {}, None)
        try:
            obj = r.json()
        except ValueError:
            return "bad", "malformed JSON", 200, {}, None
        why = check(obj)
        return ("bad" if why else "ok"), why, 200, obj.get("usage") or {}, obj

    def chat(self, messages: list[dict] | None = None) -> tuple:
        body = {
            "model": "tiny",
            "messages": messages or [{"role": "user", "content": self.text(10)}],
            "max_tokens": self.rng.randint(4, 24),
            "temperature": 0.8,
        }
        res = self._whole(
            "/chat/completions",
            body,
            lambda o: "" if o.get("choices") and "message" in o["choices"][0] else "no choices",
        )
        content = (res[4]["choices"][0]["message"].get("content") or "") if res[0] == "ok" else None
        return (*res[:4], content)

    def probe(self) -> tuple:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        return self._whole("/chat/completions", body, lambda o: "" if o.get("choices") else "no choices")

    def _stream(self, max_tokens: int, stop_after: int = 0, pause_s: float = 0.0) -> tuple:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": self.text(10)}],
            "max_tokens": max_tokens,
            "temperature": 0.8,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with self.http.stream("POST", "/chat/completions", json=body, headers=self.ids) as r:
            self.last_id = r.headers.get(HDR_REQUEST_ID, "")
            if r.status_code != 200:
                r.read()
                return (*classify_status(r), r.status_code, {}, None)
            result, why, usage = read_sse(r, stop_after, pause_s)
            return result, why, 200, usage, None

    def stream(self) -> tuple:
        return self._stream(self.rng.randint(8, 48))

    def disconnect(self) -> tuple:
        return self._stream(400, stop_after=2)

    def slow_reader(self) -> tuple:
        return self._stream(16, pause_s=0.1)

    def embeddings(self) -> tuple:
        n = 16
        inputs = [self.text(12) for _ in range(n)]
        return self._whole(
            "/embeddings",
            {"model": "minilm", "input": inputs, "encoding_format": "float"},
            lambda o: (
                ""
                if [d["index"] for d in o.get("data", [])] == list(range(n))
                else f"{len(o.get('data', []))} of {n} embeddings"
            ),
        )

    def images(self) -> tuple:
        return self._whole(
            "/images/generations",
            {"model": "sd", "prompt": self.text(5), "n": 2, "size": "64x64", "response_format": "b64_json"},
            lambda o: "" if len(o.get("data", [])) == 2 else f"{len(o.get('data', []))} of 2 images",
        )

    def speech(self) -> tuple:
        r = self.http.post(
            "/audio/speech",
            json={"model": "piper", "voice": "alloy", "input": self.text(6), "response_format": "wav"},
            headers=self.ids,
        )
        self.last_id = r.headers.get(HDR_REQUEST_ID, "")
        if r.status_code != 200:
            return (*classify_status(r), r.status_code, {}, None)
        return ("ok", "", 200, {}, r.content) if r.content[:4] == b"RIFF" else ("bad", "not a WAV", 200, {}, None)

    def transcription(self) -> tuple:
        r = self.http.post(
            "/audio/transcriptions",
            files={"file": ("s.wav", self.soak.wav, "audio/wav")},
            data={"model": "whisper", "temperature": "0"},
            headers=self.ids,
        )
        self.last_id = r.headers.get(HDR_REQUEST_ID, "")
        if r.status_code != 200:
            return (*classify_status(r), r.status_code, {}, None)
        try:
            ok = isinstance(r.json().get("text"), str)
        except ValueError:
            ok = False
        return ("ok", "", 200, {}, None) if ok else ("bad", "no text", 200, {}, None)
