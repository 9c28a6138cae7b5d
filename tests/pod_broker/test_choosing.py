"""Which GPU type a model gets, and what its pod's worker is told."""

from __future__ import annotations

import json

from coderai.contracts import ModelConfig, PodPolicy
from coderai.pod_broker.choosing import Offer, candidates, name_prefix, pod_env, pod_name, pod_rate
from coderai.runtime.cluster import user_of

OFFERS = [
    Offer("A40", "A40", 48, 0.40, 0.20),
    Offer("RTX4090", "4090", 24, 0.69, 0.35),
    Offer("H100", "H100", 80, 2.99, 1.50),
    Offer("T4", "T4", 16, 0.10, 0.05),
]
GB = 1024**3


def model(**pod) -> ModelConfig:
    return ModelConfig(name="big", engine="llama", path="x", pod=PodPolicy(**pod))


def test_cheapest_that_fits_first_then_the_rest_by_price():
    assert [o.id for o in candidates(OFFERS, model(), 20 * GB, 0)] == ["A40", "RTX4090", "H100"]
    assert [o.id for o in candidates(OFFERS, model(), 60 * GB, 0)] == ["H100"]
    assert [o.id for o in candidates(OFFERS, model(gpu_count=2), 60 * GB, 0)] == ["A40", "H100"]


def test_the_hourly_caps_bound_the_whole_pod():
    assert [o.id for o in candidates(OFFERS, model(max_hourly_usd=0.7), 1, 0)] == ["T4", "A40", "RTX4090"]
    assert [o.id for o in candidates(OFFERS, model(max_hourly_usd=0.7, gpu_count=2), 1, 0)] == ["T4"]
    assert [o.id for o in candidates(OFFERS, model(max_hourly_usd=5.0), 1, 0.5)] == ["T4", "A40"]


def test_preferred_types_come_first_in_their_order():
    ids = [o.id for o in candidates(OFFERS, model(gpu_types=["H100", "RTX4090"]), 1, 0)]
    assert ids == ["H100", "RTX4090", "T4", "A40"]


def test_rate_is_card_price_times_gpus_and_spot_when_asked():
    assert pod_rate(OFFERS[0], PodPolicy(gpu_count=3)) == 1.2
    assert pod_rate(OFFERS[0], PodPolicy(spot=True)) == 0.2


def test_names_are_ours_and_the_env_carries_the_pods_own_credentials():
    name = pod_name("prod", "Qwen/Qwen2.5-7B")
    assert name.startswith(name_prefix("prod")) and name == name.lower() and "." not in name
    env = pod_env(name, model(), "nats://head.example:4222", f"pod-{name}", "pw-of-this-pod")
    assert user_of(env["CODERAI_NATS_URL"]) == (f"pod-{name}", "pw-of-this-pod")
    assert not any(k == "CODERAI_CLUSTER_TOKEN" for k in env)
    assert env["CODERAI_NODE_ID"] == env["CODERAI_WORKER_POD"] == name
    [cfg] = json.loads(env["CODERAI_WORKER_MODELS_JSON"])
    assert cfg["name"] == "big" and cfg["engine"] == "llama"


def test_a_pod_gets_the_hf_token_and_keeps_weights_on_its_volume_only_when_there_are_some():
    env = pod_env("p", model(burst="always"), "nats://h:4222", "pod-p", "pw")
    assert "HF_TOKEN" not in env and "CODERAI_WORKER_WEIGHTS_DIR" not in env
    env = pod_env("p", model(burst="always", volume="vol-1"), "nats://h:4222", "pod-p", "pw", hf_token="hf_x")
    assert env["HF_TOKEN"] == "hf_x" and env["CODERAI_WORKER_WEIGHTS_DIR"] == "/workspace/models"
    [cfg] = json.loads(env["CODERAI_WORKER_MODELS_JSON"])
    assert cfg["pod"]["volume"] == "vol-1"
