"""A batch's input file, line by line: each line is checked as the request it holds would be, and a bad line is
named by its number; the output files come out in input order in OpenAI's shape."""

from __future__ import annotations

import json

import msgspec
import pytest

from coderai.contracts import ChatJob, EmbedJob
from coderai.gateway.batches import output, validation
from coderai.gateway.batches.records import BatchRecord, LineResult, batch_json, claim, due
from coderai.gateway.errors import ApiError

SERVED = {("tiny", "chat"), ("minilm", "embed")}


def check_model(model: str, op: str) -> None:
    if not any(m == model for m, _ in SERVED):
        raise ApiError(404, f"The model '{model}' does not exist.", param="model", code="model_not_found")
    if (model, op) not in SERVED:
        raise ApiError(400, f"The model '{model}' does not serve {op}.", param="model", code="unsupported_operation")


def jsonl(*lines: object) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


def chat(cid: str, model: str = "tiny", **body: object) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], **body},
    }


def parse(data: bytes, endpoint: str = "/v1/chat/completions"):
    return validation.parse(data, endpoint, check_model)


def test_good_lines_become_the_endpoints_jobs_in_order():
    lines, errors = parse(jsonl(chat("a", max_tokens=3), b"", chat("b", temperature=0)))
    assert errors == []
    assert [(ln.index, ln.custom_id, ln.op) for ln in lines] == [(0, "a", "chat"), (1, "b", "chat")]
    assert isinstance(lines[0].job, ChatJob) and lines[0].job.params.max_tokens == 3
    emb = {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"model": "minilm", "input": ["x"]}}
    [line], errors = parse(jsonl(emb), "/v1/embeddings")
    assert errors == [] and isinstance(line.job, EmbedJob) and line.job.input == ["x"]


def test_responses_lines_become_chat_jobs():
    line = {
        "custom_id": "r",
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "tiny", "input": "hello", "instructions": "be brief", "max_output_tokens": 4},
    }
    [ln], errors = parse(jsonl(line), "/v1/responses")
    assert errors == [] and ln.op == "chat" and ln.job.params.max_tokens == 4
    assert [m["role"] for m in ln.job.messages] == ["system", "user"]
    line["body"]["previous_response_id"] = "resp_1"
    _, [err] = parse(jsonl(line), "/v1/responses")
    assert err.code == "unsupported_parameter" and err.line == 1


@pytest.mark.parametrize(
    "bad, code, param",
    [
        (b"{not json", "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        ({"method": "POST", "url": "/v1/chat/completions", "body": {}}, "missing_required_parameter", "custom_id"),
        ({**chat("x"), "method": "GET"}, "invalid_method", "method"),
        ({**chat("x"), "url": "/v1/embeddings"}, "invalid_url", "url"),
        ({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}, "missing_required_parameter", "body"),
        (chat("x", stream=True), "invalid_request", "body.stream"),
        (chat("x", model="ghost"), "model_not_found", "body.model"),
        (chat("x", model="minilm"), "unsupported_operation", "body.model"),
        (chat("x", temperature=9), "invalid_request", "body"),
        (
            {**chat("x"), "body": {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}},
            "invalid_request",
            "body.messages[0].role",
        ),
    ],
)
def test_a_bad_line_is_named_by_its_number(bad, code, param):
    lines, [err] = parse(jsonl(chat("ok"), bad))
    assert [ln.custom_id for ln in lines] == ["ok"]
    assert (err.code, err.param, err.line) == (code, param, 2) and err.message


def test_custom_ids_are_unique_and_an_empty_file_is_an_error():
    _, [err] = parse(jsonl(chat("a"), chat("b"), chat("a")))
    assert err.code == "duplicate_custom_id" and err.line == 3
    assert [e.code for e in parse(b"\n \n")[1]] == ["empty_file"]


def test_the_files_are_in_input_order_each_line_once_in_openais_shape():
    def res(i: int, status: int | None, **kw) -> LineResult:
        body = msgspec.Raw(json.dumps({"n": i}).encode() if status else b"null")
        res = LineResult(
            index=i, custom_id=f"c{i}", id=f"batch_req_{i}", request_id=f"r{i}", status_code=status, body=body, **kw
        )
        return msgspec.json.decode(msgspec.json.encode(res), type=LineResult)  # as kept in the bucket

    results = {
        2: res(2, 200),
        0: res(0, 200),
        1: res(1, 400),
        3: res(3, None, error_code="batch_expired", error_message="too late"),
    }
    spool = output.Spool()
    for r in results.values():
        spool.add(r)
    (out_fh, _), (err_fh, _) = spool.file(True), spool.file(False)
    out, err = out_fh.read(), err_fh.read()
    spool.close()
    ok = [json.loads(x) for x in out.splitlines()]
    assert [x["custom_id"] for x in ok] == ["c0", "c2"]
    assert ok[0] == {
        "id": "batch_req_0",
        "custom_id": "c0",
        "error": None,
        "response": {"status_code": 200, "request_id": "r0", "body": {"n": 0}},
    }
    failed = [json.loads(x) for x in err.splitlines()]
    assert [x["custom_id"] for x in failed] == ["c1", "c3"]
    assert failed[0]["response"]["status_code"] == 400 and failed[0]["error"] is None
    assert failed[1]["response"] is None and failed[1]["error"] == {"code": "batch_expired", "message": "too late"}


def test_the_batch_object_and_takeover():
    rec = BatchRecord(
        id="batch_1",
        key_name="k",
        endpoint="/v1/embeddings",
        input_file_id="file-1",
        status="in_progress",
        created_at=1,
        expires_at=2,
        updated_at=1.0,
        total=3,
        completed=1,
    )
    body = batch_json(rec)
    assert body["object"] == "batch" and body["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert "errors" not in body and "output_file_id" not in body  # not set yet: left out, as OpenAI's schema says
    assert due(rec, 10, 5) and not due(rec, 1, 5)
    assert not due(msgspec.structs.replace(rec, status="completed"), 10, 5)
    taken = claim(rec, "me", 9.0)
    assert (taken.runner, taken.takeovers, taken.status) == ("me", 1, "in_progress")
    dead = claim(msgspec.structs.replace(rec, takeovers=5), "me", 9.0)
    assert dead.status == "failed" and dead.errors[-1].code == "runner_lost"


def test_a_node_holding_a_chat_model_may_pull_its_batch_lines():
    from coderai.contracts import ModelConfig
    from coderai.contracts.work import work_consumer, work_consumers
    from coderai.runtime import members

    held = [
        ModelConfig(name="tiny", engine="llama", path="/m.gguf", ops=["chat"]),
        ModelConfig(name="minilm", engine="embed", path="/m", ops=["embed"], distribute={"enabled": False}),
    ]
    assert work_consumers(held) == sorted([work_consumer("tiny", "chat"), work_consumer("minilm", "embed")])
    pub = members.node_permissions("n1", work_consumers(held))["publish"]["allow"]
    assert f"$JS.API.CONSUMER.MSG.NEXT.WORK.{work_consumer('tiny', 'chat')}" in pub
    assert not any("coderai_batch" in p for p in pub)  # the batches' buckets are the gateway's alone
