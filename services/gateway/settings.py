from __future__ import annotations

import ipaddress
from typing import Literal

from coderai.runtime.settings import CommonSettings, SettingsError


class GatewaySettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_GATEWAY_*`."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    max_connections: int = 0  # connections one HTTP worker holds at once; 0: its open-file limit less 256
    # granian's task implementation (`rust`: its own, Python 3.11 and older) and runtime (one thread or several per
    # worker): knobs for bench/overhead.py's A/B of the HTTP layer (docs/performance.md)
    task_impl: Literal["asyncio", "rust"] = "asyncio"
    runtime_mode: Literal["auto", "st", "mt"] = "auto"
    header_timeout_s: float = 30.0  # a connection without a whole request head this long (idle, slowloris) is closed
    no_auth: bool = False  # only allowed on a loopback host
    api_keys_file: str = ""  # TOML [[keys]] with name, sha256, scopes
    max_body_bytes: int = 16 * 1024 * 1024  # JSON bodies
    max_upload_bytes: int = 25 * 1024 * 1024  # one uploaded file (audio, image, PDF): over it is a 413 naming the field
    file_quota_bytes: int = 1024 * 1024 * 1024  # the files (POST /v1/files) one key may keep in all; 0: no limit
    file_quota_count: int = 10_000  # the files one key may keep (batch outputs included); 0: no limit
    batches_per_key: int = 100  # the batches one key may have running at once; 0: no limit
    # stored responses (`store: true`, kept 30 days) one key may keep: how many and their bytes; 0: no limit. And the
    # background responses one key may run at once in one gateway process
    responses_quota_count: int = 10_000
    responses_quota_bytes: int = 1024 * 1024 * 1024
    background_per_key: int = 16
    files_max_bytes: int = 4 * 1024 * 1024 * 1024  # the `coderai_files` store's cap, every key together
    blobs_max_bytes: int = 4 * 1024 * 1024 * 1024  # the `coderai_blobs` store's cap (inputs and outputs, 1 h each)
    route_timeout_s: float = 2.0
    # picks made in this process from its own copy of the router's view (gateway/picker.py), the router asked only
    # while that copy is not whole or finds no engine; false: every pick is the router's, over the bus
    local_pick: bool = True
    idle_timeout_s: float = 5.0  # an engine silent this long (no token, no keep-alive) is taken for dead
    # an engine that sends nothing at all this long after it was sent a job (a worker keeps alive each second) never
    # got it: a NATS server died under it. The job goes to another engine, as nothing ran
    accept_timeout_s: float = 3.0
    part_timeout_s: float = 60.0  # a fan-out part silent this long (queued or its workers dead) fails the request
    escalate_wait_s: float = 120.0  # how long a request waits for a rented pod's engine after escalating
    load_wait_s: float = 300.0  # how long a request waits for its model to load on demand (docs/models.md)
    max_attempts: int = 3  # engines tried for one request before the first token
    queue_timeout_s: float = 300.0  # a request still waiting for an engine's slot after this long gets a 503
    retry_after_s: int = 5
    # a Responses request without max_output_tokens (Codex sends none) on a model with a known context (n_ctx) may
    # generate this many tokens at most (never more than the context); 0: until the context is full
    default_max_output_tokens: int = 4096
    failover_wait_s: float = 10.0  # a request for a model this gateway's view lacks while it is rebuilt waits this long
    redis_url: str = ""  # API keys, limits and budgets shared by every replica; empty: the keys file only
    metrics_url: str = ""  # the metrics service's /metrics, proxied at /metrics for admin keys and scrapers
    scrape_token: str = ""  # lets Prometheus read /metrics without an admin key
    # whether API keys share the engines' prompt caches for a model that does not say (ModelConfig.share_cache):
    # true suits one tenant (a common prefix is computed once for all); false scopes affinity and cache reuse by key
    share_cache: bool = True
    # a running video job whose gateway wrote nothing this long is taken over by another replica
    video_takeover_s: float = 20.0


def check_auth_settings(settings: GatewaySettings) -> None:
    """No auth is a deliberate choice for one machine only; any other host needs a keys file."""
    if settings.no_auth and not is_loopback(settings.host):
        raise SettingsError(f"--no-auth is only allowed on a loopback host, not {settings.host}")
    if not settings.no_auth and not settings.api_keys_file:
        raise SettingsError("CODERAI_GATEWAY_API_KEYS_FILE is not set: give a keys file, or --no-auth on loopback")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
