"""A model served by OpenAI-compatible endpoints elsewhere (another vLLM, SGLang or coderai, Ollama, LM Studio,
`mlx_lm.server`, a hosted provider): the `remote` family. The worker holding a copy relays its jobs there, so a
remote model is routed, admitted, metered and billed like a local one, under the local model's prices.

Params: `service_urls` (or one `service_url`): each endpoint's root (`https://host[/prefix]`, the paths sent
start with `/v1`); `served_model`: the model name the endpoints know (default: the local name); `api_key_secret`:
the name of a file in the worker's `<data_dir>/secrets/` that holds the key sent as `Authorization: Bearer`
(never the key itself: params are shown and logged, secrets are not). Each request goes to the least busy
endpoint not marked down; one that cannot be reached or fails before the first token is marked down for
`down_s` (30) and the request goes to the next. What an endpoint sends back is input from the internet: at most
`max_answer_mb` (16) per answer, silence at most `timeout_s` (300), and a malformed answer is a clean error.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from coderai.contracts import ChatJob, Choice, CompletionJob, ModelConfig, Usage
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError
from coderai.engine_worker.engines.loopback_http import AnswerTooBig
from coderai.engine_worker.engines.openai_client import Emit, OpenAIClient, PromptCounters
from coderai.runtime.members import read_secret

SECRET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MB = 1 << 20
# a kept connection to a remote endpoint waits longer for its next request than one to a child here: a new one
# elsewhere costs a TLS handshake over the network, and one the server closed meanwhile is sent again on a new one
REMOTE_IDLE_S = 30.0


def worker_data_dir() -> str:
    """The worker's data dir, as its settings read it (runtime/settings.py: the service's variable, then the
    shared one)."""
    return os.environ.get("CODERAI_WORKER_DATA_DIR") or os.environ.get("CODERAI_DATA_DIR") or "~/.coderai"


def read_key(name: str) -> str:
    """The key in secret `name` of the worker's data dir."""
    if not SECRET_NAME.match(name):
        raise EngineLoadError(f"params.api_key_secret {name!r} is not a plain file name (letters, digits, . _ -)")
    path = Path(os.path.expanduser(worker_data_dir())) / "secrets" / name
    try:
        key = read_secret(path)
    except OSError as exc:
        raise EngineLoadError(f"the key secret {name!r} cannot be read on this node ({exc.strerror})") from None
    if not key:
        raise EngineLoadError(f"the key secret {name!r} is empty")
    return key


@dataclass
class Endpoint:
    url: str
    client: OpenAIClient
    in_flight: int = 0
    down_until: float = 0.0
    last_error: str = ""


def relay_clients(cfg: ModelConfig, urls: list[str], what: str, counters: PromptCounters) -> list[OpenAIClient]:
    """An OpenAI client for each of `urls` with the model's relay params: `served_model` (default its name), the
    key in secret `api_key_secret`, `timeout_s` of silence (300) and `max_answer_mb` per answer (16). `what`
    names the endpoint kind in messages ("remote", "host"); a bad URL is a ValueError."""
    secret = cfg.param_str("api_key_secret")
    headers = {"Authorization": f"Bearer {read_key(secret)}"} if secret else {}
    timeout = cfg.param_float("timeout_s") or 300.0
    made: list[OpenAIClient] = []
    try:
        for url in urls:
            made.append(
                OpenAIClient(
                    url,
                    cfg.param_str("served_model") or cfg.name,
                    headers=headers,
                    label=f"{what} {url}",
                    counters=counters,
                    connect_timeout_s=min(timeout, 10.0),
                    read_timeout_s=timeout,
                    max_body=int((cfg.param_float("max_answer_mb") or 16) * MB),
                    idle_s=REMOTE_IDLE_S,
                )
            )
    except ValueError:
        for client in made:
            client.close()
        raise
    return made


class NotStarted(Exception):
    """An endpoint failed before any of its answer reached the client: the request may go to another one."""

    def __init__(self, cause: BaseException, why: str) -> None:
        super().__init__(why)
        self.cause = cause


def relay_once(
    client: OpenAIClient, who: str, op: str, job: Any, cancel: CancelFlag, emit: Emit | None
) -> tuple[list[Choice], Usage]:
    """`op` of `job` on one endpoint (`who` names it in messages). Its BadInput is the request's own fault (another
    endpoint would say the same) and passes as is; a failure once a piece reached the client (or on cancel) is the
    request's RuntimeError; one before that is NotStarted, for the caller to try another endpoint."""
    started = False

    def relayed(*args: Any, **kw: Any) -> None:
        nonlocal started
        started = True
        if emit is not None:  # given only when it is (below)
            emit(*args, **kw)

    try:
        return getattr(client, op)(job, cancel, relayed if emit is not None else None)
    except BadInput:
        raise
    except Exception as exc:
        if started or cancel:
            raise RuntimeError(plain_failure(who, exc)) from None
        raise NotStarted(exc, plain_failure(who, exc)) from None


