"""Which GPU type to rent for a model, and what a pod's worker is told. Pure: no I/O."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from coderai.contracts import ModelConfig, model_key
from coderai.contracts.models import PodPolicy
from coderai.runtime.cluster import with_user

MB = 1024 * 1024


@dataclass(frozen=True)
class Offer:
    """A GPU type as RunPod prices it: per GPU-hour, on demand and spot."""

    id: str
    name: str
    memory_gb: float
    price_hr: float
    spot_price_hr: float = 0.0


def pod_rate(offer: Offer, policy: PodPolicy) -> float:
    """What the whole pod costs an hour: card price x GPU count (spot when asked and offered)."""
    price = offer.spot_price_hr if policy.spot and offer.spot_price_hr > 0 else offer.price_hr
    return round(price * policy.gpu_count, 6)


def candidates(offers: list[Offer], model: ModelConfig, need_bytes: int, global_max_hourly: float) -> list[Offer]:
    """Types that fit the model (memory across the pod's GPUs) under both hourly caps: the policy's preferred
    types in their order first, then the rest cheapest first. The broker tries them in turn (capacity)."""
    policy = model.pod
    caps = [c for c in (policy.max_hourly_usd, global_max_hourly) if c > 0]
    cap = min(caps) if caps else 0.0
    fits = [
        o
        for o in offers
        if o.memory_gb * 1024 * MB * policy.gpu_count >= need_bytes
        and o.price_hr > 0
        and (cap <= 0 or pod_rate(o, policy) <= cap)
    ]
    preferred = [o for pid in policy.gpu_types for o in fits if o.id == pid]
    rest = sorted((o for o in fits if o.id not in policy.gpu_types), key=lambda o: (pod_rate(o, policy), o.id))
    return preferred + rest


def pod_name(deployment: str, model: str) -> str:
    """`coderai-<deployment>-<model_key>-<6 hex>`: unique, and recognisable as ours by the orphan reaper."""
    return f"{name_prefix(deployment)}{model_key(model)[:40]}-{secrets.token_hex(3)}".lower()


def name_prefix(deployment: str) -> str:
    return f"coderai-{deployment}-"


VOLUME_MOUNT = "/workspace"  # where RunPod mounts a pod's network volume (in place of its volume disk)


def pod_env(
    name: str, model: ModelConfig, nats_url: str, user: str, password: str, ca_pem: str = "", hf_token: str = ""
) -> dict[str, str]:
    """The pod's worker joins this cluster's bus as a pod (credentials of its own, made by the head's membership
    for this pod alone and ended with it: never the cluster token) and loads just `model`, under node id `name`;
    it fetches the model's weights by its `source` with `hf_token`, onto the model's network volume if it names one."""
    cfg = json.dumps([_builtins(model)])
    return (
        {
            "CODERAI_NATS_URL": with_user(nats_url, user, password),
            "CODERAI_NODE_ID": name,
            "CODERAI_WORKER_POD": name,
            "CODERAI_WORKER_MODELS_JSON": cfg,
            "CODERAI_WORKER_MDNS": "false",
            "CODERAI_LOG_FORMAT": "json",
        }
        | ({"CODERAI_NATS_CA": ca_pem} if ca_pem else {})
        | (  # the pod trusts this cluster's CA alone
            {"CODERAI_WORKER_WEIGHTS_DIR": f"{VOLUME_MOUNT}/models"} if model.pod.volume else {}
        )
        | ({"HF_TOKEN": hf_token} if hf_token else {})
    )


def _builtins(model: ModelConfig) -> dict:
    import msgspec

    return msgspec.to_builtins(model)
