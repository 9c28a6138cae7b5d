"""refuse_media: a part the model cannot read is the client's 400, naming the part."""

from __future__ import annotations

import pytest

from coderai.engine_worker.engines.base import BadInput, refuse_media

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


def _msgs(*parts):
    return [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}, *parts]}]


def test_an_image_for_a_text_model_names_the_part():
    with pytest.raises(BadInput) as err:
        refuse_media(_msgs(IMAGE), "m")
    assert err.value.param == "messages[1].content[1]" and "mmproj" in str(err.value)


def test_audio_and_files_are_refused_too_and_text_passes():
    for part in ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, {"type": "file", "file": {}}):
        with pytest.raises(BadInput):
            refuse_media(_msgs(part), "m")
    refuse_media(_msgs(), "m")
    refuse_media([{"role": "user", "content": "plain"}], "m")


def test_a_model_with_a_projector_takes_images():
    refuse_media(_msgs(IMAGE), "m", frozenset({"image_url"}))
