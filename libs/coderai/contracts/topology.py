"""JetStream streams and KV buckets: names and shapes, shared by whoever creates or binds them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketSpec:
    """A KV bucket. `ttl_s` expires entries not written for that long (0: never)."""

    name: str
    ttl_s: float = 0
    history: int = 1
    description: str = ""


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float = 0
    description: str = ""


LEADER_TTL_S = 6.0
"""A singleton's lease lapses this long after its holder's last renewal (renewed every `LEADER_TTL_S / 4`)."""

NODE_TTL_S = 8.0
"""A node whose heartbeats stop is gone from `coderai_nodes` after this long (heartbeats are every ~2 s)."""

LEADERS = BucketSpec(
    "coderai_leaders", ttl_s=LEADER_TTL_S, description="role -> the singleton's leader, with its fencing token"
)
AFFINITY = BucketSpec("coderai_affinity", ttl_s=1800, description="conversation or prefix -> engine")
NODES = BucketSpec("coderai_nodes", ttl_s=NODE_TTL_S, description="live nodes, last heartbeat")
ASSIGNMENTS = BucketSpec("coderai_assignments", description="desired models per node")
MODELS = BucketSpec("coderai_models", description="model configs by model key")
PODS = BucketSpec("coderai_pods", description="rented pods")
KEYS = BucketSpec(
    "coderai_keys", description="API keys by SHA-256 (never the key): the journal a lost Redis is refilled from"
)
POD_LEDGER = BucketSpec(
    "coderai_pod_ledger",
    description="terminated pods' bills by pod id: the journal a lost Redis's pod ledger is refilled from",
)
MEMBERS = BucketSpec("coderai_members", description="the member registry every head's nats-server takes its users from")
HEADS = BucketSpec(
    "coderai_heads", description="the heads of an HA cluster (head.<node id>) and unused head invites (invite.<id>)"
)

VIDEOS = BucketSpec("coderai_videos", ttl_s=24 * 3600, description="video jobs: state, progress, result blob")

FINETUNE = BucketSpec("coderai_finetune", description="fine-tuning: uploaded file records (file-*) and jobs (ftjob-*)")

RESPONSES = BucketSpec(
    "coderai_responses",
    ttl_s=30 * 24 * 3600,
    description="stored Responses API responses (resp_*): owner, response, conversation",
)
"""Written and read by the gateway only: no node's rights name it."""

BATCHES = BucketSpec("coderai_batches", description="batches (POST /v1/batches): state, counts, file ids")
BATCH_LINES = BucketSpec(
    "coderai_batch_lines",
    ttl_s=7 * 24 * 3600,
    description="each answered batch line's result, <batch id>.<line index>, written once",
)

BUCKETS = (AFFINITY, NODES, ASSIGNMENTS, MODELS, PODS, VIDEOS, FINETUNE, RESPONSES, BATCHES, BATCH_LINES)

BLOBS = BucketSpec("coderai_blobs", ttl_s=3600, description="large payloads: uploads, images, audio, video")
"""An object store, not a KV bucket: messages carry a `Blob` naming an object here instead of the bytes."""

FILES = BucketSpec("coderai_files", description="uploaded files (POST /v1/files), kept until deleted")
"""An object store: the bytes of uploaded files by file id (training data); no TTL, unlike `coderai_blobs`."""

EVENTS = StreamSpec("EVENTS", ("coderai.evt.>",), max_age_s=7 * 24 * 3600, description="durable events")
WORK = StreamSpec("WORK", ("coderai.work.>",), max_age_s=3600, description="fan-out parts, work queue")

STREAMS = (EVENTS, WORK)

HDR_REQUEST_ID = "Coderai-Request-Id"
HDR_KEY_NAME = "Coderai-Key-Name"
HDR_TRACEPARENT = "traceparent"
HDR_KEEP_ALIVE = (
    "Coderai-Keep-Alive"  # a request's keep_alive, in seconds (< 0: forever): how long its model stays idle
)
