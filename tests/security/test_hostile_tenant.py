"""A tenant probes another tenant's prompt through the shared prompt cache (issue 40, item 8).

Real stack: a gateway with two tenant keys (alice, bob) and `CODERAI_GATEWAY_SHARE_CACHE=false` (a multi-tenant
gateway), a worker running three real `llama-server` children of the tiny GGUF:

- `ls-private`: the model says `share_cache = false`: its server has no host RAM cache and the worker places each
  key's requests in slots (`id_slot`), reusing a slot's prefix only for the key that left it;
- `ls-default`: says nothing, so the gateway's default (off) scopes it; its server keeps its RAM cache (one pool for
  every slot), so the worker turns prefix reuse off on it altogether;
- `ls-shared`: says `share_cache = true`: today's fast path, one cache for every key.

The attack (as the issue's author ran it): alice sends her long system prompt; bob sends a wrong guess, then the
right one, then another wrong one, and reads `usage.prompt_tokens_details.cached_tokens`. Before the fix llama-server
put bob's right guess in alice's slot and answered about as many cached tokens as her system prompt has.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

ALICE, BOB, ADMIN = "sk-tenant-alice-0123456789", "sk-tenant-bob-0123456789", "sk-tenant-admin-0123456789"
# alice's system prompt: ~1,000 tokens of the tiny model, a secret in the middle
SECRET = (
    " ".join(f"alpha{j}" for j in range(120))
    + " the discount code is ZEBRA-42 "
    + " ".join(f"omega{j}" for j in range(120))
)
# bob's guesses begin with other words, so each shares with the one before it only the chat template's opening
WRONG_1 = " ".join(f"beta{j}" for j in range(240))
WRONG_2 = " ".join(f"gamma{j}" for j in range(240))
QUESTION = "Hello, what can you do?"  # a product's usual first question
MODELS = ("ls-private", "ls-default", "ls-shared")


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, tiny_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    root = tmp_path_factory.mktemp("tenants")
    keys = root / "keys.toml"
    write_keys(
        str(keys),
        [
            KeyRecord("admin", hash_key(ADMIN), ["inference", "admin"]),
            KeyRecord("alice", hash_key(ALICE), ["inference"]),
            KeyRecord("bob", hash_key(BOB), ["inference"]),
        ],
    )
    params = {"parallel": 2, "n_ctx": 2048, "n_threads": 1}
    models = [
        {
            "name": "ls-private",
            "engine": "llama-server",
            "path": str(tiny_gguf),
            "share_cache": False,
            "params": params,
        },
        {"name": "ls-default", "engine": "llama-server", "path": str(tiny_gguf), "params": params},
        {"name": "ls-shared", "engine": "llama-server", "path": str(tiny_gguf), "share_cache": True, "params": params},
    ]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with running_stack(
        root,
        models,
        gateway_args=("--api-keys-file", str(keys)),
        headers=admin,
        extra_env={"CODERAI_GATEWAY_SHARE_CACHE": "false", "CODERAI_WORKER_FAMILIES": "llama-server"},
    ) as s:
        s.wait_engines_ready(list(MODELS), headers=admin, timeout_s=300)
        yield s


ROUTES: dict[tuple[str, str, str], str] = {}  # (key, model, system prompt's first word) -> the Coderai-Route answered


def _ask(stack, key: str, model: str, system: str, question: str) -> tuple[int, int]:
    """One chat of `key`: (prompt tokens, cached tokens) from its usage; its Coderai-Route header into ROUTES."""
    r = httpx.post(
        f"{stack.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
        json={
            "model": model,
            "max_tokens": 1,
            "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        },
    )
    assert r.status_code == 200, r.text
    ROUTES[(key, model, system.split()[0])] = r.headers.get("Coderai-Route", "")
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _probe(stack, model: str) -> dict[str, tuple[int, int]]:
    """Alice's prompt, then bob's three guesses: each one's (prompt, cached) tokens."""
    seen = {"alice": _ask(stack, ALICE, model, SECRET, QUESTION)}
    seen["bob wrong 1"] = _ask(stack, BOB, model, WRONG_1, QUESTION)
    seen["bob right"] = _ask(stack, BOB, model, SECRET, QUESTION)  # her whole conversation: her affinity key too
    seen["bob wrong 2"] = _ask(stack, BOB, model, WRONG_2, QUESTION)
    for who, (prompt, cached) in seen.items():
        print(f"  {model}: {who:12s} prompt {prompt:5d} tokens, cached {cached:5d}")
    return seen


