"""Model loads, unloads and each copy's idle time: published on a real nats-server the way the worker and the
scheduler publish them, they reach the metrics service's scraped /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coderai.contracts import EngineStatus, GpuMemory, ModelLoaded, ModelUnloaded
from coderai.contracts.subjects import EVT_MODEL_LOADED, EVT_MODEL_UNLOADED, HEARTBEAT
from coderai.metrics.prom import Series
from coderai.metrics.service import Metrics
from coderai.metrics.settings import MetricsSettings
from coderai.runtime.bus import Bus
from coderai.runtime.embedded import free_port
from coderai.runtime.lifecycle import wait_for
from coderai.runtime.settings import load_settings
from coderai.testing.heartbeats import heartbeat

GiB = 1024**3


def test_loads_time_and_unloads_by_reason():
    s = Series()
    for node, load_s in (("n1", 0.8), ("n2", 12.0), ("n1", 3.0)):
        s.on_loaded(ModelLoaded(node_id=node, engine_id="e", model="m", load_s=load_s, ts=0.0))
    for reason in ("evicted", "evicted", "idle"):
        s.on_unloaded(ModelUnloaded(node_id="n1", model="m", reason=reason, ts=0.0))
    get = s.registry.get_sample_value
    assert get("coderai_model_loads_total", {"model": "m", "node": "n1"}) == 2
    assert get("coderai_model_load_seconds_count", {"model": "m"}) == 3
    assert get("coderai_model_load_seconds_sum", {"model": "m"}) == pytest.approx(15.8)
    assert get("coderai_model_load_seconds_bucket", {"model": "m", "le": "5.0"}) == 2
    assert get("coderai_model_unloads_total", {"model": "m", "node": "n1", "reason": "evicted"}) == 2
    assert get("coderai_model_unloads_total", {"model": "m", "node": "n1", "reason": "idle"}) == 1


async def test_published_loads_unloads_and_heartbeats_show_in_the_scrape(nats_server, unique):
    port = free_port()
    settings = load_settings(
        MetricsSettings, "metrics", env={}, nats_url=nats_server.url, port=port, consumer=f"metrics-{unique}"
    )
    model, node = f"m{unique}", f"n{unique}"
    async with contextlib.AsyncExitStack() as stack:
        await Metrics(settings).start(stack, asyncio.Event())
        bus = await Bus.connect(nats_server.url, "test-publisher")
        stack.push_async_callback(bus.close)
        await bus.publish(
            EVT_MODEL_LOADED,
            ModelLoaded(node_id=node, engine_id="e1", model=model, load_s=2.0, ts=time.time()),
            node_id=node,
        )
        # another node's id in the message: NATS would refuse a node this publish; the service drops it too
        await bus.publish(
            EVT_MODEL_LOADED,
            ModelLoaded(node_id="other", engine_id="e1", model=model, load_s=9.0, ts=time.time()),
            node_id=node,
        )
        for reason in ("evicted", "idle"):
            await bus.publish(
                EVT_MODEL_UNLOADED, ModelUnloaded(node_id=node, model=model, reason=reason, ts=time.time())
            )
        copy = EngineStatus(
            engine_id="e1",
            model=model,
            engine="llama",
            ops=["chat"],
            state="ready",
            idle_s=42.5,
            memory=3 * GiB,
            devices=[1],
        )
        await bus.publish(
            HEARTBEAT,
            heartbeat(
                node,
                ts=time.time(),
                engines=[copy],
                gpus=2,
                gpu_memory=[GpuMemory(total=24 * GiB, free=20 * GiB), GpuMemory(total=24 * GiB, free=5 * GiB)],
            ),
            node_id=node,
        )
        engine = {"node": node, "engine": "e1", "model": model}
        expected = {
            ("coderai_model_loads_total", frozenset({"model": model, "node": node}.items())): 1,
            ("coderai_model_load_seconds_sum", frozenset({"model": model}.items())): 2.0,
            ("coderai_model_unloads_total", frozenset({"model": model, "node": node, "reason": "evicted"}.items())): 1,
            ("coderai_model_unloads_total", frozenset({"model": model, "node": node, "reason": "idle"}.items())): 1,
            ("coderai_engine_idle_seconds", frozenset(engine.items())): 42.5,
            ("coderai_engine_memory_bytes", frozenset(engine.items())): 3 * GiB,
            ("coderai_node_gpu_memory_free_bytes", frozenset({"node": node, "gpu": "1"}.items())): 5 * GiB,
            ("coderai_engines_up", frozenset({"model": model}.items())): 1,  # the census (every 5 s): ready copies
        }
        samples: dict = {}

        async def scraped() -> bool:
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
            samples.clear()
            samples.update(
                {
                    (s.name, frozenset(s.labels.items())): s.value
                    for family in text_string_to_metric_families(text)
                    for s in family.samples
                }
            )
            return all(samples.get(k) == v for k, v in expected.items())

        try:
            await wait_for(scraped, 15, interval_s=0.2, what="the events in the scrape")
        except TimeoutError:
            raise AssertionError({k: samples.get(k) for k, v in expected.items() if samples.get(k) != v}) from None
        assert ("coderai_model_loads_total", frozenset({"model": model, "node": "other"}.items())) not in samples
