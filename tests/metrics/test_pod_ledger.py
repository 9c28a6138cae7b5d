"""Metrics reads pod money where the pod-broker writes it: one `pod_ledger_prefix` (CommonSettings), in the
session's real Redis."""

from __future__ import annotations

import time

import pytest

from coderai.accounts.pod_money import Caps, PodMoney
from coderai.contracts import ModelConfig, encode
from coderai.contracts.models import PodPolicy
from coderai.contracts.topology import BucketSpec
from coderai.metrics.service import Metrics
from coderai.metrics.settings import MetricsSettings
from coderai.pod_broker.settings import BrokerSettings
from coderai.runtime.settings import load_settings


def test_one_variable_sets_the_prefix_of_every_service():
    env = {"CODERAI_POD_LEDGER_PREFIX": "acme:pods"}
    assert load_settings(BrokerSettings, "pod-broker", env=env).pod_ledger_prefix == "acme:pods"
    assert load_settings(MetricsSettings, "metrics", env=env).pod_ledger_prefix == "acme:pods"
    assert load_settings(MetricsSettings, "metrics", env={}).pod_ledger_prefix == "coderai:pods"
    assert "ledger_prefix" not in BrokerSettings.__struct_fields__  # the broker's old name is gone: one setting


async def test_metrics_reads_the_spend_the_broker_booked_under_a_non_default_prefix(r, bus, unique):
    env = {"CODERAI_POD_LEDGER_PREFIX": f"test:{unique}:pods"}
    broker = load_settings(BrokerSettings, "pod-broker", env=env)
    money = PodMoney(r, prefix=broker.pod_ledger_prefix)  # as the broker builds it (pod_broker/service.py)
    now = time.time()
    model = f"m{unique}"
    await money.reserve(model, "p1", 3.6, 1.0, Caps(), now - 120)
    await money.open_pod("p1", "A40", now - 120)
    booked = await money.book("p1", model, "A40", 3.6, now - 100, now, now)  # 100 s at $3.60/h: $0.10
    assert booked is not None and booked.usd == pytest.approx(0.1)
    await money.reserve(model, "p2", 3.6, 0.25, Caps(), now)  # still running: reserved, not spent

    metrics = Metrics(load_settings(MetricsSettings, "metrics", env=env))
    metrics.redis = r
    cfg = ModelConfig(
        name=model, engine="llama", path="/m.gguf", pod=PodPolicy(burst="when_busy", budget_usd=1.0, period="day")
    )
    pods, models = await bus.kv(BucketSpec(f"test_pods_{unique}")), await bus.kv(BucketSpec(f"test_models_{unique}"))
    await models.put(model, encode(cfg))
    metrics._pod_kvs = (pods, models)  # the census's two buckets, real ones of this test's own
    await metrics._pods()
    get = metrics.series.registry.get_sample_value
    labels = {"model": model, "period": "day"}
    assert get("coderai_pod_spend_usd", labels) == pytest.approx(0.1)
    assert get("coderai_budget_remaining_usd", labels) == pytest.approx(1.0 - 0.1 - 0.25)

    # and the default prefix holds none of it: reading there (what metrics did before) would have shown $0
    assert await PodMoney(r).spend(model, "day") == 0
