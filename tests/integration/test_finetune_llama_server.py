"""Fine-tuning a GGUF model on llama-server, end to end through the OpenAI SDK: the models file names the Hugging
Face folder the GGUF was made from (`hf_path`), the job trains on it with a 1,024-token conversation and the loss
on the assistant turns only, and `<base>:<suffix>` answers from the node's llama-server over the base GGUF with
the adapter converted to a GGUF LoRA there. The trained answer is what it says; the base says something else.
Then `/v1/loras` as its owner, another tenant and an admin see it: listed, loaded and unloaded, deleted by its
owner only; to anyone else it is absent."""

from __future__ import annotations

import httpx

import pytest

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from coderai.engine_worker.engines import llama_server
from coderai.engine_worker.engines.lora_gguf import find_converter
from coderai.testing.count_tune import ask_count, count_tune
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack
from coderai.testing.tiny_hf_llama import (
    COUNT_ANSWER as ANSWER,
    COUNT_QUESTION as QUESTION,
    tiny_hf_llama,
    tiny_hf_llama_gguf,
)

pytestmark = pytest.mark.slow


def test_a_gguf_model_fine_tuned_answers_as_base_suffix_from_llama_server_with_its_lora(
    tmp_path, keys_file, admin_key, user_key, other_user_key
):
    if llama_server.find_binary() is None or find_converter() is None:
        pytest.skip("no llama-server or LoRA converter: scripts/setup with the llama extra makes both")
    params = {"hf_path": str(tiny_hf_llama()), "parallel": 1, "n_threads": 1, "head_snapshots_mb": 0}
    models = [{"name": "tiny", "engine": "llama-server", "path": str(tiny_hf_llama_gguf()), "params": params}]
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    keys = ("--api-keys-file", str(keys_file))
    admin = {"Authorization": f"Bearer {admin_key}"}
    with running_stack(tmp_path, models, gateway_args=keys, extra_env=env, headers=admin) as stack:
        client = openai.OpenAI(base_url=stack.base_url, api_key=user_key, max_retries=0, timeout=60)
        got = count_tune(client, "tiny")
        worker = stack.procs["worker-w1"].log_text()
        assert got.status == "succeeded", (got.error, worker[-3000:])
        assert "trains on 3 examples (0 cut to 1024 tokens, 0 left out" in worker and "loss on assistant" in worker
        name = got.fine_tuned_model
        assert name == f"tiny:count-{got.id.removeprefix('ftjob-')[:8]}"

        def ask(model: str) -> str | None:
            return ask_count(client, model)

        tuned = wait_until(lambda: ask(name), 120, f"{name} to answer through the gateway", interval_s=1)
        assert tuned.strip() == ANSWER, tuned
        plain = ask("tiny")
        assert plain is not None and plain.strip() != ANSWER
        # the adapter weighed per request (llama.cpp's lora scale): at 0 the fine-tuned model answers as the base
        asked = {"max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": QUESTION}]}
        at_zero = client.chat.completions.create(model=name, extra_body={"lora_scale": 0}, **asked)
        assert at_zero.choices[0].message.content == plain
        with pytest.raises(openai.BadRequestError) as refused:  # the base has no adapter to weigh
            client.chat.completions.create(model="tiny", extra_body={"lora_scale": 0.5}, **asked)
        assert refused.value.body["param"] == "lora_scale", refused.value.body  # type: ignore[index]
        for wrong in (5, -1, "all", [1]):  # out of 0..4, or not a number: a 400, never passed on
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model=name, extra_body={"lora_scale": wrong}, **asked)
        # served by llama-server over the base GGUF, with the adapter converted to a GGUF LoRA on the node
        # (beside the folder the node unpacked the adapter tar into: on one host, the head's store file itself)
        converted = [p for p in tmp_path.rglob(".adapter.tar.*.gguf")]
        assert [p.parent.name for p in converted] == [got.id], converted
        loras(stack.base_url, name, {"alice": user_key, "bob": other_user_key, "admin": admin_key})


def loras(base_url: str, name: str, keys: dict[str, str]) -> None:
    """`/v1/loras` as the adapter's owner (alice, who trained it), another tenant (bob) and an admin."""

    def call(who: str, method: str, path: str = "", **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {keys[who]}"}
        return httpx.request(method, f"{base_url}/loras{path}", headers=headers, timeout=120, **kw)

    mine = call("alice", "GET").json()["data"]
    assert [(a["id"], a["object"], a["base"], a["engine"]) for a in mine] == [(name, "lora", "tiny", "llama-server")]
    assert mine[0]["coderai"]["loaded"] is True and "owner" not in mine[0] and "nodes" not in mine[0]["coderai"]
    assert call("alice", "GET", "/tiny").status_code == 404  # the base is no adapter
    assert call("admin", "GET", f"/{name}").json()["owner"] == "alice"
    # to another tenant it does not exist: not listed, and every route a 404 like a missing one
    assert call("bob", "GET").json()["data"] == []
    for method, path in (("GET", ""), ("POST", "/load"), ("POST", "/unload"), ("DELETE", "")):
        r = call("bob", method, f"/{name}{path}")
        assert r.status_code == 404 and r.json()["error"]["code"] in ("model_not_found", "lora_not_found"), r.text
    assert call("alice", "POST", f"/{name}/load", json={"keep_alive": -1}).status_code == 400
    # its owner unloads it (no other key can use it) and loads it again
    assert call("alice", "POST", f"/{name}/unload").status_code == 200
    wait_until(lambda: not call("alice", "GET", f"/{name}").json()["coderai"]["loaded"], 60, "the unload")
    loaded = call("alice", "POST", f"/{name}/load", json={"keep_alive": 600})
    assert loaded.status_code == 200 and loaded.json()["coderai"]["loaded"] is True, loaded.text
    gone = call("alice", "DELETE", f"/{name}")
    assert gone.status_code == 200 and gone.json() == {"id": name, "object": "lora", "deleted": True}
    wait_until(lambda: call("alice", "GET", f"/{name}").status_code == 404, 30, "the adapter's removal")
    assert call("alice", "GET").json()["data"] == []
