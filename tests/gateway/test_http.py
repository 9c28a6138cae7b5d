"""JSON bodies at the edge (`gateway/http.py`): only as `application/json`, held to the body limit, and nesting
deep enough to overflow the decoder's stack is the client's 400, never a 500."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from litestar import Litestar, Request, Response, post
from litestar.testing import TestClient

from coderai.gateway.errors import ApiError
from coderai.gateway.http import error_response, json_response, read_json


class Body(msgspec.Struct):
    messages: list[dict]


@post("/echo", status_code=200)
async def echo(request: Request) -> Response:
    body = await read_json(request, Body)
    return json_response({"n": len(body.messages)})


@pytest.fixture
def client():
    app = Litestar(route_handlers=[echo], exception_handlers={ApiError: lambda _r, e: error_response(e)})
    app.state.gateway = SimpleNamespace(settings=SimpleNamespace(max_body_bytes=4096))
    with TestClient(app) as c:
        yield c


def error(r) -> dict:
    return r.json()["error"]


def test_a_json_body_is_read(client):
    r = client.post("/echo", json={"messages": [{}, {}]})
    assert r.status_code == 200 and r.json() == {"n": 2}
    r = client.post("/echo", content=b'{"messages": []}', headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded", "application/jsonx"])
def test_json_sent_as_anything_else_is_415(client, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    r = client.post("/echo", content=b'{"messages": []}', headers=headers)
    assert r.status_code == 415 and error(r)["code"] == "unsupported_media_type"


def test_deeply_nested_json_is_400(client):
    deep = b'{"messages": [{"x": ' + b"[" * 3000 + b"]" * 3000 + b"}]}"
    client.app.state.gateway.settings.max_body_bytes = len(deep) + 1
    r = client.post("/echo", content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and error(r)["code"] == "invalid_json" and "nested" in error(r)["message"]


def test_a_body_over_the_limit_is_413(client):
    r = client.post("/echo", json={"messages": [{"x": "y" * 5000}]})
    assert r.status_code == 413 and error(r)["code"] == "request_too_large"


def test_malformed_json_and_a_wrong_shape_are_400s_naming_the_field(client):
    r = client.post("/echo", content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and error(r)["code"] == "invalid_json"
    r = client.post("/echo", json={"messages": 3})
    assert r.status_code == 400 and error(r)["param"] == "messages"


@pytest.mark.parametrize(
    "raw, expected",
    [
        (None, ""),
        (b"run-7/req-42", "run-7/req-42"),
        (b"x" * 512, "x" * 512),
        (b"x" * 513, ApiError),
        (b"caf\xc3\xa9", ApiError),
        (b"a\tb", ApiError),
    ],
)
def test_a_client_request_id_is_printable_ascii_of_at_most_512_characters(raw, expected):
    from coderai.gateway.http import client_request_id

    headers = [(b"content-type", b"application/json")] + ([(b"x-client-request-id", raw)] if raw is not None else [])
    if expected is ApiError:
        with pytest.raises(ApiError) as err:
            client_request_id({"headers": headers})
        assert (err.value.status, err.value.param) == (400, "X-Client-Request-Id")
    else:
        assert client_request_id({"headers": headers}) == expected
