"""Text from images and PDFs with RapidOCR (PP-OCR models on onnxruntime, shipped inside the `rapidocr` wheel).

The model `path` is ignored ("builtin" by convention): the detection, orientation and recognition models come
with the library, so nothing is fetched. A PDF (bytes starting `%PDF`) is rendered page by page with pypdfium2;
a multi-page TIFF gives one page per frame; any other image is one page. Each page's lines come back in reading
order (rows top to bottom, each row left to right) with their boxes in page pixels, and the page text is those
lines joined by newlines.

Model params: `threads` (onnxruntime threads, default every core), `scale` (PDF render scale, default 2.0, i.e.
144 dpi), `max_pages` (default 50), `max_side` (longest side in pixels handed to the model, default 4096; bigger
images are scaled down and their boxes scaled back), `rapidocr` (a dict of RapidOCR's own dotted settings, e.g.
{"Global.text_score" = 0.6}).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from typing import Any

from coderai.contracts import ModelConfig, Usage
from coderai.contracts.media import OcrJob, OcrLine, OcrPage, OcrResult
from coderai.engine_worker.engines.base import BadInput, CancelFlag, Engine, EngineLoadError

ACCEPTED = "an image (PNG, JPEG, WebP, BMP, TIFF, GIF) or a PDF"


class OcrEngine(Engine):
    family = "ocr"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.reader: Any = None
        self.scale = config.param_float("scale", 2.0)
        self.max_pages = config.param_int("max_pages", 50)
        self.max_side = config.param_int("max_side", 4096)

    def load(self) -> None:
        try:
            from rapidocr import RapidOCR
        except ImportError as exc:
            raise EngineLoadError("rapidocr is not installed: pip install 'coderai[ocr]'") from exc
        threads = max(1, self.config.param_int("threads") or os.cpu_count() or 1)
        options = {
            "Global.log_level": "error",  # its info lines name model files on every start; blank pages warn
            "EngineConfig.onnxruntime.intra_op_num_threads": threads,
            "EngineConfig.onnxruntime.inter_op_num_threads": 1,
            **self.config.param_table("rapidocr"),
        }
        try:
            self.reader = RapidOCR(params=options)
            # RapidOCR opens its models on first use; open them now so a broken install fails the load, not a job
            for step in ("_load_det_model", "_load_cls_model", "_load_rec_model"):
                if callable(getattr(self.reader, step, None)):
                    getattr(self.reader, step)()
        except (OSError, ValueError, TypeError, RuntimeError, KeyError) as exc:
            raise EngineLoadError(f"RapidOCR could not start: {exc}") from exc

    def close(self) -> None:
        self.reader = None

    def ocr(self, job: OcrJob, cancel: CancelFlag, emit: Callable[..., None] | None) -> tuple[OcrResult, Usage]:
        """Every page of `job.file` read; a cancelled job stops between pages."""
        count, images = self._open(job.file.data)
        pages: list[OcrPage] = []
        for index, image in enumerate(images):
            if cancel:
                break  # nobody reads the answer any more
            pages.append(self._read(index, image))
            if emit is not None and count > 1:
                emit(progress=(index + 1) / count)
        return OcrResult(pages=pages), Usage()

    # --- input --------------------------------------------------------------------------------

    def _open(self, data: bytes) -> tuple[int, Iterator[Any]]:
        """The page count and the pages as RGB PIL images, made one at a time (fifty rendered pages at once would
        hold hundreds of MB). Unusable bytes fail here, before any OCR work."""
        if data[:1024].lstrip().startswith(b"%PDF"):
            return self._open_pdf(data)
        return self._open_image(data)

    def _open_pdf(self, data: bytes) -> tuple[int, Iterator[Any]]:
        import pypdfium2 as pdfium

        try:
            pdf = pdfium.PdfDocument(data)
        except pdfium.PdfiumError as exc:
            raise BadInput(f"'file' is not a readable PDF ({exc})", param="file") from exc
        count = len(pdf)
        try:
            self._check_count(count)
        except BadInput:
            pdf.close()
            raise

        def render() -> Iterator[Any]:
            try:
                for page in pdf:
                    w, h = page.get_size()  # points
                    # a poster-sized page at the asked scale would be a bitmap of hundreds of MB: cap its side
                    scale = min(self.scale, self.max_side / max(w, h, 1.0))
                    yield _render(page, scale).to_pil().convert("RGB")
                    page.close()
            finally:
                pdf.close()

        return count, render()

    def _open_image(self, data: bytes) -> tuple[int, Iterator[Any]]:
        from PIL import Image, ImageOps, ImageSequence, UnidentifiedImageError

        try:
            img = Image.open(io.BytesIO(data))
        except UnidentifiedImageError as exc:
            raise BadInput(f"'file' must be {ACCEPTED}; these bytes are neither", param="file") from exc
        except Image.DecompressionBombError as exc:
            raise BadInput(f"'file' is an image too large to read ({exc})", param="file") from exc
        # multi-page TIFFs are scanned documents; other animations (GIF, WebP) are read by their first frame
        frames: int = getattr(img, "n_frames", 1)  # only a multi-frame format's image has n_frames
        multi = img.format == "TIFF" and frames > 1
        count = frames if multi else 1
        self._check_count(count)

        def decode() -> Iterator[Any]:
            for frame in ImageSequence.Iterator(img) if multi else [img]:
                try:
                    frame.draft("RGB", (self.max_side, self.max_side))  # JPEG: decode already scaled down
                    yield _flatten(ImageOps.exif_transpose(frame))
                except (OSError, ValueError) as exc:  # truncated or corrupt pixel data
                    raise BadInput(f"'file' is a damaged {img.format} image ({exc})", param="file") from exc

        return count, decode()

    def _check_count(self, n: int) -> None:
        if n > self.max_pages:
            raise BadInput(f"'file' has {n} pages; this model reads at most {self.max_pages}", param="file")

    # --- recognition --------------------------------------------------------------------------

    def _read(self, index: int, image: Any) -> OcrPage:
        """One page's lines in reading order; boxes in the page's own pixels even when it was scaled down."""
        width, height = image.size
        factor = min(1.0, self.max_side / max(width, height))
        if factor < 1.0:
            image = image.resize((max(1, round(width * factor)), max(1, round(height * factor))))
        out = self.reader(image)
        lines: list[OcrLine] = []
        if out.boxes is not None:
            for box, text, score in zip(out.boxes, out.txts, out.scores):
                pts = [[float(x) / factor, float(y) / factor] for x, y in box]
                lines.append(OcrLine(text=str(text), box=pts, score=float(score)))
        lines = reading_order(lines)
        return OcrPage(index=index, width=width, height=height, text="\n".join(ln.text for ln in lines), lines=lines)


def _flatten(img: Any) -> Any:
    """RGB on white: a transparent PNG's hidden pixels are often black, which would hide black text."""
    from PIL import Image

    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, "white")
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def reading_order(lines: list[OcrLine]) -> list[OcrLine]:
    """Lines sorted into rows top to bottom, each row left to right. Two lines share a row when their vertical
    centres are closer than half the shorter one's height, so a slightly tilted scan still reads across."""

    def span(ln: OcrLine) -> tuple[float, float, float]:
        ys = [p[1] for p in ln.box]
        return (min(ys) + max(ys)) / 2, max(ys) - min(ys), min(p[0] for p in ln.box)

    rows: list[list[tuple[float, float, float, OcrLine]]] = []
    for centre, height, left, ln in sorted(((*span(ln), ln) for ln in lines), key=lambda it: it[:3]):
        row = rows[-1] if rows else None
        if row is not None and abs(centre - row[-1][0]) < min(height, row[-1][1]) / 2:
            row.append((centre, height, left, ln))
        else:
            rows.append([(centre, height, left, ln)])
    return [item[3] for row in rows for item in sorted(row, key=lambda it: it[2])]


def _render(page: Any, scale: float) -> Any:
    """`page.render(scale=scale)` of a pypdfium2 PdfPage: the library leaves `scale` unannotated with a default of 1, so
    a type checker takes it for an int; it is a float (pixels per point)."""
    return page.render(scale=scale)
