"""Every route of the gateway is guarded: without a key it is a 401, an admin route with an inference key a 403.
Only the health check, the cluster page, the published contract (OpenAI's own spec, cut to what coderai serves) and
blob URLs (whose random names are the credential) are open."""

from __future__ import annotations

import re

import pytest
from litestar.testing import TestClient

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.gateway.app import create_app
from coderai.gateway.settings import GatewaySettings

OPEN = {"/healthz", "/ui", "/v1/blobs/{name:str}", "/openapi.json"}
USER, ADMIN = "sk-user-guards", "sk-admin-guards"


@pytest.fixture(scope="module")
def client(nats_server, tmp_path_factory):
    keys = tmp_path_factory.mktemp("guards") / "keys.toml"
    write_keys(str(keys), [KeyRecord("u", hash_key(USER), ["inference"]), KeyRecord("a", hash_key(ADMIN), ["admin"])])
    app = create_app(GatewaySettings(nats_url=nats_server.url, api_keys_file=str(keys)))
    with TestClient(app) as c:
        yield c


def routes(client) -> list[tuple[str, str]]:
    out = []
    for route in client.app.routes:
        if route.path in OPEN:
            continue
        path = re.sub(r"\{(\w+)(:\w+)?\}", "x1", route.path)
        out += [(m, path) for m in sorted(route.methods) if m != "OPTIONS"]
    return out


def test_every_route_but_the_open_ones_wants_a_key(client):
    checked = routes(client)
    assert len(checked) > 40
    for method, path in checked:
        r = client.request(method, path)
        assert r.status_code == 401, (method, path, r.status_code)
        if method == "HEAD":  # its answer has no body (Ollama's HEAD /api/blobs/...)
            continue
        error = r.json()["error"]
        if path.startswith("/api/"):  # Ollama's routes answer in Ollama's error shape
            assert "API key" in error
        elif path.startswith("/v1/messages"):  # Anthropic's routes in Anthropic's
            assert error["type"] == "authentication_error"
        else:
            assert error["code"] == "invalid_api_key"


def test_admin_routes_want_the_admin_scope(client):
    admin = [(m, p) for m, p in routes(client) if p.startswith("/admin") or p == "/metrics"]
    assert len(admin) > 15
    for method, path in admin:
        r = client.request(method, path, headers={"Authorization": f"Bearer {USER}"})
        assert r.status_code == 403, (method, path, r.status_code)
    r = client.request("GET", "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 403  # an admin-only key has no inference scope
