"""Every bus message survives encode -> decode unchanged, and strictness holds."""

from __future__ import annotations

import msgspec
import pytest

from coderai.contracts import (
    Assignment,
    CancelJob,
    ChatJob,
    Choice,
    Chunk,
    CompletionJob,
    EngineStatus,
    ErrorReply,
    Final,
    Frame,
    Heartbeat,
    KeepAlive,
    ModelConfig,
    ModelFetch,
    ModelLoaded,
    PodPolicy,
    RequestCompleted,
    RouteDecision,
    RouteRequest,
    SamplingParams,
    Usage,
    decode,
    encode,
)
from coderai.contracts.events import Event
from coderai.contracts.routing import AffinityEntry
from coderai.contracts.pods import BrokerStatus, BrokerStatusRequest, PodInfo
from coderai.contracts.store import StoreEntry, StoreList, StoreListing

MODEL = ModelConfig(name="qwen2.5:7b", engine="llama", path="/m/q.gguf", params={"n_ctx": 4096}, nodes=["a"])
SAMPLES = [
    SamplingParams(max_tokens=5, temperature=0.5, stop=["\n"], seed=3, n=2),
    ChatJob(
        request_id="r1",
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="auto",
        response_format={"type": "json_object"},
        stream=True,
        params=SamplingParams(top_p=0.9),
    ),
    CompletionJob(request_id="r2", model="m", prompt="def", echo=True),
    CancelJob(request_id="r3"),
    Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
    Choice(index=1, message={"role": "assistant", "content": "x"}, finish_reason="stop"),
    Chunk(seq=1, delta={"content": "a"}),
    KeepAlive(seq=2),
    Final(
        seq=3,
        engine_id="e",
        choices=[Choice(text="t", finish_reason="length")],
        usage=Usage(total_tokens=1),
        ttft_s=0.1,
    ),
    ErrorReply(code="no_engine", message="none", retryable=True, seq=4),
    RouteRequest(
        request_id="r", model="m", op="chat", session="s", user="u", prefix=["a", "b"], pin="n1", exclude=["e1"]
    ),
    AffinityEntry(engine_id="e", node_id="n", ts=1.5),
    RouteDecision(engine_id="e", node_id="n", reason="least_busy"),
    EngineStatus(engine_id="e", model="m", engine="llama", ops=["chat"], state="ready", in_flight=2, served=9),
    Heartbeat(
        node_id="n",
        version="0",
        seq=1,
        ts=1.5,
        host="h",
        capabilities=["llama"],
        engines=[EngineStatus(engine_id="e", model="m", engine="llama", ops=["chat"], state="loading")],
        mem_total=10,
        mem_free=5,
        hot={"0": 91.5},
    ),
    MODEL,
    Assignment(node_id="n", models=[MODEL]),
    RequestCompleted(
        request_id="r", ts=1.0, key_name="k", model="m", op="chat", status="ok", http_status=200, ttft_s=0.2
    ),
    ModelLoaded(node_id="n", engine_id="e", model="m", load_s=0.1, ts=2.0),
    BrokerStatusRequest(),
    BrokerStatus(
        configured=True,
        pods=[PodInfo(name="coderai-x-m-1", model="m", pod_id="p", gpu_type="A40", hourly_usd=0.4, state="ready")],
    ),
    StoreList(path="org/voices/en"),
    StoreListing(
        files=[
            StoreEntry(path="v.onnx", size=3, sha256="a" * 64),
            StoreEntry(path="sub/x.json", size=0, sha256="b" * 64),
        ]
    ),
    ModelConfig(name="piper", engine="tts", path="/m/en/v.onnx", store_path="org/voices/en/", store_file="v.onnx"),
    ModelConfig(
        name="q",
        engine="llama-server",
        path="/m/q.gguf",
        source="hf://org/q-GGUF/q.gguf@main",
        pod=PodPolicy(burst="when_busy", volume="vol-1"),
    ),
    ModelFetch(
        node_id="n",
        model="q",
        source="hf://org/q-GGUF/q.gguf",
        state="downloading",
        file="q.gguf",
        bytes_done=10,
        bytes_total=20,
        rate_bps=5.0,
        ts=3.0,
    ),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert decode(data, type(msg)) == msg
    # readable JSON on the wire, as `nats sub` shows it
    assert isinstance(msgspec.json.decode(data), dict)


@pytest.mark.parametrize(
    "frame",
    [Chunk(seq=1, text="x"), KeepAlive(seq=2), Final(seq=3, engine_id="e"), ErrorReply(code="timeout", message="m")],
)
def test_frames_decode_as_the_tagged_union(frame):
    assert decode(encode(frame), Frame) == frame


def test_events_decode_as_the_tagged_union():
    e = RequestCompleted(request_id="r", ts=1.0, key_name="k", model="m", op="chat", status="ok", http_status=200)
    assert decode(encode(e), Event) == e
    f = ModelFetch(node_id="n", model="m", source="qwen2.5-7b-instruct", state="failed", error="checksum mismatch")
    assert decode(encode(f), Event) == f


def test_unknown_fields_are_rejected():
    data = msgspec.json.encode({"request_id": "r", "surprise": 1})
    with pytest.raises(msgspec.ValidationError, match="surprise"):
        decode(data, CancelJob)


def test_structs_are_frozen_and_keyword_only():
    job = CancelJob(request_id="r")
    with pytest.raises(AttributeError):
        job.request_id = "other"
    with pytest.raises(TypeError):
        CancelJob("r")


def test_bad_literal_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        decode(b'{"t":"error","code":"nonsense","message":"x"}', ErrorReply)


def test_model_serves_family_default_ops():
    assert MODEL.serves() == ["chat", "complete"]
    assert ModelConfig(name="e", engine="llama", path="p", ops=["complete"]).serves() == ["complete"]
