"""Which files of the head's model store a node may read (`coderai.cmd.store.fetch` / `store.list`): those of the
models it is assigned (a pod: the model it was rented for) and the data of the fine-tuning jobs it trains. Pure: the
service hands in what the node holds. A request for anything else is refused before the store is looked at, so a
node learns nothing of other files, not even whether they exist."""

from __future__ import annotations

from collections.abc import Iterable

from coderai.contracts import ModelConfig
from coderai.contracts.training import FineTuneJob, TERMINAL


def model_paths(m: ModelConfig) -> list[str]:
    """The store paths a copy of `m` may fetch: its `store_path` (a file, or a folder ending in "/") and the path of
    a `store:` source."""
    out = [m.store_path] if m.store_path else []
    if m.source.startswith("store:"):
        out.append(m.source.removeprefix("store:"))
    return out


def job_paths(job: FineTuneJob) -> list[str]:
    """The store files a rank of a running fine-tuning job reads: its staged training and validation data."""
    if job.status in TERMINAL:
        return []
    out = [f"finetune/{job.id}/train.jsonl"]
    if job.validation_file:
        out.append(f"finetune/{job.id}/valid.jsonl")
    return out


def grants(node_id: str, models: Iterable[ModelConfig], jobs: Iterable[FineTuneJob]) -> list[str]:
    """Every store path `node_id` may read, from the models it holds and the jobs it trains."""
    out = [p for m in models for p in model_paths(m)]
    out += [p for j in jobs if node_id in j.nodes for p in job_paths(j)]
    return out


def may_read(path: str, folder: bool, granted: Iterable[str]) -> bool:
    """Whether `path` (a file, or with `folder` a folder's listing) is one of `granted` or inside a granted folder.
    Paths are compared as the store checked them (`check_store_path`: no `..`, nothing absolute)."""
    want = path.removesuffix("/")
    for g in granted:
        if g.endswith("/"):
            base = g.removesuffix("/")
            if want == base and folder or want.startswith(base + "/"):
                return True
        elif not folder and want == g:
            return True
    return False
