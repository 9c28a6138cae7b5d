"""`GET /v1/files/{id}/content`'s `Content-Disposition` for any name a client uploaded (coderai.gateway.openai.files)."""

from __future__ import annotations

import pytest

from coderai.gateway.openai.files import attachment


@pytest.mark.parametrize(
    "name, header",
    [
        ("train.jsonl", 'attachment; filename="train.jsonl"'),
        ("文件.jsonl", "attachment; filename=\"__.jsonl\"; filename*=UTF-8''%E6%96%87%E4%BB%B6.jsonl"),
        ('a"b\\c.txt', "attachment; filename=\"a_b_c.txt\"; filename*=UTF-8''a%22b%5Cc.txt"),
        (
            "line\r\nX-Injected: 1",
            "attachment; filename=\"line__X-Injected: 1\"; filename*=UTF-8''line%0D%0AX-Injected%3A%201",
        ),
        ("", 'attachment; filename="file"'),
    ],
)
def test_every_name_gives_a_latin1_header_that_says_it(name, header):
    got = attachment(name)
    assert got == header
    got.encode("latin-1")  # what an HTTP header can carry
