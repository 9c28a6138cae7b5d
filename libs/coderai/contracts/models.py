"""Model configuration: what the scheduler places and the gateway lists."""

from __future__ import annotations

import re
from typing import Literal, overload

from coderai.contracts.base import Message
from coderai.contracts.jobs import Op
from coderai.contracts.families import DEFAULT_OPS, EngineFamily
from coderai.contracts.params import as_float, as_int, as_str, as_strs, as_table
from coderai.contracts.split import SplitMode, SplitPlan

SERVERLESS_ENDPOINT_ID = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
"""A RunPod serverless endpoint id as RunPod makes them: it becomes a path segment of api.runpod.ai/v2/<id>/..."""
ON_DEMAND_KEEP_ALIVE_S = 300.0  # an on_demand model's keep_alive when neither it nor a request says (Ollama's default)


class Distribute(Message, frozen=True, kw_only=True):
    """Fan-out of one request over every worker holding the model (images by `n`, embeddings and rerank by
    items, speech by sentences, transcription by audio cut at silences, OCR by pages)."""

    enabled: bool = True
    max_parts: int = 8
    min_items: int = 2  # fewer items than this are never split


class PodPolicy(Message, frozen=True, kw_only=True):
    """When and how a model escalates past the machines you own to a rented RunPod GPU.

    `burst`: `never`; `when_busy` (every engine holding it has `busy_in_flight` jobs or more); `when_no_fit` (no
    live node can hold it); `always` (either). `max_hourly_usd` caps the whole pod (card price x GPU count);
    `budget_usd` caps what the model's pods may cost per `period`.
    """

    burst: Literal["never", "when_busy", "when_no_fit", "always"] = "never"
    max_hourly_usd: float = 0.0
    budget_usd: float = 0.0
    period: Literal["hour", "day", "week", "month"] = "day"
    idle_timeout_s: float = 300.0
    min_pods: int = 0
    max_pods: int = 1
    gpu_types: list[str] = []  # preferred RunPod GPU type ids, in order; empty: the cheapest that fits
    gpu_count: int = 1
    spot: bool = False
    busy_in_flight: int = 4
    image: str = ""  # the pod's container image (a coderai worker image); empty: the broker's default
    # a RunPod network volume id: attached to each pod (at /workspace), where its worker keeps the weights it
    # fetches by the model's `source`, so the next pod finds them there and starts warm
    volume: str = ""
    # RunPod serverless (docs/pods.md#serverless): escalate to this endpoint (its id) instead of renting a pod; its
    # OpenAI route serves the requests, each booked at `serverless_usd_per_s` x its seconds (RunPod bills flex
    # workers by the second, rounded up) + `serverless_usd_per_request`, under the same caps and budgets
    serverless_endpoint: str = ""
    serverless_model: str = ""  # the model name the endpoint serves; empty: this model's name
    serverless_usd_per_s: float = 0.0
    serverless_usd_per_request: float = 0.0
    serverless_max_s: float = 300.0  # a request's longest run: each reserves its price for this long, then is cut

    def __post_init__(self) -> None:
        if self.serverless_endpoint and not SERVERLESS_ENDPOINT_ID.match(self.serverless_endpoint):
            raise ValueError(
                f"pod.serverless_endpoint {self.serverless_endpoint[:80]!r} is not a RunPod endpoint id "
                "(lowercase letters and digits, inner hyphens, at most 64)"
            )
        if min(self.serverless_usd_per_s, self.serverless_usd_per_request) < 0:
            raise ValueError("pod.serverless_usd_per_s and pod.serverless_usd_per_request may not be negative")
        if not 0 < self.serverless_max_s <= 3600:
            raise ValueError("pod.serverless_max_s must be above 0 and at most 3600")


