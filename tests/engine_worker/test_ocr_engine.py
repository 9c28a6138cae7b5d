"""The RapidOCR engine reading text this test renders with Pillow: images, PDFs, multi-page TIFFs, bad input."""

from __future__ import annotations

import io

import pytest

from coderai.contracts import ModelConfig
from coderai.contracts.media import Blob, OcrJob, OcrLine
from coderai.engine_worker.engines import BadInput, available_families, engine_class
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.ocr import reading_order

pytestmark = pytest.mark.slow
pytest.importorskip("rapidocr")
pytest.importorskip("pypdfium2")
from PIL import Image, ImageDraw, ImageFont

HELLO, INVOICE = "Hello OCR World 2026", "Invoice total: $123.45"


def make(**params):
    return engine_class("ocr")(ModelConfig(name="o", engine="ocr", path="builtin", params={"threads": 2, **params}))


@pytest.fixture(scope="module")
def engine():
    e = make()
    e.load()
    yield e
    e.close()


def render(*texts: tuple[int, int, str], size=(640, 200), mode="RGB", background="white") -> Image.Image:
    img = Image.new(mode, size, background)
    draw, font = ImageDraw.Draw(img), ImageFont.load_default(size=36)
    for x, y, text in texts:
        draw.text((x, y), text, fill="black", font=font)
    return img


def encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def ocr(engine, data: bytes, cancel: CancelFlag | None = None, emit=None):
    res, _ = engine.ocr(OcrJob(request_id="r", model="o", file=Blob(data=data)), cancel or CancelFlag(), emit)
    return res.pages


def norm(text: str) -> str:
    return " ".join(text.split()).lower()


def test_ocr_is_an_available_family():
    assert "ocr" in available_families()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_reads_rendered_text_exactly_in_reading_order(engine, fmt):
    (page,) = ocr(engine, encode(render((20, 30, HELLO), (20, 110, INVOICE)), fmt))
    assert (page.index, page.width, page.height) == (0, 640, 200)
    assert [norm(t) for t in page.text.split("\n")] == [norm(HELLO), norm(INVOICE)]
    assert [norm(ln.text) for ln in page.lines] == [norm(HELLO), norm(INVOICE)]
    for ln in page.lines:
        assert len(ln.box) == 4 and all(0 <= x <= 640 and 0 <= y <= 200 for x, y in ln.box)
        assert 0.5 < ln.score <= 1.0
    assert page.lines[0].box[0][1] < page.lines[1].box[0][1]


def test_a_row_reads_left_to_right_before_the_next_row(engine):
    img = render((20, 30, "LEFT words"), (420, 34, "RIGHT side"), (20, 120, "Below both"), size=(800, 200))
    (page,) = ocr(engine, encode(img))
    assert [norm(ln.text) for ln in page.lines] == ["left words", "right side", "below both"]


def test_black_text_on_a_transparent_png(engine):
    img = render((20, 30, HELLO), mode="RGBA", background=(0, 0, 0, 0))
    (page,) = ocr(engine, encode(img))
    assert norm(page.text) == norm(HELLO)


def test_two_page_pdf_gives_two_pages_with_their_text(engine):
    first, second = render((20, 60, "First page here")), render((20, 60, "Second page 42"))
    progress: list[float] = []
    pages = ocr(
        engine,
        encode(first, "PDF", save_all=True, append_images=[second]),
        emit=lambda **kw: progress.append(kw["progress"]),
    )
    assert [p.index for p in pages] == [0, 1]
    assert [norm(p.text) for p in pages] == ["first page here", "second page 42"]
    assert (pages[0].width, pages[0].height) == (1280, 400)  # 640x200 pt at the default scale 2.0
    assert progress == [0.5, 1.0]


def test_multi_page_tiff_gives_a_page_per_frame(engine):
    first, second = render((20, 60, "Scan one")), render((20, 60, "Scan two"))
    pages = ocr(engine, encode(first, "TIFF", save_all=True, append_images=[second]))
    assert [norm(p.text) for p in pages] == ["scan one", "scan two"]


def test_big_image_is_read_scaled_down_with_boxes_in_its_own_pixels(engine):
    big = render((20, 30, HELLO)).resize((1280, 400))
    small = make(max_side=640)
    small.reader = engine.reader  # the loaded models; only the size limit differs
    (page,) = ocr(small, encode(big))
    assert (page.width, page.height) == (1280, 400) and norm(page.text) == norm(HELLO)
    assert max(x for x, _ in page.lines[0].box) > 640  # mapped back from the 640-wide copy


def test_blank_page_has_no_lines(engine):
    (page,) = ocr(engine, encode(Image.new("RGB", (300, 100), "white")))
    assert page.text == "" and page.lines == []


def test_cancelled_job_reads_nothing(engine):
    flag = CancelFlag()
    flag.set()
    assert ocr(engine, encode(render((20, 30, HELLO))), cancel=flag) == []


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x00\x01garbage, not a picture" * 10, "image .* or a PDF"),
        (b"%PDF-1.4 garbage", "not a readable PDF"),
        (encode(render((20, 30, HELLO)))[:300], "damaged PNG"),
    ],
)
def test_unusable_files_are_bad_input(engine, data, message):
    with pytest.raises(BadInput, match=message) as err:
        ocr(engine, data)
    assert err.value.param == "file"


def test_too_many_pages_is_bad_input_before_any_work():
    pdf = encode(render(), "PDF", save_all=True, append_images=[render(), render()])
    with pytest.raises(BadInput, match="3 pages; this model reads at most 2") as err:
        ocr(make(max_pages=2), pdf)  # never loaded: the check comes before any recognition
    assert err.value.param == "file"


def line(text: str, x: float, y: float, h: float = 20) -> OcrLine:
    return OcrLine(text=text, box=[[x, y], [x + 50, y], [x + 50, y + h], [x, y + h]])


def test_reading_order_rows_then_columns():
    lines = [line("d", 10, 100), line("b", 200, 4), line("a", 10, 0), line("c", 400, -3), line("e", 300, 98)]
    assert [ln.text for ln in reading_order(lines)] == ["a", "b", "c", "d", "e"]
    assert reading_order([]) == []
