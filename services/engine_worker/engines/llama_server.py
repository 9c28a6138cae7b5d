"""llama.cpp's own server (`llama-server`) as a supervised child: one process per model, many users at once.

The server runs `--parallel N` slots with continuous batching, the model's own chat template (`--jinja`: tool
calls, reasoning), and its prompt cache; the worker relays jobs over loopback HTTP (see openai_server). A child
that dies is restarted with backoff (child_server) while the engine is reported failed, with the last lines of its
log; it never outlives the worker (PR_SET_PDEATHSIG SIGKILL from the thread that started it, its own session killed on close:
its SIGTERM shutdown can wait forever on a connection handler, and it has nothing to save).

Model params and the command line: llama_server_args.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec

from coderai.contracts import ChatJob, Choice, CompletionJob, EmbedJob, EmbedResult, ModelConfig, Usage
from coderai.engine_worker.engines.base import BadInput, CancelFlag, EngineLoadError, refuse_media
from coderai.engine_worker.engines.embed import check_texts, embed_result
from coderai.engine_worker.engines.hf_chat import unpack_adapter
from coderai.engine_worker.engines.llama_server_args import (
    DEFAULT_HEAD_SNAPSHOTS_MB,
    DEFAULT_N_CTX,
    DEFAULT_PARALLEL,
    NAMED,
    OWN_PARAMS,
    cache_ram_mb,
    default_cache_ram_mb,
    find_binary,
    offload,
    offload_of,
    server_args,
    server_env,
    slot_load,
)
from coderai.engine_worker.engines.lora_gguf import gguf_lora
from coderai.engine_worker.engines.openai_server import Emit, OpenAIServerEngine
from coderai.engine_worker.engines.prompt_heads import MIN_HEAD_CHARS, HeadSnapshots, chat_chain, text_chain
from coderai.engine_worker.engines.server_load import ServerLoad, read_llama
from coderai.engine_worker.engines.slot_scope import ALL, Chain, Plan, SlotBook

# the command line's names, as they were found here before llama_server_args
__all__ = [
    "DEFAULT_N_CTX",
    "DEFAULT_PARALLEL",
    "NAMED",
    "OWN_PARAMS",
    "LlamaServerEngine",
    "available",
    "cache_ram_mb",
    "default_cache_ram_mb",
    "find_binary",
    "offload_of",
    "server_args",
    "server_env",
    "slot_load",
]

log = logging.getLogger("coderai.engine_worker")
MAX_QUEUED = 256  # jobs waiting for a slot at most, unless the model's `queue` says otherwise
MEDIA_WITH_PROJECTOR = frozenset({"image_url", "input_audio"})  # what llama.cpp's mtmd reads with an mmproj


class LlamaServerEngine(OpenAIServerEngine):
    """One GGUF model served by a supervised `llama-server` child with `parallel` slots."""

    family = "llama-server"
    label = "llama-server"
    key_env = "LLAMA_API_KEY"  # /health and /v1/models stay open; chat, /metrics and /slots want the key
    death_signal = signal.SIGKILL  # once its cleanup began, a second signal was needed to end it (CI, 2026-12-01)
    # a completion whose prompt is "" (alone or in a list) with n > 1 is never ended by llama-server: the empty
    # prompt's slot is released without a result, so the request waits forever (refused with a 400 instead)
    empty_prompt_choices = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.slots = config.param_int("parallel") or DEFAULT_PARALLEL
        # one engine thread a slot: the worker's queue is the queue (a queued job is known as such, its keep-alives
        # say so and the gateway can time it out), and the server never holds jobs of its own
        self.max_concurrency = self.slots
        # beyond: `busy` (429). Admission is by expected wait (`queue_time_s`, the worker's); this only bounds memory
        self.queue_limit = self.slots + config.param_int("queue", MAX_QUEUED)
        self.server_load = ServerLoad()  # running, waiting and KV share, as the server last said (`_read_load`)
        self.backend = ""  # "cpu", or the GPU backend the layers went to ("cuda", ...), read from the log
        self.gpu_layers = 0
        # which key's prompt each slot holds, once a request's cache is scoped (slot_scope); the plan of the request
        # this engine thread runs, for its body
        # snapshots of long prompt heads (prompt_heads): on a shared cache with more than one slot; the book then
        # places shared requests itself, so that it knows which slot holds which prompt
        mb = config.param_int("head_snapshots_mb", DEFAULT_HEAD_SNAPSHOTS_MB)
        self.heads = HeadSnapshots(mb << 20) if mb > 0 and self.slots > 1 and config.share_cache is not False else None
        self.book = SlotBook(
            self.slots,
            isolated=config.share_cache is False,
            ram_cache=cache_ram_mb(config) > 0,
            place_shared=self.heads is not None,
        )
        self._plan = threading.local()
        self.lora: Path | None = None  # a fine-tuned model's adapter as a GGUF LoRA, applied to every request

    def command(self, port: int) -> tuple[list[str], dict[str, str]]:
        binary = find_binary()
        if not binary:
            raise EngineLoadError(
                "llama-server not found: run scripts/setup (it builds .venv/bin/llama-server), "
                "install llama.cpp, or set CODERAI_LLAMA_SERVER to its path"
            )
        heads = ["--slot-save-path", self.heads.dir] if self.heads is not None else []
        lora = ["--lora", str(self.lora)] if self.lora is not None else []
        config = self.server_config()
        return [binary, *server_args(config, port), *heads, *lora], server_env(config, dict(os.environ))

    def server_config(self) -> ModelConfig:
        """The config the server's flags are made from: a fine-tuned model's base GGUF (its `path` is the
        adapter); a split model adds its plan's."""
        base = self.config.param_str("base")
        return msgspec.structs.replace(self.config, path=base) if base else self.config

    def model_file(self) -> str:
        """The GGUF the server loads, checked to be there; a fine-tuned model's adapter is converted to a GGUF LoRA
        here once (`self.lora`), to run over its base GGUF."""
        gguf = os.path.expanduser(self.config.param_str("base") or self.config.path)
        if not os.path.exists(gguf):
            raise EngineLoadError(f"no such model file: {gguf}")
        if self.config.param_str("base"):
            adapter = Path(os.path.expanduser(self.config.path))
            if not adapter.exists():
                raise EngineLoadError(f"no such adapter: {self.config.path}")
            folder = unpack_adapter(adapter)
            # a tar's (a node's upload): the GGUF goes beside its folder, never one the tar brought along
            out = None if adapter.is_dir() else folder.with_name(f"{folder.name}.gguf")
            self.lora = gguf_lora(folder, self.config.param_str("hf_path") or "", out)
        return gguf

    def load(self) -> None:
        self.model_file()
        config = self.server_config()
        self.start_server()
        cmd, env = self.command(0)
        self.backend, self.gpu_layers = offload(config, self.child.log_head(), cmd[0], env)
        # the supervisor reads the slot load while the child lives and restarts it when it dies; it starts every
        # later child, so each dies with it (PR_SET_PDEATHSIG)
        self.supervise(on_alive=self._read_load)

    def media_takes(self) -> frozenset[str]:
        # without a projector the server answers a 500 for an image; the client's mistake is a 400 naming the part
        return MEDIA_WITH_PROJECTOR if self.config.params.get("mmproj") else frozenset()

    def chat_body(self, job: ChatJob, stream: bool) -> dict[str, Any]:
        refuse_media(job.messages, self.config.name, self.media_takes())
        body = self._placed_body(super().chat_body(job, stream))
        scale = (job.options or {}).get("lora_scale")
        if isinstance(scale, (int, float)) and self.lora is not None:  # the one `--lora` adapter, at this scale
            body["lora"] = [{"id": 0, "scale": float(scale)}]
        return body

    def completion_body(self, job: CompletionJob, stream: bool) -> dict[str, Any]:
        return self._placed_body(super().completion_body(job, stream))

    def chat(self, job: ChatJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        chain: Chain = ()
        head_chars = 0
        head: int | None = None
        if self.heads is not None:
            chain, head_chars = chat_chain(job.messages, job.tools)
            if head_chars >= MIN_HEAD_CHARS:
                head = chain[0][0]
        with self._placed(job.cache_scope, job.params.n > 1, chain, head, head_chars):
            return super().chat(job, cancel, emit)

    def complete(self, job: CompletionJob, cancel: CancelFlag, emit: Emit | None) -> tuple[list[Choice], Usage]:
        several = job.params.n > 1 or (isinstance(job.prompt, list) and len(job.prompt) > 1)
        prompt = job.prompt if isinstance(job.prompt, str) else (job.prompt[0] if job.prompt else "")
        chain = text_chain(prompt) if self.heads is not None else ()
        with self._placed(job.cache_scope, several, chain):
            return super().complete(job, cancel, emit)

    @contextlib.contextmanager
    def _placed(
        self, scope: str, several: bool, chain: Chain = (), head: int | None = None, head_chars: int = 0
    ) -> Iterator[None]:
        """The request runs where the slot book places it (a slot of its own scope, or one without reuse; a shared
        request, on a server with head snapshots, where its prompt lies, the head restored there if it is not)."""
        shared_before = not self.book.no_reuse
        plan = self.book.take(scope, several, chain if self.heads is not None else None)
        if shared_before and self.book.no_reuse:
            log.warning(
                "%s: a request whose prompt cache is its key's own came to a server with a host RAM cache "
                "shared by every slot: prompt reuse is off on this server from now on (give the model "
                "share_cache = false, or the worker CODERAI_SHARE_CACHE=false, for per-key reuse)",
                self.config.name,
            )
        shared = self._shared_book()
        heads = self.heads if plan.slot not in (None, ALL) and not scope and shared else None
        if heads is not None and head is not None and plan.shared < head_chars and heads.has(head):
            if self._slot_action(plan.slot, "restore", heads.name(head)):
                heads.restores += 1
        self._plan.value = plan
        save = False
        try:
            yield
            save = heads is not None and head is not None and heads.claim(head)
        finally:
            self._plan.value = None
            if save:  # the slot stays taken until its prompt is saved; the answer is not held up
                threading.Thread(
                    target=self._save_head, args=(plan, chain, head), daemon=True, name=f"save-head-{self.config.name}"
                ).start()
            else:
                self.book.give(plan, scope, chain)

    def _shared_book(self) -> bool:
        """Whether the book still shares every slot; once it does not, the snapshots are deleted: a shared one
        must never fill a slot another key's request may get."""
        if self.book.isolated or self.book.no_reuse:
            if self.heads is not None:
                self.heads.clear()
            return False
        return True

    def _save_head(self, plan: Plan, chain: Chain, head: int) -> None:
        assert self.heads is not None
        try:
            ok = self._slot_action(plan.slot, "save", self.heads.name(head))
            self.heads.saved(head, ok and self._shared_book())
        finally:
            self.book.give(plan, "", chain)

    def _slot_action(self, slot: int | None, action: str, filename: str) -> bool:
        """`save` or `restore` slot `slot` to or from `filename` in the snapshot folder; False when it failed (then
        the request prefills as it would have)."""
        client = self.client
        if client is None:
            return False
        try:
            r = client.post(f"/slots/{slot}?action={action}", msgspec.json.encode({"filename": filename}))
        except Exception as exc:  # a snapshot is an optimisation: the request goes on without it
            log.debug("%s: slot %s %s failed: %s", self.config.name, slot, action, exc)
            return False
        if r.status != 200:
            log.debug("%s: slot %s %s answered %s: %s", self.config.name, slot, action, r.status, r.body[:200])
        return r.status == 200

    def _placed_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body with the request's slot and whether it may reuse that slot's prefix, when the book placed it;
        set last, so nothing else in the body can choose them."""
        plan: Plan | None = getattr(self._plan, "value", None)
        if plan is None or (plan.slot is None and plan.reuse):
            return body
        placed: dict[str, Any] = {**body, "cache_prompt": plan.reuse}
        if plan.slot is not None and plan.slot != ALL:
            placed["id_slot"] = plan.slot
        return placed

    def embed(self, job: EmbedJob, cancel: CancelFlag, emit: Any) -> tuple[EmbedResult, Usage]:
        """One normalised vector per input, from the server's /v1/embeddings (a model served with `embedding`)."""
        if "embed" not in self.config.serves():
            raise BadInput(f'model {job.model!r} does not serve embeddings (give it ops = ["embed"])', "model")
        check_texts(job.input)
        answer = self.post_json(
            "/v1/embeddings",
            {"model": self.config.name, "input": list(job.input), "encoding_format": "float"},
            job.request_id,
        )
        rows = sorted(answer["data"], key=lambda d: d["index"])
        tokens = int((answer.get("usage") or {}).get("prompt_tokens") or 0)
        return embed_result([d["embedding"] for d in rows], job.dimensions), Usage(
            prompt_tokens=tokens, total_tokens=tokens
        )

    def stats(self) -> dict[str, Any]:
        heads = self.heads
        return {
            **super().stats(),
            "slots": self.slots,
            **self.server_load.stats(),
            "backend": self.backend,
            "gpu_layers": self.gpu_layers,
            "head_saves": heads.saves if heads else 0,
            "head_restores": heads.restores if heads else 0,
        }

    def close(self) -> None:
        super().close()
        if self.heads is not None:
            self.heads.close()

    def _read_load(self, probe: httpx.Client) -> None:
        try:
            self.server_load = read_llama(probe, self.child.base_url)
        except httpx.HTTPError:
            pass  # the next poll sees whether it died

    def _lost(self, why: str) -> None:
        self.server_load = ServerLoad()
        super()._lost(why)

    def _restarted(self) -> None:
        self.book.reset()  # the new server's slots are empty
        if self.heads is not None:
            self.heads.clear()
        super()._restarted()


def available() -> bool:
    """Whether this machine has a llama-server to run (the family's probe)."""
    return find_binary() is not None