class RemoteEngine(Engine):
    """Jobs relayed to the least busy of the model's endpoints, failing over before the first token."""

    family = "remote"
    blocking = True

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.max_concurrency = config.param_int("concurrency") or 64
        self.down_s = config.param_float("down_s") or 30.0
        self.counters = PromptCounters()
        self.endpoints: list[Endpoint] = []
        self._lock = threading.Lock()

    def urls(self) -> list[str]:
        one = self.config.param_str("service_url")
        urls = self.config.param_strs("service_urls") + ([one] if one else [])
        if not urls:
            raise EngineLoadError("a remote model needs params.service_url or params.service_urls")
        return urls

    def load(self) -> None:
        urls = self.urls()
        try:
            clients = relay_clients(self.config, urls, "remote", self.counters)
        except ValueError as exc:
            raise EngineLoadError(f"params.service_url: {exc}") from None
        self.endpoints.extend(Endpoint(url, client) for url, client in zip(urls, clients, strict=True))
        # each endpoint asked once now: a model whose every endpoint is unreachable fails to load, saying why
        for e in self.endpoints:
            try:
                answer = e.client.http.get(e.client.prefix + "/v1/models")
                if answer.status >= 400:
                    raise RuntimeError(f"GET /v1/models answered {answer.status}")
            except Exception as exc:  # anything an endpoint does wrong marks it down, no more
                self._down(e, exc)
        if all(e.down_until for e in self.endpoints):
            reasons = "; ".join(f"{e.url}: {e.last_error}" for e in self.endpoints)
            raise EngineLoadError(f"no endpoint of {self.config.name} answers: {reasons}")

    def close(self) -> None:
        for e in self.endpoints:
            e.client.close()

    def stats(self) -> dict[str, Any]:
        return self.counters.stats()

    def _down(self, e: Endpoint, exc: BaseException) -> None:
        e.down_until = time.monotonic() + self.down_s
        e.last_error = f"{type(exc).__name__}: {exc}"[:300]

    def _order(self) -> list[Endpoint]:
        """Endpoints up now, least busy first; then those down, soonest back first (all down: try them anyway)."""
        now = time.monotonic()
        with self._lock:
            up = sorted((e for e in self.endpoints if e.down_until <= now), key=lambda e: e.in_flight)
            down = sorted((e for e in self.endpoints if e.down_until > now), key=lambda e: e.down_until)
        return up + down

    def _relay(self, op: str, job: Any, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        failures: list[str] = []
        for e in self._order():
            with self._lock:
                e.in_flight += 1
            try:
                return relay_once(e.client, f"remote {e.url}", op, job, cancel, emit)
            except NotStarted as failed:  # an endpoint's failure: the next one
                self._down(e, failed.cause)
                failures.append(str(failed))
            finally:
                with self._lock:
                    e.in_flight -= 1
        raise RuntimeError("no endpoint of this remote model answered: " + "; ".join(failures))

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        return relay_counted(self._relay, "chat", job, cancel, emit)

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        return relay_counted(self._relay, "complete", job, cancel, emit)


class _Counted:
    """An `emit` that also keeps the characters it passed on, for `counted` when the endpoint says no usage."""

    def __init__(self, emit: Emit) -> None:
        self.emit, self.chars = emit, 0

    def __call__(self, delta: dict[str, Any] | None, text: str | None, *rest: Any, **kw: Any) -> None:
        self.chars += len(text or "") + (len(msgspec.json.encode(delta)) if delta else 0)
        self.emit(delta, text, *rest, **kw)


def _tokens(chars: int) -> int:
    """Tokens in `chars` characters, as most tokenizers make them: about four characters each (at least one)."""
    return max(1, -(-chars // 4)) if chars else 0


def counted(
    job: ChatJob | CompletionJob, choices: list[Choice], usage: Usage, tap: _Counted | None = None
) -> tuple[list[Choice], Usage]:
    """The answer, with usage counted here when the endpoint reported none (a server that sends no usage, a stream
    without its usage event: no prompt tokens, which a real prompt never has): an answer must never be free because
    its server kept quiet. Estimated at four characters a token, of the prompt as sent and of what came back (a
    stream's pieces, where the relay counted them); an endpoint's own counts always win."""
    if usage.prompt_tokens:
        return choices, usage
    sent = job.messages if isinstance(job, ChatJob) else job.prompt
    prompt = _tokens(len(msgspec.json.encode(sent)))
    if tap is not None:
        answer = tap.chars
    else:
        answer = sum(len(c.text or "") + (len(msgspec.json.encode(c.message)) if c.message else 0) for c in choices)
    completion = usage.completion_tokens or _tokens(answer)
    return choices, msgspec.structs.replace(
        usage, prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


Relay = Callable[[str, Any, CancelFlag, "Emit | None"], tuple[list[Choice], Usage]]


def relay_counted(
    relay: Relay, op: str, job: ChatJob | CompletionJob, cancel: CancelFlag, emit: Emit | None
) -> tuple[list[Choice], Usage]:
    """`relay(op, job, cancel, emit)`'s answer, with usage `counted` when the server reported none."""
    tap = _Counted(emit) if emit is not None else None
    return counted(job, *relay(op, job, cancel, tap), tap)


def plain_failure(who: str, exc: BaseException) -> str:
    """A server's failure in one line (`who`: "remote <url>"): a malformed or oversized answer said as such, not as
    our bug."""
    if isinstance(exc, AnswerTooBig):
        return f"{who} sent {exc}"
    if isinstance(exc, (ValueError, KeyError, TypeError, IndexError)):
        return f"{who} sent a malformed answer ({type(exc).__name__})"
    return str(exc)[:500]
