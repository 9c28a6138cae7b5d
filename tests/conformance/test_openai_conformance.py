"""Every OpenAI operation coderai claims (`coderai.gateway.contract.CLAIMED`), driven by requests schemathesis
generates from OpenAI's own OpenAPI document (the subset the gateway serves at `/openapi.json`), against a real
stack: the tiny GGUF behind llama-server for chat, completions and Responses, a copy of it in embedding mode.

Each answer must be no 5xx; a 2xx must validate against the spec's response schema for its status and media type
(streamed answers event by event); a 4xx must be OpenAI's error JSON. Each operation must answer at least one
generated request with a 2xx, so a route that refuses everything does not pass.

What steers the generator, and why (each only with a probability, so the spec's own values are sent too):
- `model` becomes a model this stack serves (and a Response without `input` gets some text); some bodies keep
  only the fields the spec requires; path ids become objects that exist (a file, a batch, a stored
  background response); a fresh one for a delete, so later operations still find theirs. Random ids only ever
  get the 404 that a random id deserves.
- `n`, `max_tokens`, `max_completion_tokens` and `max_output_tokens` are capped (2 choices, 8 tokens): the
  spec allows 128 choices of the whole context each, minutes of generation on two cores.
Both are bounds on cost, never on what the gateway must accept. Negative cases (requests the spec forbids) run
too, and must be 4xx, not 5xx. Examples are derandomized, so CI runs the same requests each time;
`CODERAI_CONFORMANCE_EXAMPLES` raises the count per operation and mode.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import string
from collections import Counter
from typing import Any

import httpx
import pytest

from coderai.accounts.keyfile import KeyRecord, hash_key, write_keys
from coderai.gateway.contract import CLAIMED, load_document
from coderai.testing.procs import wait_until
from coderai.testing.stack import running_stack

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import response_schema_conformance

pytestmark = pytest.mark.slow
KEY, ADMIN = "sk-conformance-0123456789", "sk-conformance-admin-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT, EMBED = "chat", "embed"
EXAMPLES = int(os.environ.get("CODERAI_CONFORMANCE_EXAMPLES", "40"))
CAPS = {"n": 2, "max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 8}
MODEL_PATHS = ("/chat/completions", "/completions", "/embeddings", "/responses")
EXTRA_REQUIRED = {"/responses": {"model", "input"}}
"""What coderai needs beyond OpenAI's required fields: a Response needs a model and an input here (OpenAI's may
come from a stored prompt, which coderai does not keep; docs/api.md says so)."""
LINE = {
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_gguf):
    from coderai.engine_worker.engines.llama_server import find_binary

    if find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    keys = tmp_path_factory.mktemp("conformance-keys") / "keys.toml"
    write_keys(
        str(keys),
        [KeyRecord("conformance", hash_key(KEY), ["inference"]), KeyRecord("admin", hash_key(ADMIN), ["admin"])],
    )  # only to see the engines come up
    embed = shutil.copy(tiny_gguf, tmp_path_factory.mktemp("embed") / "embed.gguf")
    models = [
        {
            "name": CHAT,
            "engine": "llama-server",
            "path": str(tiny_gguf),
            "params": {"parallel": 2, "n_ctx": 2048, "n_threads": 2},
        },
        {
            "name": EMBED,
            "engine": "llama-server",
            "path": str(embed),
            "ops": ["embed"],
            "params": {"parallel": 1, "n_ctx": 512, "n_threads": 1},
        },
    ]
    with running_stack(
        tmp_path_factory.mktemp("conformance"), models, gateway_args=("--api-keys-file", str(keys)), headers=AUTH
    ) as s:
        s.wait_engines_ready([CHAT, EMBED], headers={"Authorization": f"Bearer {ADMIN}"}, timeout_s=300)
        yield s


class Objects:
    """Objects of the conformance key that path parameters and bodies are steered to, and makers of fresh ones
    for the operations that delete."""

    def __init__(self, http: httpx.Client) -> None:
        self.http = http
        self.file_id = self.new_file()
        self.batch_file_id = self.new_file(purpose="batch", lines=1)
        many = self.new_file(purpose="batch", lines=64)
        batch = self.post(
            "/batches", {"input_file_id": many, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        )
        self.batch_id = self.post(f"/batches/{batch['id']}/cancel", None)["id"]  # cancellable again: a 200 each time
        self.response_id = self.new_response(background=True)
        wait_until(
            lambda: self.http.get(f"/responses/{self.response_id}").json()["status"] not in ("queued", "in_progress"),
            120,
            "the background response to end",
        )

    def post(self, path: str, body: Any) -> dict[str, Any]:
        r = self.http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def new_file(self, purpose: str = "user_data", lines: int = 1) -> str:
        data = "".join(json.dumps({"custom_id": f"l{i}", **LINE}) + "\n" for i in range(lines))
        r = self.http.post("/files", data={"purpose": purpose}, files={"file": ("lines.jsonl", data.encode())})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    def new_response(self, background: bool = False) -> str:
        return self.post(
            "/responses",
            {"model": CHAT, "input": "hi", "max_output_tokens": 4, "store": True, "background": background},
        )["id"]


@pytest.fixture(scope="module")
def objects(stack) -> Objects:
    with httpx.Client(base_url=stack.http_url + "/v1", headers=AUTH, timeout=120) as http:
        yield Objects(http)


@pytest.fixture(scope="module")
def document(stack) -> dict[str, Any]:
    r = httpx.get(stack.http_url + "/openapi.json", timeout=30)  # public: no key
    assert r.status_code == 200 and r.json() == load_document()
    return r.json()


@pytest.fixture(scope="module")
def schema(document):
    return schemathesis.openapi.from_dict(copy.deepcopy(document))  # the reading below stays as served


def openai_error(ctx, response, case) -> bool | None:
    """A 4xx answer is OpenAI's error JSON: `{"error": {"message": str, "type": str, "param", "code"}}`."""
    if not 400 <= response.status_code < 500:
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"a {response.status_code} that is not JSON: {response.content[:200]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    ok = (
        isinstance(err, dict)
        and isinstance(err.get("message"), str)
        and isinstance(err.get("type"), str)
        and "param" in err
        and "code" in err
    )
    assert ok, f"a {response.status_code} that is not OpenAI's error JSON: {body}"
    return True


