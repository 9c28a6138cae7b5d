"""Bad bytes on the bus: every subject a service of a real stack subscribes is fed malformed, truncated, oversized
and wrong-typed messages, made by hypothesis from the subject's own msgspec type. A request is answered
`bad_request`, a publish is dropped with one short log line, nothing logs a traceback, and every service keeps
serving: afterwards a chat answers 200 through the gateway, the scheduler and the pod-broker answer, the worker
still pulls work parts and metrics still counts requests. An engine that answers a job with bad bytes gets its
client a 502, not a 500, and the gateway serves on."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import msgspec.inspect as mi
import nats
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from coderai.contracts import ErrorReply, encode
from coderai.contracts.admin import NodesRequest
from coderai.contracts.base import decode
from coderai.contracts.jobs import ChatJob, Chunk, Final, Frame, KeepAlive, SamplingParams
from coderai.contracts.keys import model_key
from coderai.contracts.nodes import EngineStatus, Heartbeat
from coderai.contracts.ops import BATCH_OPS, ENGINE_OPS
from coderai.contracts.pods import BrokerStatus, BrokerStatusRequest
from coderai.contracts.routing import RouteDecision, RouteRequest
from coderai.contracts import subjects as S
from coderai.contracts.work import WorkPart
from coderai.runtime.cluster import new_token
from coderai.runtime.bus import HANDOUT_PREFIX
from coderai.runtime.embedded import NatsServer
from coderai.testing.procs import deadline_scale, wait_until
from coderai.testing.fuzz import decodes, kinds, oversized, to_json, values
from coderai.testing.stack import Stack, write_models_file

pytestmark = pytest.mark.slow

TOKEN = new_token()
MODEL = "tiny"
GHOST = "ghost"  # held by no real node: only the fake one of the hostile-engine test
PER_KIND = {"bytes": 6, "truncated": 6, "wrong_type": 10, "oversized": 2}
"""Inputs per subject and kind (hypothesis examples), and two fixed oversized ones: about 26 a subject."""
HOSTILE = 6
"""Well-typed messages with hostile values (dots, wildcards, `..`, huge numbers), per read-only subject."""
FRAMES = 12
"""Bad frames an intercepting 'engine' answers chat jobs with."""
LINE_MAX = 2000
"""No log line a bad message causes is longer: its text is cut, however big the message was."""


# --- the stack and what it subscribes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory, tiny_gguf, keys_file, admin_key):
    """A whole stack with the pod-broker too, and joins on (the scheduler has a cluster token)."""
    root = tmp_path_factory.mktemp("busfuzz")
    models = [
        {"name": MODEL, "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}},
        {"name": GHOST, "engine": "llama", "path": str(tiny_gguf), "nodes": ["evil"]},
    ]
    nats_server = NatsServer.secured(root / "nats", token=TOKEN).start(log_file=root / "logs" / "nats.log")
    stack = Stack(root, nats_server.service_url, extra_env={"CODERAI_SCHEDULER_CLUSTER_TOKEN": TOKEN})
    stack.nats = nats_server
    try:
        stack.start_core(write_models_file(root / "models.toml", models))
        stack.start_worker("w1")
        stack.start("pod-broker", "coderai.pod_broker")
        stack.start_gateway("--api-keys-file", str(keys_file))
        stack.wait_model_ready(MODEL, headers={"Authorization": f"Bearer {admin_key}"})
        yield stack
    finally:
        stack.stop()
        nats_server.stop()


@dataclass
class Target:
    subject: S.Subject
    where: str
    reply: bool  # request/reply: a `bad_request` answer is due; else a publish, dropped with one log line
    listeners: tuple[str, ...] = ()  # the services that log that line
    read_only: bool = False  # well-typed hostile values are sent too: nothing here changes state
    sent: int = 0


def inventory(hb: Heartbeat) -> list[Target]:
    """Every subject the stack's services subscribe (the services' start() methods, by service)."""
    engine = next(e for e in hb.engines if e.model == MODEL)
    node, eid = hb.node_id, engine.engine_id
    out = [
        Target(S.ROUTE_PICK, S.ROUTE_PICK(), True, read_only=True),  # router
        Target(
            S.HEARTBEAT, S.HEARTBEAT(node_id="fuzz"), False, ("router", "scheduler", "metrics", "pod-broker", "gateway")
        ),  # the gateway: its copy of the router's view (gateway/picker.py)
        Target(S.EVT_REQUEST_COMPLETED, S.EVT_REQUEST_COMPLETED(), False, ("router", "metrics")),
    ]
    for subject in (
        S.CMD_SCHEDULER_NODES,
        S.CMD_STORE_FETCH,
        S.CMD_STORE_LIST,
        S.CMD_SCHEDULER_STAGES,  # scheduler
        S.CMD_SCHEDULER_MEMBERS,
        S.JOIN_HELLO,
        S.JOIN_PROVE,
    ):
        out.append(Target(subject, subject(), True, read_only=True))
    for subject in (
        S.CMD_SCHEDULER_PLACE,
        S.CMD_SCHEDULER_ESCALATE,
        S.CMD_SCHEDULER_ADD,
        S.CMD_SCHEDULER_REMOVE,
        S.CMD_SCHEDULER_REVOKE,
        S.CMD_SCHEDULER_POD_USER,
        S.CMD_SCHEDULER_TRAIN,
        S.CMD_SCHEDULER_TRAIN_CANCEL,
        S.CMD_BROKER_ACQUIRE,
        S.CMD_BROKER_LEASE,  # pod-broker
        S.CMD_BLOB_WRITE,
    ):  # gateway
        out.append(Target(subject, subject(), True))
    out += [
        Target(S.TRAIN_UPLOAD, S.TRAIN_UPLOAD(job_id="fuzz", node_id=node), True),
        Target(S.TRAIN_REPORT, S.TRAIN_REPORT(job_id="fuzz", node_id=node), False, ("scheduler",)),
        Target(S.CMD_BROKER_STATUS, S.CMD_BROKER_STATUS(), True, read_only=True),
        Target(S.CMD_BLOB_READ, S.CMD_BLOB_READ(), True, read_only=True),
        Target(S.EVT_PART_DONE, S.EVT_PART_DONE(node_id=node), False, ("metrics",)),  # metrics
        Target(S.EVT_MODEL_LOADED, S.EVT_MODEL_LOADED(node_id=node), False, ("metrics",)),
        Target(S.EVT_MODEL_UNLOADED, S.EVT_MODEL_UNLOADED(), False, ("metrics",)),
        Target(S.CMD_NODE_LOGS, S.CMD_NODE_LOGS(node_id=node), True, read_only=True),  # the worker
        Target(S.CMD_NODE_DRAIN, S.CMD_NODE_DRAIN(node_id=node), True),
        Target(S.ENGINE_CANCEL, S.ENGINE_CANCEL(node_id=node, engine_id=eid), False, (f"worker-{node}",)),
    ]
    if "train" in hb.capabilities:
        for subject in (S.CMD_NODE_TRAIN, S.CMD_NODE_TRAIN_STOP, S.CMD_NODE_TRAIN_STATE):
            out.append(Target(subject, subject(node_id=node), True))
    for op in engine.ops:
        if op in ENGINE_OPS:
            out.append(Target(ENGINE_OPS[op], ENGINE_OPS[op](node_id=node, engine_id=eid), True))
        if op in BATCH_OPS:  # the worker's pull consumer on the WORK stream
            out.append(Target(S.WORK_PART, S.WORK_PART(model_key=model_key(MODEL), op=op), False, (f"worker-{node}",)))
    return out


def others(hb: Heartbeat, targets: list[Target]) -> list[str]:
    """Concrete subjects of every other Subject in contracts/subjects.py, with the stack's own ids filled in."""
    engine = next(e for e in hb.engines if e.model == MODEL)
    ids = {
        "node_id": hb.node_id,
        "engine_id": engine.engine_id,
        "job_id": "fuzz",
        "what": "created",
        "model_key": model_key(MODEL),
        "op": "embed",
    }
    covered = {t.subject.pattern for t in targets}
    return [
        s(**{p: ids[p] for p in s.params})
        for s in vars(S).values()
        if isinstance(s, S.Subject) and s.pattern not in covered and ">" not in s.pattern
    ]


