"""Affinity keys for a request, strongest first: explicit session, OpenAI `user`, then a prefix chain.

Pure functions. Keys are digests, so the router and the `coderai_affinity` bucket never see message text, and
every key includes the model (one conversation on two models is two caches).

Chat: h1 = H(model, tools, every message up to and including the first user message: system prompt,
few-shot turns); h(k+1) = H(h(k), message k+1) for every message after that, assistant and tool turns included. A request that extends an earlier one shares its whole chain, so
the longest element the router knows points at the engine whose cache holds that much of the conversation.
Tools (they are part of the prompt the model sees) go into h1; image parts go into the message they belong to.

Completions: the prompt is cut into fixed-size character chunks; element k covers chunks 1..k.

Tenants: unless the cache is shared (`share_cache`, see `cache_scope`), every key is hashed once more with the
caller's scope (a digest of its key name), so one key's conversation never points another key at the engine that
holds its prefix: a cache hit could reveal the other key's prompt.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from coderai.contracts.routing import RouteRequest

CHUNK_CHARS = 512
MAX_CHAIN = 64  # longer chains keep h1 and their last 63 elements: enough to contain the previous turn's last

_enc = msgspec.json.Encoder(order="deterministic")


def _h(*parts: bytes) -> str:
    d = hashlib.blake2b(digest_size=16)
    for p in parts:
        d.update(len(p).to_bytes(8, "little"))
        d.update(p)
    return d.hexdigest()


def session_key(model: str, session: str | None) -> str:
    return _h(b"session", model.encode(), session.encode()) if session else ""


def user_key(model: str, user: str | None) -> str:
    return _h(b"user", model.encode(), user.encode()) if user else ""


def chat_chain(model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[str]:
    """h1..hn over the conversation (see the module doc). Empty when there is no user message."""
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is None:
        return []
    h = _h(b"chat", model.encode(), _enc.encode(tools or []), *(_enc.encode(m) for m in messages[: first_user + 1]))
    chain = [h]
    for m in messages[first_user + 1 :]:
        h = _h(h.encode(), _enc.encode(m))
        chain.append(h)
    return _bound(chain)


def prompt_chain(model: str, prompt: str | list[str], chunk_chars: int = CHUNK_CHARS) -> list[str]:
    """One element per full chunk of the prompt (a partial last chunk is too unstable to key on); a list of
    prompts is keyed on its first."""
    if isinstance(prompt, list):
        prompt = prompt[0]
    chain: list[str] = []
    h = _h(b"complete", model.encode())
    for i in range(chunk_chars, len(prompt) + 1, chunk_chars):
        h = _h(h.encode(), prompt[i - chunk_chars : i].encode())
        chain.append(h)
    return _bound(chain)


def _bound(chain: list[str]) -> list[str]:
    return chain if len(chain) <= MAX_CHAIN else chain[:1] + chain[-(MAX_CHAIN - 1) :]


def cache_scope(key_name: str, model_share: bool | None, key_share: bool | None, default: bool) -> str:
    """The scope a request's cached prompt belongs to: "" when it may share the cache with every other key (the
    model or the key says `share_cache = true`, or neither says and the gateway's default shares), else an opaque
    digest of the key name (the same for every request of that key)."""
    if model_share is True or key_share is True:
        return ""
    if model_share is None and key_share is None and default:
        return ""
    return _h(b"scope", key_name.encode())


def scoped(route: RouteRequest, scope: str) -> RouteRequest:
    """`route` with every affinity key (session, user, each prefix element) keyed by `scope` too; unchanged when
    the scope is "" (shared)."""
    if not scope:
        return route
    s = scope.encode()

    def one(key: str) -> str:
        return _h(b"scoped", s, key.encode()) if key else ""

    return msgspec.structs.replace(
        route, session=one(route.session), user=one(route.user), prefix=[one(k) for k in route.prefix]
    )
