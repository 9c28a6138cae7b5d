"""Which models are loaded: the gateway's mirror of `coderai_nodes` on a real nats-server (a silent node's record is
not live), the `coderai` field of `/v1/models`, and Ollama's `/api/ps` entry for a running model."""

from __future__ import annotations

import datetime
import time

from coderai.contracts import EngineStatus, ModelConfig, encode
from coderai.contracts.topology import NODE_TTL_S, NODES
from coderai.gateway.copies import Copies, Copy
from coderai.gateway.ollama import FOREVER, running_json
from coderai.gateway.openai.models import model_json
from coderai.runtime.lifecycle import wait_for
from coderai.testing.heartbeats import heartbeat

GiB = 1024**3


def engine(model: str, state: str = "ready", **kw) -> EngineStatus:
    return EngineStatus(engine_id=f"{model}-e", model=model, engine="llama", ops=["chat"], state=state, **kw)


def cfg(**kw) -> ModelConfig:
    return ModelConfig(name="m", engine="llama", path="/m.gguf", **kw)


async def test_the_mirror_lists_copies_of_live_nodes_only(bus, unique):
    a, b, node = f"a{unique}", f"b{unique}", f"n{unique}"
    copies = Copies(bus)
    copies.start()
    try:
        kv = await bus.kv(NODES)
        hb = heartbeat(node, ts=time.time(), engines=[engine(a), engine(b, "loading")])
        await kv.put(node, encode(hb))
        await wait_for(lambda: a in copies.by_model(), 5, what="the node record in the mirror")
        seen = copies.by_model()
        assert seen[a] == [Copy(node, engine(a))] and seen[b][0].status.state == "loading"
        # the bucket's TTL expires the record without telling the watch: past NODE_TTL_S it is not live
        assert a not in copies.by_model(now=time.monotonic() + NODE_TTL_S + 1)
        await kv.delete(node)
        await wait_for(lambda: a not in copies.by_model(), 5, what="the deleted record out of the mirror")
    finally:
        copies.stop()


def test_models_say_whether_loaded_how_often_and_where_for_admins_only():
    copies = [
        Copy("n2", engine("m")),
        Copy("n1", engine("m")),
        Copy("n1", engine("m", "loading")),
        Copy("n3", engine("m", "failed")),
    ]
    admin = model_json(cfg(resident="on_demand"), copies, admin=True)
    assert admin["id"] == "m" and admin["object"] == "model"  # OpenAI's fields as they were
    assert admin["coderai"] == {
        "loaded": True,
        "copies": 2,
        "loading": True,
        "resident": "on_demand",
        "nodes": ["n1", "n2"],
    }
    tenant = model_json(cfg(), copies, admin=False)["coderai"]
    assert "nodes" not in tenant and tenant["resident"] == "auto" and tenant["copies"] == 2
    assert model_json(cfg(resident="always"), [], admin=True)["coderai"] == {
        "loaded": False,
        "copies": 0,
        "loading": False,
        "resident": "always",
        "nodes": [],
    }


def test_keep_alive_follows_the_request_then_the_model():
    assert cfg().keep_alive() is None  # auto without a keep_alive: never idle-unloaded
    assert cfg(resident="on_demand").keep_alive() == 300
    assert cfg(resident="on_demand", keep_alive_s=60).keep_alive() == 60
    assert cfg(resident="on_demand", keep_alive_s=60).keep_alive(asked=5) == 5
    assert cfg(resident="on_demand").keep_alive(asked=-1) is None
    assert cfg(resident="always", keep_alive_s=60).keep_alive(asked=5) is None


def test_a_running_model_in_ollama_ps():
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    m = cfg(resident="on_demand", keep_alive_s=100)
    ready = [
        Copy("n1", engine("m", idle_s=30.0, memory=2 * GiB)),  # CPU: 70 s left
        Copy("n2", engine("m", idle_s=90.0, memory=3 * GiB, devices=[0])),
    ]  # GPU 0: 10 s left
    shown = running_json(m, ready, now)
    assert shown["model"] == "m" and shown["size"] == 3 * GiB and shown["size_vram"] == 3 * GiB
    assert shown["expires_at"] == "2026-01-01T00:01:10Z"  # the last copy to go
    one = running_json(m, [Copy("n1", engine("m", idle_s=30.0, memory=GiB, keep_alive_s=-1))], now)
    assert one["size_vram"] == 0 and one["expires_at"] == (now + FOREVER).isoformat().replace("+00:00", "Z")


def test_a_tenant_may_unload_only_its_own_model_and_keep_one_loaded_a_bounded_while():
    from coderai.gateway.pipeline_admit import TENANT_KEEP_ALIVE_MAX_S, tenant_keep_alive

    shared = cfg(resident="on_demand")
    assert tenant_keep_alive(shared, 0) is None  # others may be using it: not asked
    assert tenant_keep_alive(shared, 0, own=True) == 0.0  # its fine-tuned model: no other key can use it
    assert tenant_keep_alive(shared, -1, own=True) is None  # never pinned for good
    assert tenant_keep_alive(shared, 10 * TENANT_KEEP_ALIVE_MAX_S) == TENANT_KEEP_ALIVE_MAX_S
    assert tenant_keep_alive(shared, 30) == 30