@pytest.mark.parametrize("model", ["ls-private", "ls-default"])
def test_a_tenant_cannot_read_another_s_prompt_from_the_cache(tenants, model):
    print(
        f"tried: bob guesses alice's {len(SECRET.split())}-word system prompt on {model} "
        f"(share_cache off) and reads cached_tokens"
    )
    seen = _probe(tenants, model)
    prompt, right = seen["bob right"]
    wrong = seen["bob wrong 2"][1]
    routes = ROUTES[(BOB, model, SECRET.split()[0])], ROUTES[(BOB, model, WRONG_2.split()[0])]
    print(f"  Coderai-Route of bob's right guess: {routes[0]}, of a wrong one: {routes[1]}")
    assert prompt > 500  # the guess is long enough that a hit would show
    # a hit would be ~ the whole system prompt; what bob sees is what his own previous guess explains, the same
    # for the right guess as for a wrong one
    assert right == wrong, f"bob's right guess reused {right} cached tokens against {wrong} for a wrong one"
    assert right < 32
    # nor does the router's answer tell: a right guess routed by alice's affinity entry says `prefix`
    assert routes[0] == routes[1] != "prefix"
    print(f"refused: bob's right guess shows {right} cached tokens, a wrong guess {wrong}")
    assert _ask(tenants, ALICE, model, "Be brief.", "Hi")[0] > 0  # the stack still serves
    print("the stack still serves")


def _cache_ram_flags() -> dict[str, str]:
    """Each running llama-server's alias -> its --cache-ram, from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        try:
            argv = [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if argv and argv[0].endswith("llama-server") and "--alias" in argv and "--cache-ram" in argv:
            out[argv[argv.index("--alias") + 1]] = argv[argv.index("--cache-ram") + 1]
    return out


def test_a_private_model_s_server_has_no_shared_ram_cache(tenants):
    flags = _cache_ram_flags()
    print(f"--cache-ram of each server: {flags}")
    assert flags["ls-private"] == "0"
    assert int(flags["ls-default"]) > 0 and int(flags["ls-shared"]) > 0  # the fast path keeps it


def test_the_same_key_still_hits_its_own_cache_on_a_private_model(tenants):
    """The per-key slot: alice's second question after her system prompt reuses it."""
    _ask(tenants, ALICE, "ls-private", SECRET, "first question")
    _ask(tenants, BOB, "ls-private", WRONG_1, "bob in between")  # another key's request takes the other slot
    prompt, cached = _ask(tenants, ALICE, "ls-private", SECRET, "second question")
    print(f"ls-private: alice's second request: prompt {prompt}, cached {cached}")
    assert cached > prompt // 2


def test_a_shared_model_keeps_one_cache_for_every_key(tenants):
    """share_cache = true (the single-tenant default): the fast path, a common prefix computed once for all."""
    _ask(tenants, ALICE, "ls-shared", SECRET, "first question")
    prompt, cached = _ask(tenants, ALICE, "ls-shared", SECRET, "second question")
    print(f"ls-shared: alice's second request: prompt {prompt}, cached {cached}")
    assert cached > prompt // 2
    prompt, cached = _ask(tenants, BOB, "ls-shared", SECRET, "bob's question")
    print(f"ls-shared: bob with the same prefix: prompt {prompt}, cached {cached}")
    assert cached > prompt // 2
