"""`/admin/models` checks a config before the scheduler sees it: a 400 naming the bad field, never a 500, and the
catalogue's `/admin/models/pull...` routes stay its own. (The changes themselves: tests/integration/test_live_models.py.)"""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.gateway.app import create_app
from coderai.gateway.settings import GatewaySettings

ADMIN = "sk-admin-live-models"
OK = {"name": "m", "engine": "llama", "path": "/m.gguf"}


@pytest.fixture(scope="module")
def client(nats_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("admin-models")
    write_keys(str(root / "keys.toml"), [KeyRecord("a", hash_key(ADMIN), ["admin"])])
    app = create_app(
        GatewaySettings(nats_url=nats_server.url, api_keys_file=str(root / "keys.toml"), data_dir=str(root / "data"))
    )
    with TestClient(app) as c:
        c.headers["Authorization"] = f"Bearer {ADMIN}"
        yield c


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({**OK, "engine": "llamas"}, "engine", "Invalid enum value 'llamas'"),
        ({"name": "m", "engine": "llama"}, "path", "missing required field `path`"),
        ({**OK, "keep_alive_s": "long"}, "keep_alive_s", "Expected `float | null`"),
        ({**OK, "name": ""}, "name", "non-empty"),
        ({**OK, "name": "pulled"}, "name", "catalogue's route"),
    ],
)
def test_an_invalid_config_is_a_400_naming_the_field(client, body, param, says):
    r = client.post("/admin/models", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_put_takes_the_name_from_the_path_and_refuses_another(client):
    r = client.put("/admin/models/m", json={**OK, "name": "other"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    r = client.put("/admin/models/m", json={"engine": "llama", "path": "/m.gguf", "nope": 1})
    assert r.status_code == 400 and "unknown field `nope`" in r.json()["error"]["message"]
    r = client.put("/admin/models/m", json={"engine": "llama", "path": "/m.gguf"})  # valid: on to the scheduler
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine"  # none runs here


def test_an_unknown_model_is_a_404_and_the_catalogue_keeps_its_routes(client):
    r = client.get("/admin/models/ghost")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/admin/models/pulled").status_code in (200, 501)  # the store's listing, not a model
    assert client.get("/admin/models/pull").status_code in (200, 501)