def log_lines(stack: Stack) -> dict[str, int]:
    return {name: len(p.log_text()) for name, p in stack.procs.items()}


# --- the tests ---------------------------------------------------------------------------------------------


class Client:
    """A service login on the stack's NATS, driven from synchronous hypothesis tests through one event loop."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.nc = self.run(nats.connect(url, name="bus-fuzz", max_reconnect_attempts=0))
        self.timeout = 5.0 * deadline_scale()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.nc.close())
        self.loop.close()

    async def send(self, target: Target, data: bytes) -> Any:
        """Publish `data`; on a request subject, the reply (decoded as the subject's reply or an ErrorReply)."""
        target.sent += 1
        if not target.reply:
            await self.nc.publish(target.where, data)
            return None
        try:
            msg = await self.nc.request(target.where, data, timeout=self.timeout)
        except nats.errors.NoRespondersError:
            raise AssertionError(f"nobody subscribes {target.where}: the inventory is out of date") from None
        except nats.errors.TimeoutError:
            raise AssertionError(
                f"no answer on {target.where} within {self.timeout:.0f} s to {data[:80]!r} ({len(data)} bytes)"
            ) from None
        return (
            target.subject.decode_reply(msg.data) if target.subject.reply is not None else decode(msg.data, ErrorReply)
        )


@pytest.fixture(scope="module")
def client(fuzz_stack):
    c = Client(fuzz_stack.nats.service_url)
    yield c
    c.close()


def heartbeat(client: Client, node: str = "w1") -> Heartbeat:
    async def one() -> Heartbeat:
        sub = await client.nc.subscribe(S.HEARTBEAT(node_id=node))
        try:
            return decode((await sub.next_msg(timeout=client.timeout)).data, Heartbeat)
        finally:
            await sub.unsubscribe()

    return client.run(one())


def barrage(client: Client, targets: list[Target]) -> None:
    """Every kind of bad input at every target, with hypothesis; the requests' answers checked as they come."""
    max_payload = client.nc.max_payload

    def check(target: Target, data: bytes) -> None:
        out = client.run(client.send(target, data))
        if target.reply:
            assert isinstance(out, ErrorReply) and out.code == "bad_request", (target.where, data[:80], out)
            assert len(out.message) <= LINE_MAX, (target.where, len(out.message))

    for target in targets:
        strategies = kinds(target.subject.request)
        for kind, strategy in strategies.items():

            @settings(
                max_examples=PER_KIND[kind],
                deadline=None,
                database=None,
                derandomize=False,
                suppress_health_check=list(HealthCheck),
            )
            @given(data=strategy)
            def bad(data: bytes) -> None:
                assume(not decodes(data, target.subject.request))
                check(target, data)

            bad()

        @settings(
            max_examples=PER_KIND["oversized"], deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(
            size=st.integers(64 * 1024, max_payload - 1024),
            how=st.sampled_from(["random", "key", "nested", "open"]),
            seed=st.integers(0, 2**32),
        )
        def big(size: int, how: str, seed: int) -> None:
            check(target, oversized(size, how, seed, target.subject.request))

        big()
        for how in ("key", "nested"):  # the two that once cost a 1 MB log line or a missing answer
            check(target, oversized(max_payload - 1024, how, 0, target.subject.request))


def hostile(client: Client, targets: list[Target]) -> int:
    """Well-typed messages with hostile values at the read-only request subjects: an answer of the subject's reply
    type or a typed error, never `internal` (a handler that raised)."""
    sent = 0
    for target in (t for t in targets if t.read_only and t.reply):

        @settings(max_examples=HOSTILE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(value=values(mi.type_info(target.subject.request)))
        def good_shape(value: Any) -> None:
            nonlocal sent
            data = to_json(value)
            assume(decodes(data, target.subject.request))
            out = client.run(client.send(target, data))
            sent += 1
            assert not (isinstance(out, ErrorReply) and out.code == "internal"), (target.where, value, out)

        good_shape()
    return sent


def test_the_inventory_names_every_subject_a_service_subscribes(fuzz_stack, client):
    """No subject outside the inventory has a subscriber (NATS answers 'no responders' at once), and every
    JetStream consumer of the stack pulls a subject of the inventory: a service that subscribes something new
    fails here until the fuzz feeds it too."""
    hb = heartbeat(client)
    targets = inventory(hb)

    async def probe(subject: str) -> str:
        try:
            msg = await client.nc.request(subject, b"", timeout=client.timeout)
        except nats.errors.NoRespondersError:
            return "nobody"
        except nats.errors.TimeoutError:
            return "a listener"  # it took the message and said nothing
        return "a stream" if b'"stream"' in msg.data and b'"seq"' in msg.data else f"a responder ({msg.data[:100]!r})"

    heard = {subject: client.run(probe(subject)) for subject in others(hb, targets)}
    assert {k: v for k, v in heard.items() if v not in ("nobody", "a stream")} == {}

    async def consumers() -> set[str]:
        js = client.nc.jetstream()
        return {
            c.config.filter_subject or stream for stream in ("EVENTS", "WORK") for c in await js.consumers_info(stream)
        }

    pulled = client.run(consumers())
    assert pulled <= {t.where for t in targets}, pulled - {t.where for t in targets}


def test_bad_bytes_on_every_subject_are_refused_and_every_service_keeps_serving(fuzz_stack, client, admin_key, capsys):
    stack = fuzz_stack
    hb = heartbeat(client)
    targets = inventory(hb)
    before = log_lines(stack)
    t0 = time.monotonic()
    barrage(client, targets)
    well_typed = hostile(client, targets)

    # every publish dropped with exactly one line in each service that listens there, and no traceback anywhere
    expected: dict[str, int] = {}
    for t in targets:
        if not t.reply:
            for name in t.listeners:
                expected[name] = expected.get(name, 0) + t.sent

    def dropped(name: str) -> int:
        return sum("malformed" in line for line in stack.procs[name].log_text()[before[name] :].splitlines())

    wait_until(
        lambda: all(dropped(n) >= k for n, k in expected.items()),
        30,
        f"one 'malformed' line per dropped message: {expected}",
    )
    for name, p in stack.procs.items():
        assert p.alive(), f"{name} died:\n{p.log_text()[-3000:]}"
        new = p.log_text()[before[name] :].splitlines()
        assert dropped(name) == expected.get(name, 0), (name, dropped(name), expected.get(name, 0))
        assert not [line for line in new if '"exc"' in line or "Traceback" in line], (
            f"{name} logged a traceback:\n"
            + "\n".join(line[:LINE_MAX] for line in new if '"exc"' in line or "Traceback" in line)[:4000]
        )
        assert max((len(line) for line in new), default=0) <= LINE_MAX, (
            f"{name} logged a line of {max(len(line) for line in new)} characters"
        )
        assert len(new) <= expected.get(name, 0) + 40, (
            f"{name} logged {len(new)} lines for {expected.get(name, 0)} drops"
        )

    # and every service still serves
    headers = {"Authorization": f"Bearer {admin_key}"}
    stack.wait_model_ready(MODEL, headers=headers, timeout_s=30)  # gateway, router and the worker's engine
    nodes = client.run(client.nc.request(S.CMD_SCHEDULER_NODES(), encode(NodesRequest()), timeout=client.timeout))
    assert "w1" in {n.heartbeat.node_id for n in S.CMD_SCHEDULER_NODES.decode_reply(nodes.data).nodes}  # the scheduler
    status = client.run(client.nc.request(S.CMD_BROKER_STATUS(), encode(BrokerStatusRequest()), timeout=client.timeout))
    assert isinstance(S.CMD_BROKER_STATUS.decode_reply(status.data), BrokerStatus)  # the pod-broker
    assert_still_pulls_work(client)  # the worker's pull consumer outlived the bad parts
    wait_until(
        lambda: (
            "coderai_requests_total{" in httpx.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5).text
        ),
        30,
        "metrics to count a request",
    )
    wall = time.monotonic() - t0
    with capsys.disabled():
        print(
            f"\nbus fuzz: {sum(t.sent for t in targets)} inputs over {len(targets)} subjects "
            f"({well_typed} of them well-typed with hostile values) in {wall:.1f} s"
        )


def assert_still_pulls_work(client: Client) -> None:
    """A good work part after the bad ones is answered: the worker's consumer did not die on them."""

    async def one() -> Any:
        reply = f"{HANDOUT_PREFIX}.fuzz{secrets.token_hex(4)}.{secrets.token_hex(8)}"
        sub = await client.nc.subscribe(reply)
        job = ChatJob(
            request_id="fuzz-part",
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            params=SamplingParams(max_tokens=1),
        )
        part = WorkPart(
            request_id="fuzz-part", model=MODEL, op="chat", part=0, parts=1, reply=reply, job=msgspec.Raw(encode(job))
        )
        await client.nc.jetstream().publish(S.WORK_PART(model_key=model_key(MODEL), op="chat"), encode(part))
        try:
            while True:
                frame = decode((await sub.next_msg(timeout=client.timeout * 6)).data, Frame)
                if not isinstance(frame, KeepAlive):
                    return frame
        finally:
            await sub.unsubscribe()

    frame = client.run(one())
    assert isinstance(frame, Final), frame


def test_an_engine_that_answers_bad_bytes_gets_a_502_and_the_gateway_serves_on(fuzz_stack, client, admin_key, capsys):
    """A hostile engine (here: node `evil`, this test's heartbeats and its subscription on the engine's chat
    subject, the only holder of model `ghost`) answers jobs with frames that do not decode, first or after a good
    chunk: the client gets a 502 error, or an SSE error event, never a 500; the gateway logs one line for each."""
    stack = fuzz_stack
    real = heartbeat(client)
    evil = msgspec.structs.replace(
        real,
        node_id="evil",
        seq=1,
        engines=[EngineStatus(engine_id="evil-ghost", model=GHOST, engine="llama", ops=["chat"], state="ready")],
    )
    answers: list[bytes] = []

    @settings(max_examples=FRAMES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.one_of(*kinds(Frame).values()))
    def pick(data: bytes) -> None:
        assume(not decodes(data, Frame))
        answers.append(data)

    pick()
    pending = list(answers)

    async def hostile_engine(m: Any) -> None:
        job = decode(m.data, ChatJob)
        if job.stream:  # a good start, then the bad bytes mid-stream
            await client.nc.publish(m.reply, encode(Chunk(seq=1, delta={"role": "assistant", "content": "hi"})))
        await client.nc.publish(m.reply, pending.pop(0))

    async def run() -> list[int]:
        sub = await client.nc.subscribe(S.ENGINE_CHAT(node_id="evil", engine_id="evil-ghost"), cb=hostile_engine)
        statuses = []
        try:

            async def routed() -> bool:
                await client.nc.publish(S.HEARTBEAT(node_id="evil"), encode(evil))
                pick = RouteRequest(request_id="fuzz-pick", model=GHOST, op="chat")
                msg = await client.nc.request(S.ROUTE_PICK(), encode(pick), timeout=client.timeout)
                out = S.ROUTE_PICK.decode_reply(msg.data)
                return isinstance(out, RouteDecision) and out.engine_id == "evil-ghost"

            deadline = time.monotonic() + 30 * deadline_scale()
            while not await routed():  # the router has heard of `evil` (its heartbeat came before the pick)
                assert time.monotonic() < deadline, "the router never routed to the fake engine"
            body = {"model": GHOST, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            async with httpx.AsyncClient(
                base_url=stack.base_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60
            ) as http:
                for i in range(len(answers)):
                    await client.nc.publish(S.HEARTBEAT(node_id="evil"), encode(evil))  # `evil` stays alive
                    r = await http.post("/chat/completions", json={**body, "stream": i % 2 == 1})
                    statuses.append(r.status_code)
                    if i % 2:
                        assert r.status_code == 200 and "error" in r.text and "malformed" in r.text, r.text[:300]
                    else:
                        assert r.status_code == 502 and "malformed" in r.json()["error"]["message"], r.text[:300]
        finally:
            await sub.unsubscribe()
        return statuses

    before = len(stack.procs["gateway"].log_text())
    statuses = client.run(run())
    new = stack.procs["gateway"].log_text()[before:].splitlines()
    assert sum("malformed frame" in line for line in new) == len(answers), "\n".join(new)[-4000:]
    assert not [line for line in new if '"exc"' in line or "Traceback" in line], "\n".join(new)[:4000]
    assert max((len(line) for line in new), default=0) <= LINE_MAX
    assert stack.procs["gateway"].alive()
    stack.wait_model_ready(MODEL, headers={"Authorization": f"Bearer {admin_key}"}, timeout_s=30)
    with capsys.disabled():
        print(f"bus fuzz: {len(answers)} bad engine frames, answered {sorted(set(statuses))}")
