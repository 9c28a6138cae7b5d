"""Hostile tenants and nodes against the media routes (issue 40, items 3 and 5), on a real stack with the tiny
diffusers model the suite builds:

- `/v1/blobs/{name}` served whatever a node had stored to anyone with its name, with no key: a node could host
  files on the gateway's address (an HTML page there is stored XSS on the API's origin). URLs are now signed and
  expire, and what they serve is never rendered as a page.
- Images and videos were priced by their prompt text, so a budget did not bound GPU time: 4096x4096, 500 steps,
  n=10 cost what its few words cost. They are now priced by pixels x steps x n (x frames), reserved before the job
  runs, and bounded by the model's limits.

Each attack prints what it tried and what happened, and the stack still serves afterwards."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time

import httpx
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
pytest.importorskip("diffusers")

ADMIN = "sk-media-admin-0123456789"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
PRICE = 1.0  # USD per megapixel-step: a 64x64 picture of 2 steps costs 0.008192


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf, redis_server):
    from coderai.tiny_models.diffusion import ensure_tiny_sd

    root = tmp_path_factory.mktemp("media-abuse")
    keys = root / "keys.toml"
    write_keys(str(keys), [KeyRecord(name="admin", sha256=hash_key(ADMIN), scopes=["inference", "admin"])])
    sd = str(ensure_tiny_sd())
    models = [
        {"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}},
        # the model's default limits: at most 1024x1024 pixels, 150 steps; n at most 4 here
        {
            "name": "sd-tiny",
            "engine": "diffusers",
            "path": sd,
            "params": {"steps": 2, "max_n": 4},
            "price_per_mpixel_step": PRICE,
        },
        # an operator who allows big pictures and many steps: the budget is what bounds them
        {
            "name": "sd-roomy",
            "engine": "diffusers",
            "path": sd,
            "params": {"steps": 2, "max_pixels": 4096 * 4096, "max_steps": 500},
            "price_per_mpixel_step": PRICE,
        },
        {
            "name": "clip",
            "engine": "video",
            "path": sd,
            "nodes": ["nowhere"],
            "params": {"max_frames": 32},
            "price_per_mpixel_step": PRICE,
        },  # placed nowhere: a video job never runs here
    ]
    with running_stack(
        root,
        models,
        gateway_args=("--api-keys-file", str(keys)),
        redis_url=redis_server.url,
        extra_env={"CODERAI_GATEWAY_REDIS_URL": redis_server.url},
        headers=ADMIN_HEADERS,
    ) as s:
        s.wait_engines_ready(["sd-tiny", "sd-roomy"], headers=ADMIN_HEADERS, timeout_s=300)
        yield s


def new_key(stack, name: str, **spec) -> dict[str, str]:
    r = httpx.post(f"{stack.http_url}/admin/keys", headers=ADMIN_HEADERS, json={"name": name, **spec}, timeout=30)
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['key']}"}


def generate(stack, headers: dict[str, str], timeout: float = 120, **body) -> httpx.Response:
    return httpx.post(
        f"{stack.base_url}/images/generations",
        headers=headers,
        timeout=timeout,
        json={"model": "sd-tiny", "prompt": "a red cube", "size": "64x64", **body},
    )


def still_serves(stack) -> None:
    r = generate(stack, ADMIN_HEADERS, response_format="url")
    assert r.status_code == 200, r.text
    png = httpx.get(r.json()["data"][0]["url"], timeout=30)
    assert png.status_code == 200 and png.content[:4] == b"\x89PNG"
    print("  and the stack still serves: an image by a signed URL, fetched")


def tried(what: str, r: httpx.Response, refused: bool) -> None:
    print(
        f"  {what}: HTTP {r.status_code} {r.headers.get('content-type', '')} -> "
        f"{'refused / harmless' if refused else 'SUCCEEDED'}"
    )
    assert refused, f"{what}: {r.status_code} {r.text[:300]}"


def _signature(stack, name: str, expires: int) -> str:
    """What the gateway's key signs for (name, expires): as the gateway makes it, read from its data dir, so a
    test can make the one URL an attacker cannot (an expired one, or one for a node's bytes)."""
    secret = (stack.root / "data" / "secrets" / "blob-url.key").read_text().strip()
    key = hmac.new(hashlib.sha256(secret.encode()).digest(), b"coderai blob url", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(hmac.new(key, f"{name}\n{expires}".encode(), hashlib.sha256).digest()[:18]).decode()


async def _node_stores(stack, data: bytes, suffix: str) -> str:
    """A blob written as a node writes one (through the gateways' blob service, by name): its name."""
    from coderai.runtime.blobs import BlobProxy
    from coderai.runtime.bus import Bus

    bus = await Bus.connect(stack.nats.service_url, "blob-writer")
    try:
        return (await BlobProxy(bus).put(data, "text/html", suffix=suffix)).name
    finally:
        await bus.close()


PAGE = b"<!doctype html><html><body><script>fetch('/v1/models').then(r=>r.text()).then(alert)</script></body></html>"


def test_a_blob_is_served_only_by_a_signed_unexpired_url(stack):
    print("\nattack: fetch /v1/blobs/ without the gateway's signature")
    r = generate(stack, ADMIN_HEADERS, response_format="url")
    assert r.status_code == 200, r.text
    url = httpx.URL(r.json()["data"][0]["url"])
    name = url.path.rsplit("/", 1)[1]
    bare = f"{stack.http_url}/v1/blobs/{name}"
    got = httpx.get(bare, timeout=30)
    tried("the bare name, no signature", got, got.status_code == 404 and got.json()["error"]["code"] == "not_found")

    assert {"expires", "signature"} <= set(url.params), url
    good = httpx.get(url, timeout=30)
    assert good.status_code == 200 and good.headers["content-type"] == "image/png"
    assert good.headers["x-content-type-options"] == "nosniff"
    print(f"  the URL the gateway handed out ({url.path}?expires=..&signature=..) serves the PNG")
    expires, signature = int(url.params["expires"]), url.params["signature"]
    past = int(time.time()) - 5
    attempts = {
        "a forged signature": f"{bare}?expires={expires}&signature={'A' * 24}",
        "the real signature with a later expiry": f"{bare}?expires={expires + 86400}&signature={signature}",
        "another blob's signature": f"{stack.http_url}/v1/blobs/x{name}?{url.query.decode()}",
        "an expired URL, correctly signed": f"{bare}?expires={past}&signature={_signature(stack, name, past)}",
        "a non-numeric expiry": f"{bare}?expires=9e99&signature={signature}",
    }
    for what, target in attempts.items():
        got = httpx.get(target, timeout=30)
        tried(what, got, got.status_code == 404 and got.json()["error"]["code"] == "not_found")
    still_serves(stack)


def test_a_nodes_blob_is_not_a_page_on_the_gateways_origin(stack):
    print("\nattack: a node stores an HTML page as a blob and has it served from the gateway's address")
    for suffix in (".html", ".png", ""):
        name = asyncio.run(_node_stores(stack, PAGE, suffix))
        bare = httpx.get(f"{stack.http_url}/v1/blobs/{name}", timeout=30)
        tried(f"its bare name {name}", bare, bare.status_code == 404 and PAGE not in bare.content)
        # a URL the gateway did sign over bytes a node chose (an engine's "image" that is HTML): served as a download
        expires = int(time.time()) + 600
        signed = httpx.get(
            f"{stack.http_url}/v1/blobs/{name}",
            params={"expires": expires, "signature": _signature(stack, name, expires)},
            timeout=30,
        )
        assert signed.status_code == 200
        ctype = signed.headers["content-type"]
        harmless = (
            "html" not in ctype
            and not ctype.startswith("text/")
            and signed.headers.get("x-content-type-options") == "nosniff"
            and signed.headers.get("content-disposition", "").startswith("attachment")
            and "sandbox" in signed.headers.get("content-security-policy", "")
        )
        tried(f"a signed URL over its HTML bytes named *{suffix or '(no suffix)'}", signed, harmless)
    still_serves(stack)


# --- images and videos priced by the work they ask for --------------------------------------------------------


def spent(stack, key_name: str, requests: int) -> float:
    def row():
        rows = httpx.get(
            f"{stack.http_url}/admin/usage", params={"key": key_name}, headers=ADMIN_HEADERS, timeout=30
        ).json()["rows"]
        return rows[0] if rows and rows[0]["requests"] >= requests else None

    return wait_until(row, 30, f"{key_name}'s usage")["cost_usd"]


def test_a_small_budget_refuses_a_huge_image_before_any_gpu_work(stack):
    print("\nattack: a key with $1 a day asks 4096x4096, 500 steps, n=10 of a model that allows that size")
    key = new_key(stack, "mallory", budget_usd=1.0, budget_period="day")
    try:
        r = generate(stack, key, timeout=30, model="sd-roomy", size="4096x4096", steps=500, n=10)
    except httpx.TimeoutException:
        print("  4096x4096 x 500 steps x 10: still running after 30 s -> SUCCEEDED (an engine took it)")
        raise
    tried(
        "4096x4096 x 500 steps x 10 ($83,886 of work)",
        r,
        r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota",
    )
    nodes = httpx.get(f"{stack.http_url}/admin/nodes", headers=ADMIN_HEADERS, timeout=30).json()["nodes"]
    roomy = [e for n in nodes for e in n["heartbeat"].get("engines", []) if e["model"] == "sd-roomy"]
    assert roomy and not any(e.get("in_flight") for e in roomy), roomy
    print("  sd-roomy's engine holds no job: it was refused before it was routed")

    # a normal request still works, and is billed by its size: 64x64 x 2 steps, then 128x128 x 3 steps x 2
    ok = generate(stack, key, model="sd-roomy")
    assert ok.status_code == 200, ok.text
    ok2 = generate(stack, key, model="sd-roomy", size="128x128", steps=3, n=2)
    assert ok2.status_code == 200, ok2.text
    want = (64 * 64 * 2 + 128 * 128 * 3 * 2) / 1e6 * PRICE
    got = spent(stack, "mallory", 2)  # the refused request reserved nothing and spent nothing
    print(f"  a 64x64 and two 128x128 pictures answered, billed ${got:.6f} (pixels x steps x n: ${want:.6f})")
    assert got == pytest.approx(want, rel=1e-6)
    still_serves(stack)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"size": "4096x4096"}, "size"),  # 16.7 Mpx, over the model's 1 Mpx
        ({"steps": 500}, "steps"),  # over its 150
        ({"n": 10}, "n"),  # over its max_n of 4
    ],
)
def test_an_image_past_the_models_limits_is_a_400_naming_the_param(stack, body, param):
    print(f"\nattack: an image past sd-tiny's limits: {body}")
    key = new_key(stack, f"limits-{param}")
    r = generate(stack, key, timeout=30, **body)
    tried(f"{body}", r, r.status_code == 400 and r.json()["error"]["param"] == param)
    still_serves(stack)


