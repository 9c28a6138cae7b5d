"""Fan-out: split one media request into parts for several workers, and merge their answers into one.

Pure functions over the contract structs (no bus, no I/O). The contract: `merge(plan(job))` of the parts' answers is
what one engine given the whole job would have answered (images: the same pictures, because an engine draws image
i with seed `seed + i`; embeddings, rerank scores, OCR pages: the same rows in the same order; speech and
transcription: the same audio and text up to the cuts, which fall between sentences and inside silences).

The gateway base install has only msgspec and the stdlib: transcription (PyAV, numpy) and PDF (pypdfium2) plans
import lazily and answer "do not split" where their library is missing, so the job still runs, on one engine.
"""

from __future__ import annotations

import io
import secrets
from collections.abc import Callable
from typing import Any

from msgspec.structs import replace

from coderai.contracts import Distribute, Usage
from coderai.contracts.media import (
    Blob,
    EmbedJob,
    EmbedResult,
    ImageJob,
    ImageResult,
    OcrJob,
    OcrResult,
    Output,
    RerankJob,
    RerankResult,
    SpeechResult,
    TranscribeResult,
)
from coderai.gateway.fanout import audio
from coderai.gateway.fanout.parts import MergeError, Plan, chunk_sizes

__all__ = ["MergeError", "Plan", "chunk_sizes", "merge", "plan"]


def plan(op: str, job: Any, parts_hint: int, d: Distribute) -> Plan | None:
    """The sub-jobs (same struct type as `job`, request_id kept, each a valid job) in order, or None when the job
    should not be split (op not splittable, too few items, disabled, job.stream true, a needed library missing).
    parts_hint = number of workers holding the model; parts = min(hint, d.max_parts, items).

    Transcribe and OCR plans decode the upload (seconds of CPU for an hour of audio): call them off the event loop,
    e.g. `await asyncio.to_thread(plan, ...)`."""
    planner = _OPS[op][0] if op in _OPS else None
    # streamed answers go out as the engine makes them, so there is nothing to gather and merge
    if planner is None or not d.enabled or getattr(job, "stream", False) or min(parts_hint, d.max_parts) < 2:
        return None

    def count(items: int) -> int:
        if items < max(2, d.min_items):
            return 0
        n = min(parts_hint, d.max_parts, items)
        return n if n >= 2 else 0

    return planner(job, count)


def merge(op: str, job: Any, plan: Plan, outputs: list, usages: list[Usage | None]) -> tuple[Output, Usage]:
    """The parts' outputs (in part order) into the single answer `job` would have had; usage summed."""
    if len(outputs) != len(plan.jobs):
        raise MergeError(f"{op}: {len(outputs)} answers for {len(plan.jobs)} parts")
    if op not in _OPS:
        raise MergeError(f"{op}: not an op that fans out")
    _, merger, kind = _OPS[op]
    for i, out in enumerate(outputs):
        if not isinstance(out, kind):
            raise MergeError(f"{op}: part {i} answered {type(out).__name__}, not {kind.__name__}")
    us = [u for u in usages if u is not None]  # a part that reported no usage counts as zero
    total = Usage(
        prompt_tokens=sum(u.prompt_tokens for u in us),
        completion_tokens=sum(u.completion_tokens for u in us),
        total_tokens=sum(u.total_tokens for u in us),
    )
    return merger(job, plan, outputs), total


# --- item lists: image, embed, rerank ---------------------------------------------------------------------------


def _plan_image(job: ImageJob, count: Callable[[int], int]) -> Plan | None:
    k = count(job.n)
    if not k:
        return None
    # without a seed each engine would draw its own and the reported seeds would not reproduce the set; the
    # engines accept 0..2**63-1-n, and 2**31 matches what an engine draws for itself
    base = job.seed if job.seed is not None else secrets.randbelow(2**31)
    jobs, start = [], 0
    for size in chunk_sizes(job.n, k):
        jobs.append(replace(job, n=size, seed=base + start))
        start += size
    return Plan(jobs, [0.0] * k)