def required(doc: dict[str, Any], node: Any) -> set[str]:
    """The properties a schema requires, through `$ref` and `allOf`."""
    if not isinstance(node, dict):
        return set()
    if "$ref" in node:
        return required(doc, doc["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]])
    found = set(node.get("required", []))
    for part in node.get("allOf", []):
        found |= required(doc, part)
    return found


def body_required(doc: dict[str, Any], method: str, path: str) -> set[str]:
    content = doc["paths"][path][method].get("requestBody", {}).get("content", {})
    return set().union(*(required(doc, c.get("schema")) for c in content.values())) if content else set()


def steer(case, objects: Objects, rnd: random.Random, needed: set[str]) -> None:
    """Point the case at what exists (sometimes), keep only what the spec requires (sometimes: the shape of most
    real requests, and the likeliest to be answered), and bound its cost (always): see the module docstring."""
    if case.path_parameters:
        for name in case.path_parameters:
            if rnd.random() < 0.7:
                case.path_parameters[name] = pick_id(case, name, objects)
    body = case.body
    if isinstance(body, dict) and needed and rnd.random() < 0.3:
        for field in set(body) - needed:
            del body[field]
    if isinstance(body, dict):
        for field, cap in CAPS.items():
            if isinstance(body.get(field), int) and not isinstance(body[field], bool):
                body[field] = min(body[field], cap)
        if case.path in MODEL_PATHS and rnd.random() < 0.8:
            body["model"] = EMBED if case.path == "/embeddings" else CHAT
        if case.path == "/batches" and rnd.random() < 0.7:
            body.update(input_file_id=objects.batch_file_id, endpoint="/v1/chat/completions")
        if case.path in ("/chat/completions", "/completions", "/responses"):
            body.setdefault("max_output_tokens" if case.path == "/responses" else "max_tokens", 8)
        if case.path == "/responses" and rnd.random() < 0.5:
            body.pop("previous_response_id", None)
            if "input" not in body:  # optional in OpenAI's spec (a stored prompt may hold it), needed here
                body["input"] = "".join(rnd.choice(string.ascii_letters + " ") for _ in range(rnd.randint(1, 40)))


def pick_id(case, name: str, objects: Objects) -> str:
    deleting = case.method.upper() == "DELETE"
    if name == "model":
        return CHAT
    if name == "file_id":
        return objects.new_file() if deleting else objects.file_id
    if name == "batch_id":
        return objects.batch_id
    if name == "response_id":
        return objects.new_response() if deleting else objects.response_id
    raise AssertionError(f"no object for path parameter {name}")


@pytest.mark.parametrize("method,path", CLAIMED, ids=[f"{m.upper()} {p}" for m, p in CLAIMED])
def test_claimed_operation_conforms(stack, objects, document, schema, method, path, artifacts):
    operation = schema[path][method.upper()]
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    refusals: list[str] = []  # the first few, to say why no 2xx came
    base_url = stack.http_url + "/v1"

    needed = body_required(document, method, path) | EXTRA_REQUIRED.get(path, set())

    def run(case, seed: int) -> None:
        steer(case, objects, random.Random(seed), needed)
        response = case.call(base_url=base_url, headers=AUTH, timeout=120)
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=[not_a_server_error, response_schema_conformance, openai_error])
        except (Exception, FailureGroup) as exc:  # every failure is reported at the end, none shrunk
            failures.append(
                f"-> {response.status_code}: {exc}"[:2500] + f"\n  from: {case.as_curl_command(headers=AUTH)}"[:1000]
            )
            with open(artifacts / "failures.jsonl", "a") as out:  # whole, for the one who reads the failure
                out.write(
                    json.dumps(
                        {
                            "path": case.formatted_path,
                            "query": case.query,
                            "body": case.body,
                            "status": response.status_code,
                            "answer": response.content.decode("utf-8", "replace"),
                            "failure": str(exc),
                        },
                        default=repr,
                    )
                    + "\n"
                )
        if response.status_code >= 400 and len(refusals) < 6:
            refusals.append(
                f"{case.body if isinstance(case.body, dict) else ''}"[:600]
                + f"\n  -> {response.status_code} {response.content[:300]!r}"
            )

    for mode, count in ((GenerationMode.POSITIVE, EXAMPLES), (GenerationMode.NEGATIVE, max(EXAMPLES // 2, 1))):

        @settings(
            max_examples=count,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode), seed=st.integers(0, 2**32))
        def examples(case, seed):
            run(case, seed)

        examples()
    assert not failures, (
        f"{len(failures)} of {sum(statuses.values())} answers failed (all of them in "
        f"{artifacts / 'failures.jsonl'}):\n\n" + "\n\n".join(failures[:8])
    )
    assert any(200 <= s < 300 for s in statuses), f"no generated request got a 2xx: {dict(statuses)}\n\n" + "\n\n".join(
        refusals
    )
