"""Models changed while a real stack runs (a worker, a tiny GGUF): added over the admin API and asked with the
`openai` SDK, removed while a request to it streams (it finishes; the next one is a 404), added by editing the
models file, and added, changed and removed with `coderai models`. Nothing is restarted."""

from __future__ import annotations

import subprocess
import sys
import threading

import openai
import pytest

from coderai.models_file import load_models
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow

LONG = 1000  # tokens of the request in flight when its model is removed: ~20 s on two busy cores


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf, keys_file, admin_key):
    models = [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}}]
    # a long drain: the request in flight when its model is removed finishes however slow this machine is; debug
    # logs: the worker says when a job starts
    with running_stack(
        tmp_path_factory.mktemp("live"),
        models,
        gateway_args=("--api-keys-file", str(keys_file)),
        extra_env={"CODERAI_WORKER_DRAIN_TIMEOUT_S": "300", "CODERAI_WORKER_LOG_LEVEL": "DEBUG"},
        headers={"Authorization": f"Bearer {admin_key}"},
    ) as s:
        yield s


@pytest.fixture
def client(stack, admin_key):
    return openai.OpenAI(base_url=stack.base_url, api_key=admin_key, max_retries=0, timeout=60)


def answers(client: openai.OpenAI, model: str):
    """A one-token answer from `model`, or None while it is unknown or not loaded yet."""
    try:
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    except (openai.NotFoundError, openai.APIStatusError):
        return None


def is_404(client: openai.OpenAI, model: str) -> bool:
    try:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    except openai.NotFoundError as exc:
        return exc.body["code"] == "model_not_found"
    return False


