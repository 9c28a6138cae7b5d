from __future__ import annotations

from coderai.oci import DEFAULT_POD_IMAGE
from coderai.runtime.settings import CommonSettings


class BrokerSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_POD_BROKER_*`."""

    runpod_api_key: str = ""
    hf_token: str = ""  # given to each pod as HF_TOKEN, for the gated or private weights of a model's source
    runpod_api_base: str = "https://api.runpod.io"  # POST <base>/graphql
    runpod_serverless_base: str = "https://api.runpod.ai"  # serverless endpoints: <base>/v2/<endpoint id>/...
    redis_url: str = ""  # the spend ledger, reservations and caps; pods are off without it
    pod_credentials_ttl_s: float = 7 * 24 * 3600  # a pod's NATS user ends with the pod, or after this long
    pod_nats_url: str = ""  # how a pod reaches this cluster's NATS (a public address); pods are off without it
    deployment: str = "default"  # pods are named coderai-<deployment>-...; the orphan reaper owns that prefix
    pod_image: str = DEFAULT_POD_IMAGE  # the release's CUDA worker for this version (coderai.oci); `coderai pods check` looks it up. A model's pod.image overrides it
    pod_image_key: str = ""  # public keys (gpg --export) a pod's image must be signed by; empty: images not checked
    pod_image_sigstore: str = ""  # where the images' signatures are (image-trust sign --sigstore): URL or folder
    pod_image_registry_url: str = ""  # registry API base URL for that check when not https://<registry>
    max_hourly_usd: float = 0.0  # global cap: the hourly rates of every pod together; 0 forbids renting
    global_budget_usd: float = 0.0  # global spend cap per global_period; 0: none
    global_period: str = "month"
    boot_timeout_s: float = 600.0  # a pod not ready by then is terminated (and billed)
    reconcile_s: float = 2.0
    reserve_ahead_s: float = 600.0  # money reserved ahead of a running pod's cost
    orphan_scan_s: float = 60.0
