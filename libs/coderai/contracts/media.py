"""Jobs and results of the non-LLM ops: embed, rerank, image, speech, transcribe, diarize, ocr, video.

Each job goes to one engine on `coderai.engine.<node_id>.<engine_id>.<op>` and is answered like a chat job (frames on the
reply inbox); its `Final` carries the op's result in `output`. Bytes (uploads, images, audio, video) travel as a
`Blob`: inline while small, else a name in the `coderai_blobs` object store (see `coderai.runtime.blobs`).
"""

from __future__ import annotations

from typing import Literal, Union

from coderai.contracts.base import Message, RequestId


class Blob(Message, frozen=True, kw_only=True):
    """Bytes carried by a message: `data` inline, or `name` of an object in the `coderai_blobs` store."""

    data: bytes = b""
    name: str = ""
    size: int = 0
    content_type: str = ""
    filename: str = ""


# --- jobs ---------------------------------------------------------------------------------------------


class EmbedJob(Message, frozen=True, kw_only=True):
    request_id: RequestId
    model: str
    input: list[str]
    dimensions: int | None = None  # truncate (Matryoshka-style) and re-normalise; None: the model's own
    stream: bool = False


class RerankJob(Message, frozen=True, kw_only=True):
    request_id: RequestId
    model: str
    query: str
    documents: list[str]
    stream: bool = False


class ImageJob(Message, frozen=True, kw_only=True):
    """Text-to-image (`image` empty) or an edit of `image` where `mask` is white (both PNG/JPEG/WebP bytes)."""

    request_id: RequestId
    model: str
    prompt: str
    n: int = 1
    width: int = 0  # 0: not given (512 for a generation, the input's own size for an edit)
    height: int = 0
    seed: int | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    image: Blob | None = None
    mask: Blob | None = None
    strength: float | None = None
    stream: bool = False


AudioFormat = Literal["wav", "mp3", "opus", "flac", "pcm", "aac"]


class SpeechJob(Message, frozen=True, kw_only=True):
    """Text-to-speech. Streamed: `Chunk.data` carries the encoded bytes in order, `Final.output` has no audio."""

    request_id: RequestId
    model: str
    input: str
    voice: str = ""
    response_format: AudioFormat = "mp3"
    speed: float = 1.0
    stream: bool = False


class TranscribeJob(Message, frozen=True, kw_only=True):
    """Speech-to-text of `audio` (any container ffmpeg reads); `task` translate gives English text."""

    request_id: RequestId
    model: str
    audio: Blob
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False
    stream: bool = False


class DiarizeJob(Message, frozen=True, kw_only=True):
    request_id: RequestId
    model: str
    audio: Blob
    num_speakers: int | None = None
    stream: bool = False


class OcrJob(Message, frozen=True, kw_only=True):
    """Text from an image or every page of a PDF."""

    request_id: RequestId
    model: str
    file: Blob
    stream: bool = False


class VideoJob(Message, frozen=True, kw_only=True):
    """Text-to-video; the engine reports progress as `Chunk.progress` (0..1) while it works."""

    request_id: RequestId
    model: str
    prompt: str
    num_frames: int = 8
    width: int = 256
    height: int = 256
    fps: int = 8
    seed: int | None = None
    steps: int | None = None
    negative_prompt: str | None = None
    stream: bool = False


# --- results (Final.output) ---------------------------------------------------------------------------


class EmbedResult(Message, frozen=True, kw_only=True, tag="embed", tag_field="kind"):
    """`vectors`: float32 little-endian, `count` rows of `dim` values (what OpenAI's base64 format carries)."""

    vectors: bytes
    count: int
    dim: int


class RerankResult(Message, frozen=True, kw_only=True, tag="rerank", tag_field="kind"):
    """One relevance score per document, in the documents' order (the gateway sorts)."""

    scores: list[float]


class ImageResult(Message, frozen=True, kw_only=True, tag="image", tag_field="kind"):
    images: list[Blob]  # PNG
    seeds: list[int] = []


class SpeechResult(Message, frozen=True, kw_only=True, tag="speech", tag_field="kind"):
    audio: Blob | None = None  # None when streamed
    sample_rate: int = 0
    duration_s: float = 0.0


class Word(Message, frozen=True, kw_only=True):
    word: str
    start: float
    end: float
    probability: float = 0.0


class Segment(Message, frozen=True, kw_only=True):
    id: int
    start: float
    end: float
    text: str
    speaker: str | None = None
    avg_logprob: float = 0.0
    no_speech_prob: float = 0.0
    compression_ratio: float = 0.0
    temperature: float = 0.0
    tokens: list[int] = []
    words: list[Word] = []


class TranscribeResult(Message, frozen=True, kw_only=True, tag="transcribe", tag_field="kind"):
    text: str
    language: str = ""
    duration_s: float = 0.0
    segments: list[Segment] = []


class Turn(Message, frozen=True, kw_only=True):
    start: float
    end: float
    speaker: str


class DiarizeResult(Message, frozen=True, kw_only=True, tag="diarize", tag_field="kind"):
    segments: list[Turn]
    speakers: list[str] = []
    duration_s: float = 0.0


class OcrLine(Message, frozen=True, kw_only=True):
    text: str
    box: list[list[float]]  # four [x, y] corners, clockwise from top-left, in page pixels
    score: float = 0.0


class OcrPage(Message, frozen=True, kw_only=True):
    index: int
    width: int
    height: int
    text: str
    lines: list[OcrLine] = []


class OcrResult(Message, frozen=True, kw_only=True, tag="ocr", tag_field="kind"):
    pages: list[OcrPage]


class VideoResult(Message, frozen=True, kw_only=True, tag="video", tag_field="kind"):
    video: Blob  # MP4
    frames: int
    width: int
    height: int
    fps: int
    seed: int = 0


Output = Union[
    EmbedResult, RerankResult, ImageResult, SpeechResult, TranscribeResult, DiarizeResult, OcrResult, VideoResult
]
"""What a media engine's `Final` carries."""

MediaJob = Union[EmbedJob, RerankJob, ImageJob, SpeechJob, TranscribeJob, DiarizeJob, OcrJob, VideoJob]


# --- blobs for nodes: read and written through a service, by name (runtime/blobs.py BlobProxy) ---------------


class BlobRead(Message, frozen=True, kw_only=True):
    """A node reads `limit` bytes at `offset` of the stored blob `name` (which only the job that carries it tells)."""

    name: str
    offset: int = 0
    limit: int = 512 * 1024


class BlobPiece(Message, frozen=True, kw_only=True, tag="blob.piece", tag_field="t"):
    data: bytes
    size: int  # the whole blob's


class BlobWrite(Message, frozen=True, kw_only=True):
    """A node writes a new blob piece by piece under a random `upload` id; the last piece stores it under a new
    random name (so no node can overwrite a blob, its own or another's)."""

    upload: str
    offset: int
    data: bytes = b""
    last: bool = False
    content_type: str = ""
    filename: str = ""
    suffix: str = ""


class BlobWritten(Message, frozen=True, kw_only=True, tag="blob.written", tag_field="t"):
    received: int
    blob: Blob | None = None