def test_a_model_added_over_the_admin_api_answers_within_10_s(stack, admin, client, tiny_gguf):
    cfg = {"name": "added", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 512}}
    assert is_404(client, "added")
    r = admin.post("/admin/models", json=cfg)
    assert r.status_code == 201, r.text
    assert r.json()["model"] == cfg
    assert wait_until(lambda: answers(client, "added"), 10, "the added model to answer").model == "added"
    assert "added" in {m.id for m in client.models.list()}
    shown = wait_until(
        lambda: (d := admin.get("/admin/models/added").json())["nodes"] == [{"node_id": "w1", "state": "ready"}] and d,
        10,
        "the added model to show as ready on w1",
    )
    assert shown["model"] == cfg and shown["unplaced"] == ""
    assert {m.name for m in load_models(str(stack.root / "models.toml"))} == {"tiny", "added"}  # kept for a restart

    r = admin.post("/admin/models", json=cfg)
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_exists"
    r = admin.post("/admin/models", json={**cfg, "engine": "llamas"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "engine"
    r = admin.put("/admin/models/added", json={"engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 1024}})
    assert r.status_code == 200 and r.json()["model"]["params"] == {"n_ctx": 1024}
    wait_until(
        lambda: admin.get("/admin/models/added").json()["model"]["params"] == {"n_ctx": 1024},
        10,
        "the gateway to see the replaced config",
    )
    assert wait_until(lambda: answers(client, "added"), 30, "the replaced model to answer again")
    assert admin.delete("/admin/models/added").status_code == 200
    assert admin.delete("/admin/models/added").status_code == 404
    assert admin.get("/admin/models/pulled").status_code != 400  # the catalogue's route is still its own


def test_a_model_removed_mid_request_finishes_that_request_then_is_a_404(stack, admin, client, tiny_gguf):
    cfg = {"name": "doomed", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 4096}}
    assert admin.post("/admin/models", json=cfg).status_code == 201
    wait_until(lambda: answers(client, "doomed"), 30, "doomed to answer")
    worker = stack.procs["worker-w1"]
    mark = len(worker.log_text())
    result: dict = {}

    def call() -> None:
        try:
            result["reply"] = client.with_options(timeout=600).chat.completions.create(
                model="doomed", messages=[{"role": "user", "content": "go on"}], max_tokens=LONG, temperature=0
            )
        except openai.APIError as exc:
            result["error"] = exc

    t = threading.Thread(target=call)
    t.start()
    worker.wait_log('"msg": "chat job started"', 30, after=mark)  # in flight on the worker now
    r = admin.delete("/admin/models/doomed")
    assert r.status_code == 200 and r.json() == {"model": cfg, "deleted": True}
    wait_until(lambda: is_404(client, "doomed"), 10, "new requests for doomed to be refused")
    assert t.is_alive(), "the request in flight ended before the removal was checked: give it more tokens"
    t.join(600)
    reply = result.get("reply")
    assert reply is not None, result  # a 200, answered whole
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == LONG
    assert is_404(client, "doomed")
    wait_until(
        lambda: (
            not any(
                e["model"] == "doomed"
                for n in admin.get("/admin/nodes").json()["nodes"]
                for e in n["heartbeat"].get("engines", [])
            )
        ),
        30,
        "the worker to unload doomed",
    )


def test_an_edited_models_file_adds_a_model_that_answers(stack, client, tiny_gguf):
    with open(stack.root / "models.toml", "a") as fh:
        fh.write(
            f'\n[[models]]  # added by hand\nname = "edited"\nengine = "llama"\npath = "{tiny_gguf}"\n'
            "params = { n_ctx = 512 }\n"
        )
    assert wait_until(lambda: answers(client, "edited"), 30, "the model added to the file to answer").model == "edited"


def models_cli(stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "coderai.cli",
            "models",
            "--data-dir",
            str(stack.root / "cli"),
            *args,
            "--nats-url",
            stack.nats_url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_coderai_models_add_set_rm_on_the_running_stack(stack, admin, client, tiny_gguf):
    r = models_cli(
        stack,
        "add",
        "by-cli",
        "--engine",
        "llama",
        "--path",
        str(tiny_gguf),
        "--param",
        "n_ctx=512",
        "--keep-alive",
        "600",
    )
    assert r.returncode == 0 and "the running stack serves it" in r.stdout, r.stderr
    wait_until(lambda: answers(client, "by-cli"), 30, "the model added with the CLI to answer")
    r = models_cli(stack, "add", "by-cli", "--engine", "llama", "--path", str(tiny_gguf))
    assert r.returncode == 1 and "served already" in r.stderr
    r = models_cli(stack, "set", "by-cli", "params.n_ctx=1024", "resident=always")
    assert r.returncode == 0, r.stderr
    wait_until(
        lambda: admin.get("/admin/models/by-cli").json()["model"].get("resident") == "always", 10, "the change to show"
    )
    [m] = [m for m in load_models(str(stack.root / "models.toml")) if m.name == "by-cli"]
    assert (m.params, m.resident, m.keep_alive_s) == ({"n_ctx": 1024}, "always", 600.0)
    r = models_cli(stack, "rm", "by-cli")
    assert r.returncode == 0 and "stopped serving by-cli" in r.stdout, r.stderr
    wait_until(lambda: is_404(client, "by-cli"), 10, "by-cli to be gone")
    assert not (stack.root / "cli" / "models.toml").exists()  # the stack's scheduler wrote its own file


def test_an_admin_key_cannot_pass_a_server_flag_or_a_program(stack, admin, client, tiny_gguf):
    """Attack: an admin key is not a shell. Params that would bind the child on every interface, write a file,
    run a repository's code or another program, or any flag the family does not take, are a 400 naming the param;
    nothing is added and the stack still serves."""
    for params in (
        {"host": "0.0.0.0"},
        {"log_file": "/tmp/coderai-pwned"},
        {"trust_remote_code": True},
        {"python": "/tmp/evil"},
        {"env": {"LD_PRELOAD": "/tmp/x.so"}},
        {"extra_args": ["--host", "0.0.0.0"]},
        {"no_such_flag": 1},
    ):
        cfg = {"name": "evil", "engine": "llama-server", "path": str(tiny_gguf), "params": params}
        for r in (admin.post("/admin/models", json=cfg), admin.put("/admin/models/evil", json=cfg)):
            name = next(iter(params))
            print(f"{r.request.method} /admin/models with params.{name}: {r.status_code}")
            assert r.status_code == 400 and r.json()["error"]["param"] == f"params.{name}", r.text
    assert admin.get("/admin/models/evil").status_code == 404
    assert answers(client, "tiny") is not None


def test_a_stuck_load_never_blocks_its_node(stack, admin, client, tiny_gguf, tmp_path):
    """A model whose server never becomes healthy (its file a FIFO nobody writes: llama-server waits on it forever,
    answering 503 "Loading model"), deleted while it loads: its load is cancelled and its server stopped at once,
    and a model added meanwhile loads and answers, instead of waiting out the 600 s load timeout."""
    import os
    import shutil

    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    fifo = tmp_path / "stuck.gguf"
    os.mkfifo(fifo)

    def stuck_children() -> list[int]:
        out = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if str(fifo).encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    out.append(int(pid))
            except OSError:
                pass
        return out

    stuck = {
        "name": "stuck",
        "engine": "llama-server",
        "path": str(fifo),
        "params": {"n_ctx": 256, "load_timeout_s": 600},
    }
    assert admin.post("/admin/models", json=stuck).status_code == 201
    wait_until(stuck_children, 60, "the stuck model's server to start")
    later = {
        "name": "later",
        "engine": "llama",
        "path": str(shutil.copy(tiny_gguf, tmp_path / "later.gguf")),
        "params": {"n_ctx": 256},
    }
    assert admin.post("/admin/models", json=later).status_code == 201
    assert admin.delete("/admin/models/stuck").status_code == 200
    wait_until(lambda: not stuck_children(), 30, "the stuck model's server to be stopped once it was deleted")
    assert wait_until(lambda: answers(client, "later"), 60, "the model added meanwhile to answer")
    print("a load stuck on a FIFO, deleted: its server stopped, and a model added meanwhile answered")
    assert admin.delete("/admin/models/later").status_code == 200