def test_a_video_is_priced_and_bounded_when_it_is_asked_for(stack):
    print("\nattack: video jobs past a model's frames, or past the key's budget")
    key = new_key(stack, "vince", budget_usd=1.0, budget_period="day")
    url = f"{stack.base_url}/videos"
    body = {"model": "clip", "prompt": "a cat", "size": "256x256"}
    r = httpx.post(url, headers=key, json={**body, "num_frames": 1000}, timeout=30)
    tried(
        "1000 frames (the model's limit is 32)", r, r.status_code == 400 and r.json()["error"]["param"] == "num_frames"
    )
    # 256 x 256 x 20 steps x 32 frames = 41.9 Mpx-steps: $41.9 against a $1 budget
    r = httpx.post(url, headers=key, json={**body, "num_frames": 32}, timeout=30)
    tried(
        "32 frames of 256x256 at 20 steps ($41.94 of work)",
        r,
        r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota",
    )
    # within the budget (1 frame of 64x64, 2 steps): accepted as a job (it waits for an engine; none is placed)
    small = httpx.post(url, headers=key, json={**body, "size": "64x64", "num_frames": 1, "steps": 2}, timeout=30)
    assert small.status_code == 200 and small.json()["status"] == "queued", small.text
    print("  a small video is accepted")
    still_serves(stack)
