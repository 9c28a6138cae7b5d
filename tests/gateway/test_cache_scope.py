"""Tenants' caches (issue 40, item 8): who shares the prompt cache, and affinity keys scoped by key when not.

Pure: `cache_scope` decides from the model's, the key's and the gateway's `share_cache`; `scoped` re-keys a route;
the router's own `pick` then never sends key B after key A's prefix.
"""

from __future__ import annotations

import pytest

from coderai.contracts import EngineStatus, ModelConfig, RouteRequest
from coderai.contracts.routing import AffinityEntry
from coderai.gateway.affinity import cache_scope, chat_chain, scoped, session_key, user_key
from coderai.router.picking import EngineTable, keys_to_record, pick
from coderai.testing.heartbeats import heartbeat

SYSTEM = {"role": "system", "content": "You are the support bot of ACME. Secret discount code: ZEBRA-42."}
USER = {"role": "user", "content": "hi"}


def route(prefix: list[str], session: str = "", user: str = "") -> RouteRequest:
    return RouteRequest(request_id="r", model="m", op="chat", prefix=prefix, session=session, user=user)


@pytest.mark.parametrize(
    ("model", "key", "default", "shared"),
    [
        (None, None, True, True),  # a single-tenant box: today's behaviour
        (None, None, False, False),  # a multi-tenant gateway's default
        (True, None, False, True),  # the model says share
        (None, True, False, True),  # the key says share
        (False, None, True, False),  # the model says private, whatever the default
        (None, False, True, False),  # the key says private
        (False, True, True, True),  # either saying true shares (the "unless the model or key says")
        (True, False, False, True),
        (False, False, True, False),
    ],
)
def test_who_shares_the_cache(model, key, default, shared):
    scope = cache_scope("tenant-a", model, key, default)
    assert (scope == "") is shared
    print(f"model={model} key={key} default={default}: scope={scope[:8] or '(shared)'}")


def test_a_scope_is_one_opaque_digest_per_key():
    a, b = cache_scope("tenant-a", False, None, True), cache_scope("tenant-b", False, None, True)
    assert a == cache_scope("tenant-a", None, False, True)  # the same key, however it came to be private
    assert a != b
    assert "tenant" not in a and len(a) == 32


def test_a_shared_route_is_unchanged():
    r = route(chat_chain("m", [SYSTEM, USER]), session_key("m", "s1"), user_key("m", "u1"))
    assert scoped(r, "") is r


def test_scoped_routes_of_two_keys_share_no_affinity_key():
    chain = chat_chain("m", [SYSTEM, USER, {"role": "assistant", "content": "hello"}, USER])
    r = route(chain, session_key("m", "same-session"), user_key("m", "same-user"))
    a = scoped(r, cache_scope("tenant-a", False, None, True))
    b = scoped(r, cache_scope("tenant-b", False, None, True))
    keys_a = {a.session, a.user, *a.prefix}
    keys_b = {b.session, b.user, *b.prefix}
    assert not keys_a & keys_b
    assert not keys_a & {r.session, r.user, *r.prefix}  # nor with the shared pool's
    assert len(a.prefix) == len(chain) and "" not in a.prefix
    # the same key's next request keeps its own chain: its affinity (and so its cache hits) still work
    again = scoped(route(chain[:2], r.session, r.user), cache_scope("tenant-a", False, None, True))
    assert again.prefix == a.prefix[:2] and again.session == a.session


def test_empty_keys_stay_empty():
    r = scoped(route([]), cache_scope("tenant-a", False, None, True))
    assert (r.session, r.user, r.prefix) == ("", "", [])


def _engine(eid: str, in_flight: int) -> EngineStatus:
    return EngineStatus(
        engine_id=eid, model="m", engine="llama-server", ops=["chat"], state="ready", in_flight=in_flight
    )