class ModelConfig(Message, frozen=True, kw_only=True):
    """One servable model. `params` go to the engine's constructor unchanged (n_ctx, n_threads, ...); the code that
    reads one itself does it with `param_int`, `param_float`, `param_str`, `param_bool`, `param_strs` or
    `param_table`, which convert it as int(), float(), ... would, and name it when its value is of another kind.

    `nodes` restricts placement to the named nodes; empty means every node that runs the engine family.
    """

    name: str
    engine: EngineFamily
    path: str
    # relative to the head's model store: the file `path` names, or (ending in "/") a folder, every file of which a
    # node without `path` fetches from there; `store_file`: with a folder, the file inside it that `path` names
    # (piper's .onnx beside its .onnx.json), empty when `path` is the folder itself
    store_path: str = ""
    store_file: str = ""
    # where a node without `path` (a rented pod) fetches the weights: hf://org/repo[/file][@revision], a catalogue
    # id, or store://<path in the head's model store> (coderai.catalog.source)
    source: str = ""
    params: dict[str, object] = {}
    ops: list[Op] = []
    nodes: list[str] = []
    replicas: int = 0  # 0: every node that can run it and has room; N: N copies, re-placed when a holder leaves
    placement: Literal["spread", "binpack"] = "spread"
    memory_mb: int = 0  # what one copy needs; 0: estimated from the file (size x 1.2 + 256 MB)
    price_prompt_per_mtok: float = 0.0  # USD per million prompt tokens, for key budgets and usage
    price_completion_per_mtok: float = 0.0
    # images and videos: USD per megapixel x denoising step (width x height x steps x n, x frames for a video), on
    # top of the prompt's tokens; the work's limits are the family's params (coderai/media_work.py, docs/accounts.md)
    price_per_mpixel_step: float = 0.0
    pin: str = ""  # route every request to this engine or node id
    allow_fallback: bool = False  # when the pinned engine is down, route elsewhere instead of failing
    distribute: Distribute = Distribute()
    pod: PodPolicy = PodPolicy()
    owned_by: str = "coderai"
    owner: str = ""  # the API key that made it (a fine-tuned model): listed, used and deleted by it and admin keys only; "": every key
    created: int = 0
    # llama.cpp over several machines: `split` is how a model that fits no single node is cut (`off`: never);
    # `rpc_nodes` splits it over those nodes' RPC servers even when it would fit one node; `link_gbps` is the
    # link speed between them (0: unknown), below 10 a row split is answered with a warning
    split: SplitMode | Literal["off"] = "layer"
    rpc_nodes: list[str] = []
    link_gbps: float = 0.0
    shards: SplitPlan | None = None  # set by the scheduler in an assignment only: the devices holding this copy
    # residency (docs/models.md): "always" stays loaded and is never evicted; "on_demand" loads on the first request
    # for it and unloads after `keep_alive_s` idle; "" (auto): loaded while it fits, else loaded on demand and
    # evicted (least recently used first) to make room for another
    resident: Literal["", "always", "on_demand"] = ""
    keep_alive_s: float | None = (
        None  # idle seconds before unloading; None: 300 for on_demand, never otherwise; < 0 never
    )
    min_replicas: int = (
        0  # copies kept loaded across the cluster whatever the demand (never evicted, never idle-unloaded)
    )
    max_replicas: int = 0  # at most this many copies across the cluster (0: no cap beyond `replicas`)
    devices: list[int] = []  # set by the scheduler in an assignment only: the GPUs (indices on the node) of this copy
    # a request is admitted to an engine of it while its expected wait for a slot (jobs ahead per slot x the recent
    # time a job held one) is under this; past it, 429 busy with that wait as Retry-After. 0: the worker's default
    queue_time_s: float = 0.0
    # output tokens of one request, on every API (Chat max_tokens / max_completion_tokens, Responses
    # max_output_tokens, Messages max_tokens, Ollama num_predict): `default_output_tokens` when it names none, and
    # never more than `max_output_tokens` (a request above is capped, and ends as its API says a cut answer does).
    # 0: no default (the engine's own) / no ceiling
    default_output_tokens: int = 0
    max_output_tokens: int = 0
    # stop sequences added to every chat and completion of the model, beside the request's own (Ollama's
    # `PARAMETER stop`): for a model that does not end its turn by itself, such as a base model behind an agent
    stop: list[str] = []
    # whether requests of different API keys may reuse each other's cached prompt prefixes (docs/routing.md#tenants):
    # True: one cache for all (fastest: a common system prompt is computed once); False: affinity and the engine's
    # cache are scoped by key (a llama-server then runs without its shared host RAM cache, `--cache-ram 0`); None:
    # the gateway's CODERAI_GATEWAY_SHARE_CACHE (default true). A key's own `share_cache` true also shares
    share_cache: bool | None = None

    def serves(self) -> list[Op]:
        """The ops this model answers: explicit `ops`, else the engine family's default."""
        if self.ops:
            return list(self.ops)
        return list(DEFAULT_OPS.get(self.engine, ()))

    def keep_alive(self, asked: float | None = None) -> float | None:
        """Idle seconds before a copy may be unloaded: `asked` (its last request's keep_alive), else the model's,
        else ON_DEMAND_KEEP_ALIVE_S for an on_demand model; None: never (an `always` model, or one below 0)."""
        k = asked if asked is not None else self.keep_alive_s
        if k is None and self.resident == "on_demand":
            k = ON_DEMAND_KEEP_ALIVE_S
        return None if k is None or k < 0 or self.resident == "always" else k

    # --- reading one param: a param that is absent, null or "" is unset (as coderai.engine_params checks them), and
    # gives `default`; without a default, None (`cfg.param_int("parallel") or DEFAULT_PARALLEL` when 0 means unset too)

    def _param(self, key: str) -> object:
        value = self.params.get(key)
        return None if value is None or value == "" else value

    @overload
    def param_int(self, key: str) -> int | None: ...
    @overload
    def param_int(self, key: str, default: int) -> int: ...
    def param_int(self, key: str, default: int | None = None) -> int | None:
        """int() of param `key` (a number, truncated, or a numeric string); a value of another kind: TypeError or
        ValueError naming it."""
        value = self._param(key)
        return default if value is None else as_int(value, f"params.{key}")

    @overload
    def param_float(self, key: str) -> float | None: ...
    @overload
    def param_float(self, key: str, default: float) -> float: ...
    def param_float(self, key: str, default: float | None = None) -> float | None:
        """float() of param `key` (a number or a numeric string); a value of another kind: TypeError or ValueError
        naming it."""
        value = self._param(key)
        return default if value is None else as_float(value, f"params.{key}")

    @overload
    def param_str(self, key: str) -> str | None: ...
    @overload
    def param_str(self, key: str, default: str) -> str: ...
    def param_str(self, key: str, default: str | None = None) -> str | None:
        """Param `key`, a string; a value of another kind: TypeError naming it."""
        value = self._param(key)
        return default if value is None else as_str(value, f"params.{key}")

    def param_bool(self, key: str, default: bool = False) -> bool:
        """Whether param `key` is set to a true value (its truthiness: false, 0, [] are false)."""
        value = self._param(key)
        return default if value is None else bool(value)

    def param_strs(self, key: str) -> list[str]:
        """Param `key`, a list of strings ([] when unset); a value of another kind: TypeError naming it."""
        value = self._param(key)
        return [] if value is None else as_strs(value, f"params.{key}")

    def param_table(self, key: str) -> dict[str, object]:
        """Param `key`, a table ({} when unset); a value of another kind: TypeError naming it."""
        value = self._param(key)
        return {} if value is None else as_table(value, f"params.{key}")