def _split_list(job: EmbedJob | RerankJob, field: str, count: Callable[[int], int]) -> Plan | None:
    items = getattr(job, field)
    k = count(len(items))
    if not k:
        return None
    jobs, start = [], 0
    for size in chunk_sizes(len(items), k):
        jobs.append(replace(job, **{field: items[start : start + size]}))
        start += size
    return Plan(jobs, [0.0] * k)


def _merge_image(job: ImageJob, plan: Plan, outputs: list[ImageResult]) -> ImageResult:
    images, seeds = [], []
    for part, out in zip(plan.jobs, outputs):
        if len(out.images) != part.n:
            raise MergeError(f"image: a part asked for {part.n} images answered {len(out.images)}")
        images += out.images
        # an engine that leaves seeds out still used seed + i (see the module docstring)
        seeds += out.seeds or [part.seed + i for i in range(part.n)]
    return ImageResult(images=images, seeds=seeds)


def _merge_embed(job: EmbedJob, plan: Plan, outputs: list[EmbedResult]) -> EmbedResult:
    dims = {o.dim for o in outputs}
    if len(dims) != 1:
        raise MergeError(f"embed: parts answered different dimensions {sorted(dims)}")
    dim = dims.pop()
    for part, out in zip(plan.jobs, outputs):
        if out.count != len(part.input) or len(out.vectors) != out.count * dim * 4:
            raise MergeError(f"embed: a part of {len(part.input)} inputs answered {out.count} vectors")
    return EmbedResult(vectors=b"".join(o.vectors for o in outputs), count=sum(o.count for o in outputs), dim=dim)


def _merge_rerank(job: RerankJob, plan: Plan, outputs: list[RerankResult]) -> RerankResult:
    for part, out in zip(plan.jobs, outputs):
        if len(out.scores) != len(part.documents):
            raise MergeError(f"rerank: a part of {len(part.documents)} documents answered {len(out.scores)} scores")
    return RerankResult(scores=[s for o in outputs for s in o.scores])


# --- OCR: PDF page ranges ---------------------------------------------------------------------------------------


def _plan_ocr(job: OcrJob, count: Callable[[int], int]) -> Plan | None:
    data = job.file.data
    if not data.startswith(b"%PDF"):
        return None  # an image is one page; a stored blob is read by the engine
    try:
        import pypdfium2 as pdfium

        src = pdfium.PdfDocument(data)
    except ImportError:
        return None
    except pdfium.PdfiumError:
        return None  # the engine reports the broken file
    try:
        k = count(len(src))
        if not k:
            return None
        jobs, start = [], 0
        for i, size in enumerate(chunk_sizes(len(src), k)):
            part = pdfium.PdfDocument.new()
            part.import_pages(src, list(range(start, start + size)))
            buf = io.BytesIO()
            part.save(buf)
            part.close()
            body = buf.getvalue()
            jobs.append(
                replace(
                    job, file=Blob(data=body, size=len(body), content_type="application/pdf", filename=f"part-{i}.pdf")
                )
            )
            start += size
        return Plan(jobs, [0.0] * k)
    finally:
        src.close()


def _merge_ocr(job: OcrJob, plan: Plan, outputs: list[OcrResult]) -> OcrResult:
    pages = [p for o in outputs for p in o.pages]
    return OcrResult(pages=[replace(p, index=i) for i, p in enumerate(pages)])


# op -> (planner, merger, the result type every part must answer)
_OPS: dict[
    str, tuple[Callable[[Any, Callable[[int], int]], Plan | None], Callable[[Any, Plan, list], Output], type]
] = {
    "image": (_plan_image, _merge_image, ImageResult),
    "embed": (lambda job, count: _split_list(job, "input", count), _merge_embed, EmbedResult),
    "rerank": (lambda job, count: _split_list(job, "documents", count), _merge_rerank, RerankResult),
    "speech": (audio.plan_speech, audio.merge_speech, SpeechResult),
    "transcribe": (audio.plan_transcribe, audio.merge_transcribe, TranscribeResult),
    "ocr": (_plan_ocr, _merge_ocr, OcrResult),
}
