from __future__ import annotations

from coderai.runtime.settings import CommonSettings


class WorkerSettings(CommonSettings, frozen=True, kw_only=True):
    """`CODERAI_WORKER_*`."""

    heartbeat_s: float = 2.0
    keepalive_s: float = 1.0  # a frame at least this often while a job is queued or prefilling
    # how long in-flight jobs may take to finish when their model is unloaded (evicted, removed, moved) or reloaded
    # with another config (jobs that come meanwhile wait for the new copy), or on SIGTERM
    drain_timeout_s: float = 15.0
    families: list[str] = []  # engine families to offer; empty: every one whose library is installed
    mdns: bool = True  # with a cluster token: announce this node, and find the head when no NATS URL is given
    mdns_interfaces: list[str] = []  # addresses to announce and browse on; empty: every interface
    announce_nats_port: int = 0  # set on the head's own worker: the NATS port nodes should join
    # honour `python`, `env` and `extra_args` in the params of models that come over the bus (what runs, with what
    # environment): off, they are dropped, so whoever could write an assignment still could not run a program here;
    # `coderai up` turns it on for its own worker, whose models file is its operator's own
    bus_exec: bool = False
    # the prompt-cache sharing of a model that does not say (ModelConfig.share_cache), as the gateway's
    # CODERAI_GATEWAY_SHARE_CACHE: off, such a model's llama-server runs without its shared host RAM cache and keeps
    # per-key slots. CODERAI_SHARE_CACHE sets both
    share_cache: bool = True
    announce_fingerprint: str = ""  # set on the head's own worker (which has no token): the cluster it announces
    discover_timeout_s: float = 60.0
    pod: str = ""  # set by the pod-broker on a rented pod: its name (the node id it heartbeats under)
    models_json: str = ""  # a fixed assignment (JSON list of model configs) instead of watching coderai_assignments
    # where weights fetched by a model's `source` are kept (its pulled-files index too); the broker sets it to a
    # pod's RunPod network volume, so the next pod finds them; empty: <data_dir>/models
    weights_dir: str = ""
    train_addr: str = ""  # fine-tuning: the address other ranks reach this node at; empty: picked (docs/finetuning.md)
    # offer this machine's CPU as a ggml RPC server, to hold layers of models split over several nodes. ggml RPC
    # has no authentication: it is bound to the cluster interface (the address this node reaches the bus from,
    # or `rpc_bind`) and admits only nodes the scheduler names; every interface needs `rpc_allow_any`
    rpc: bool = False
    rpc_port: int = 50052  # 0: any free port
    rpc_bind: str = ""  # the RPC gate's address; empty: the cluster interface
    rpc_allow_any: bool = False  # allow binding the RPC gate to every interface (0.0.0.0, ::)
    rpc_threads: int = 0  # 0: every core
    # RAM (MB) the models placed here may use in all (the heartbeat's mem_budget); 0: 90 % of it
    memory_budget_mb: int = 0
    # thermal supervision (docs/reliability.md): a GPU (or the machine, read from its thermal zones) at or over this
    # many °C takes no new work until it is below `thermal_resume_c`; read from NVML, else nvidia-smi, else
    # /sys/class/thermal. 0: not watched
    thermal_limit_c: float = 90.0
    # °C below which a hot GPU (or machine) takes work again; at or over the limit: as soon as it is below the limit
    thermal_resume_c: float = 80.0
    thermal_poll_s: float = 5.0  # how often temperatures are read
    # read temperatures from this file instead (a test, or a sensor of your own): a JSON number (the machine, °C)
    # or an object of sensors, a GPU's index or "node", to °C, e.g. {"0": 91.5}
    thermal_file: str = ""

    def __post_init__(self) -> None:
        if self.thermal_poll_s <= 0:
            raise ValueError(f"CODERAI_WORKER_THERMAL_POLL_S must be over 0 (is {self.thermal_poll_s:g})")