def test_the_router_never_steers_key_b_to_key_a_s_warm_engine():
    """Key A's conversation warmed engine A (busier than B, within the load guard); key B sends A's exact prefix:
    with scoped keys the router knows nothing of B's chain and picks by load, while A's own next turn still goes
    to A."""
    t = EngineTable()
    t.apply(
        heartbeat("n1", ["llama-server"], engines=[_engine("A", 1)]),
        now=0.0,
    )
    t.apply(
        heartbeat("n2", ["llama-server"], engines=[_engine("B", 0)]),
        now=0.0,
    )
    cfg = ModelConfig(name="m", engine="llama-server", path="/m.gguf", share_cache=False)
    chain = chat_chain("m", [SYSTEM, USER])
    scope_a, scope_b = cache_scope("tenant-a", False, None, True), cache_scope("tenant-b", False, None, True)
    affinity: dict[str, AffinityEntry] = {}
    a = scoped(route(chain), scope_a)
    for key in keys_to_record(a):
        affinity[key] = AffinityEntry(engine_id="A", node_id="n1", ts=100.0)

    shared = pick(
        t,
        route(chain),
        affinity={k: AffinityEntry(engine_id="A", node_id="n1", ts=100.0) for k in keys_to_record(route(chain))},
        model=cfg,
        now=100.0,
    )
    assert (shared.engine_id, shared.reason) == ("A", "prefix")  # unscoped, B would have been sent to A

    b = pick(t, scoped(route(chain), scope_b), affinity=affinity, model=cfg, now=100.0)
    print(f"key B with key A's prefix: engine {b.engine_id} ({b.reason})")
    assert (b.engine_id, b.reason) == ("B", "least_busy")
    again = pick(t, scoped(route(chain), scope_a), affinity=affinity, model=cfg, now=100.0)
    assert (again.engine_id, again.reason) == ("A", "prefix")


def test_the_setting_is_read_from_a_models_file_the_admin_api_and_a_key(tmp_path):
    import msgspec

    from coderai.accounts.keys import ApiKey, _from_hash, _to_hash
    from coderai.models_file import load_models, write_models_file

    path = write_models_file(
        tmp_path / "models.toml",
        [
            {"name": "private", "engine": "llama-server", "path": "/m.gguf", "share_cache": False},
            {"name": "unset", "engine": "llama-server", "path": "/m.gguf"},
        ],
    )
    assert [m.share_cache for m in load_models(str(path))] == [False, None]
    body = b'{"name": "m", "engine": "llama-server", "path": "/m.gguf", "share_cache": true}'
    assert msgspec.json.decode(body, type=ModelConfig).share_cache is True  # what POST /admin/models reads
    for share in (None, True, False):  # a Redis key's record keeps it through its hash
        rec = ApiKey(name="k", sha256="0" * 64, share_cache=share)
        assert _from_hash({k.encode(): v.encode() for k, v in _to_hash(rec).items()}).share_cache is share


@pytest.mark.parametrize("engine", ["vllm", "llama-server"])
def test_a_job_for_an_engine_that_reports_its_cache_carries_its_scoped_affinity_keys(engine):
    """vLLM's worker says which keys' prompts its cache dropped (engines/kv_events.py): its jobs carry the keys the
    pick is remembered under, scoped as the router sees them; other engines' jobs carry none (bytes on every
    request for nothing)."""
    from types import SimpleNamespace

    from coderai.contracts import ChatJob
    from coderai.gateway.pipeline_admit import scope_cache

    chain = chat_chain("m", [SYSTEM, USER, {"role": "assistant", "content": "hello"}, USER])
    call = SimpleNamespace(
        who=SimpleNamespace(key=None, key_name="tenant-a"),
        gw=SimpleNamespace(settings=SimpleNamespace(share_cache=False)),
        route=route(chain, session=session_key("m", "s1")),
        job=ChatJob(request_id="r", model="m", messages=[SYSTEM, USER]),
    )
    scope_cache(call, ModelConfig(name="m", engine=engine, path="/m"))
    assert call.job.cache_scope == cache_scope("tenant-a", None, None, False)
    if engine == "vllm":
        assert call.job.cache_keys == keys_to_record(call.route) and len(call.job.cache_keys) == 3
        assert not set(call.job.cache_keys) & set(chain), "scoped: not the unscoped chain's digests"
    else:
        assert call.job.cache_keys == []


def test_a_client_cannot_name_cache_keys_or_a_scope():
    """The keys a vLLM worker reports evictions for are the gateway's alone: a client's `cache_keys` (say another
    tenant's digests, to have their affinity dropped) or `cache_scope` in the body never reach the job."""
    import msgspec

    from coderai.gateway.openai.chat_types import (
        ChatCompletionRequest,
        CompletionRequest,
        chat_job,
        completion_job,
    )

    body = {"model": "m", "messages": [USER], "cache_keys": ["victim"], "cache_scope": "someone-else"}
    job = chat_job(msgspec.convert(body, ChatCompletionRequest), "r")
    assert job.cache_keys == [] and job.cache_scope == ""
    body = {"model": "m", "prompt": "hi", "cache_keys": ["victim"], "cache_scope": "someone-else"}
    job = completion_job(msgspec.convert(body, CompletionRequest), "r")
    assert job.cache_keys == [] and job.cache_scope == ""
