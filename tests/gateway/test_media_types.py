"""Media request checks: sizes, and every bad field is a 400 that names it."""

from __future__ import annotations

import pytest

from coderai.gateway.errors import ApiError
from coderai.gateway.openai.forms import Form, Upload, parse_size
from coderai.gateway.openai.videos import VideoRequest, plan


def test_parse_size():
    assert parse_size("64x128", (1, 1)) == (64, 128)
    assert parse_size(None, (512, 512)) == (512, 512) and parse_size("auto", (8, 8)) == (8, 8)
    for bad in ("big", "64", "65x64", "32x32", "99999x64", "64x64x3"):
        with pytest.raises(ApiError) as e:
            parse_size(bad, (1, 1))
        assert e.value.status == 400 and e.value.param == "size"


def test_form_fields_name_themselves():
    form = Form(
        fields={"n": ["3"], "temperature": ["x"], "diarize": ["maybe"], "response_format": ["xml"]},
        files={"file": Upload(b"", "a.wav", "audio/wav")},
    )
    assert form.number("n", int, 1, 10) == 3
    cases = [
        lambda: form.number("temperature", float, 0, 1),
        lambda: form.flag("diarize"),
        lambda: form.choice("response_format", ("json", "text"), "json"),
        lambda: form.require("model"),
        lambda: form.file("file"),
        lambda: form.file("image"),
    ]
    params = []
    for case in cases:
        with pytest.raises(ApiError) as e:
            case()
        assert e.value.status == 400
        params.append(e.value.param)
    assert params == ["temperature", "diarize", "response_format", "model", "file", "image"]
    with pytest.raises(ApiError) as e:
        form.number("n", int, 4, 10)
    assert e.value.param == "n" and "between 4 and 10" in e.value.message


def test_video_plan_frames_from_seconds_and_fps():
    assert plan(VideoRequest(model="v", prompt="p", seconds="2", size="64x64", fps=4)) == (64, 64, 8, "2")
    assert plan(VideoRequest(model="v", prompt="p", num_frames=5, fps=10, size="32x16"))[2:] == (5, "0.5")
    for bad in ("0", "x", "100"):
        with pytest.raises(ApiError) as e:
            plan(VideoRequest(model="v", prompt="p", seconds=bad))
        assert e.value.param == "seconds"


def test_every_media_request_type_decodes_its_openai_shape():
    import msgspec

    from coderai.gateway.openai.audio import SpeechRequest
    from coderai.gateway.openai.embeddings import EmbeddingRequest, RerankRequest
    from coderai.gateway.openai.images import ImageRequest

    emb = msgspec.json.decode(b'{"model":"m","input":["a","b"],"encoding_format":"base64"}', type=EmbeddingRequest)
    assert emb.input == ["a", "b"] and emb.encoding_format == "base64"
    assert msgspec.json.decode(b'{"model":"m","input":[[1,2]]}', type=EmbeddingRequest).input == [[1, 2]]
    rr = msgspec.json.decode(b'{"model":"m","query":"q","documents":["a",{"text":"b"}]}', type=RerankRequest)
    assert rr.documents[1].text == "b" and rr.return_documents
    img = msgspec.json.decode(b'{"model":"m","prompt":"p","size":"64x64","n":2}', type=ImageRequest)
    assert (img.n, img.response_format) == (2, "b64_json")
    sp = msgspec.json.decode(b'{"model":"m","input":"hi","voice":"alloy"}', type=SpeechRequest)
    assert (sp.response_format, sp.speed) == ("mp3", 1.0)
    vid = msgspec.json.decode(b'{"model":"m","prompt":"p","seconds":"4","size":"720x1280"}', type=VideoRequest)
    assert vid.seconds == "4"
