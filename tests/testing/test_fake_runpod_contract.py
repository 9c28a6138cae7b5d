"""The fake RunPod API against RunPod's published contract (issue #27).

Every operation RunPod publishes for pods and GPU types, vendored in `runpod_published_ops.py` (the docs) and
`runpod_sdk_ops.py` (the SDK), must

1. validate against the fake's schema (`coderai.testing.fake_runpod.SCHEMA`, graphql-core `parse` + `validate`);
2. run against a live fake over its HTTP API as the publisher sends it (the docs' cURL: POST /graphql?api_key=...;
   the SDK: POST /graphql with `Authorization: Bearer ...`) and answer 200 with `data` and no `errors`;
3. answer in the published shape: exactly the fields the operation selects, and where RunPod documents an example
   output, the same keys at every level with the same JSON types (a documented list's first element is the shape
   of every element answered; a documented `YOUR_POD_ID` must be the pod's id).

Versions, cited:

- RunPod GraphQL docs, "Manage Pods", https://docs.runpod.io/sdks/graphql/manage-pods (github.com/runpod/docs
  `sdks/graphql/manage-pods.mdx` at a900806e253c4f8c16da27d1a4370e72456da4cb, 2026-08-20); its spot sections
  (`podRentInterruptable`, `minimumBidPrice`) from the same file at eb33022ae014d3e85cfdc94191278ae1a9c30014
  (2026-05-01), the last revision before they were taken out of the guide.
- The `runpod` Python SDK 1.12.0 (github.com/runpod/runpod-python v1.12.0, 07fc6e2b02b6a97a0e94fbdcf53c66949c1a6164):
  the operations its `get_gpus`, `get_gpu`, `get_pods`, `get_pod`, `create_pod`, `stop_pod`, `resume_pod` and
  `terminate_pod` send; the last test checks the vendored text is what the installed SDK renders.
"""

from __future__ import annotations

import importlib
import json
from importlib import metadata

import httpx
import pytest
from graphql import FieldNode, OperationDefinitionNode, SelectionSetNode, parse, validate

from coderai.testing.fake_runpod import SCHEMA, FakeGpuType, FakeRunPod
from tests.testing.runpod_published_ops import DOCS_OPS, POD_ID, SDK, SDK_VERSION, PublishedOp
from tests.testing.runpod_sdk_ops import SDK_OPS

OPS = DOCS_OPS + SDK_OPS

# The GPU types the docs' examples name, at the docs' prices where they show them (RTX 3090: 0.3 on demand, 0.163
# lowest bid); the A6000's spot price is the docs' example bid (0.2/GPU), which the fake must then accept.
DOCS_GPUS = (
    FakeGpuType("NVIDIA GeForce RTX 3070", "RTX 3070", 8, 0.13, 0.07),
    FakeGpuType("NVIDIA GeForce RTX 3080", "RTX 3080", 10, 0.17, 0.09),
    FakeGpuType("NVIDIA GeForce RTX 3090", "RTX 3090", 24, 0.3, 0.163),
    FakeGpuType("NVIDIA RTX A4000", "RTX A4000", 16, 0.35, 0.24, max_gpu_count=7),
    FakeGpuType("NVIDIA RTX A6000", "RTX A6000", 48, 0.79, 0.2),
)
CREATE = next(op for op in OPS if op.name == "docs: Create a Pod")
STOP = next(op for op in OPS if op.name == "docs: Stop a Pod")
ids = [op.name for op in OPS]


@pytest.fixture
def fake():
    with FakeRunPod(gpu_types=DOCS_GPUS) as f:
        yield f


def send(fake: FakeRunPod, op: PublishedOp, query: str) -> httpx.Response:
    """POST the operation the way its publisher does."""
    if op.source == SDK:  # runpod.api.graphql.run_graphql_query
        return httpx.post(
            f"{fake.base_url}/graphql",
            content=json.dumps({"query": query}),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {fake.api_key}"},
        )
    return httpx.post(
        f"{fake.base_url}/graphql",
        params={"api_key": fake.api_key},  # the docs' cURL
        content=json.dumps({"query": query}),
        headers={"content-type": "application/json"},
    )


def run_ok(fake: FakeRunPod, op: PublishedOp, pod_id: str | None = None) -> dict:
    r = send(fake, op, op.query.replace(POD_ID, pod_id) if pod_id else op.query)
    body = r.json()
    assert r.status_code == 200 and "errors" not in body, (op.name, r.status_code, body)
    assert set(body) == {"data"}, body
    return body


def prepare(fake: FakeRunPod, needs: str) -> str | None:
    """A booted pod (created with the docs' own create example), stopped if `needs` says so."""
    if not needs:
        return None
    pod_id = run_ok(fake, CREATE)["data"]["podFindAndDeployOnDemand"]["id"]
    fake.wait_booted(pod_id, timeout_s=10)
    if needs == "stopped":
        assert run_ok(fake, STOP, pod_id)["data"]["podStop"]["desiredStatus"] == "EXITED"
    return pod_id


def check_selected(value, selection: SelectionSetNode, path: str) -> None:
    """The answer has exactly the fields the operation selects, at every level."""
    if value is None:
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            check_selected(v, selection, f"{path}[{i}]")
        return
    assert isinstance(value, dict), f"{path}: {value!r} is not an object"
    fields = {}
    for node in selection.selections:
        assert isinstance(node, FieldNode), f"{path}: published operations use no fragments"
        fields[(node.alias or node.name).value] = node
    assert set(value) == set(fields), f"{path}: answered {sorted(value)}, selected {sorted(fields)}"
    for key, node in fields.items():
        if node.selection_set is not None:
            check_selected(value[key], node.selection_set, f"{path}.{key}")


def json_type(v) -> str:
    return (
        "null"
        if v is None
        else "boolean"
        if isinstance(v, bool)
        else "number"
        if isinstance(v, (int, float))
        else "string"
        if isinstance(v, str)
        else "array"
        if isinstance(v, list)
        else "object"
    )


def check_documented(actual, documented, path: str, pod_id: str | None) -> None:
    """Same keys at every level as the documented output, and the same JSON type where the docs show a value."""
    if documented is None:
        return
    assert json_type(actual) == json_type(documented), (
        f"{path}: answered {actual!r} ({json_type(actual)}), documented {documented!r} ({json_type(documented)})"
    )
    if isinstance(documented, dict):
        assert set(actual) == set(documented), f"{path}: answered {sorted(actual)}, documented {sorted(documented)}"
        for k in documented:
            check_documented(actual[k], documented[k], f"{path}.{k}", pod_id)
    elif isinstance(documented, list) and documented:
        for i, a in enumerate(actual):
            check_documented(a, documented[0], f"{path}[{i}]", pod_id)
    elif documented == POD_ID:
        assert actual == pod_id, f"{path}: answered {actual!r}, the pod is {pod_id!r}"


@pytest.mark.parametrize("op", OPS, ids=ids)
def test_every_published_operation_validates_against_the_fakes_schema(op: PublishedOp):
    assert [e.message for e in validate(SCHEMA, parse(op.query))] == []


@pytest.mark.parametrize("op", OPS, ids=ids)
def test_the_fake_answers_every_published_operation_in_the_published_shape(fake, op: PublishedOp):
    pod_id = prepare(fake, op.needs)
    body = run_ok(fake, op, pod_id)
    (operation,) = [d for d in parse(op.query).definitions if isinstance(d, OperationDefinitionNode)]
    check_selected(body["data"], operation.selection_set, "data")
    for output in op.outputs:
        check_documented(body, json.loads(output), "", pod_id)


def test_the_published_spot_and_resume_examples_behave_as_documented(fake):
    """Beyond shape: the docs' example values that say what happened (a stop EXITED, a resume RUNNING, the spot bid
    accepted at the spot price, terminate answering null and the pod gone)."""
    by_name = {op.name: op for op in OPS}
    pod_id = prepare(fake, "stopped")
    assert run_ok(fake, by_name["docs: Start a Pod"], pod_id)["data"]["podResume"]["desiredStatus"] == "RUNNING"
    spot = run_ok(fake, by_name["docs (spot): Create a Pod, spot"])["data"]["podRentInterruptable"]
    assert fake.pod(spot["id"]).spot and spot["env"] == ["JUPYTER_PASSWORD=your-password"]
    assert run_ok(fake, by_name["sdk: terminate_pod"], pod_id) == {"data": {"podTerminate": None}}
    got = run_ok(fake, by_name["docs: Get Pod by ID"], pod_id)
    assert got == {"data": {"pod": None}}


def test_the_vendored_sdk_operations_are_what_the_pinned_sdk_sends():
    runpod = pytest.importorskip("runpod")
    if metadata.version("runpod") != SDK_VERSION:
        pytest.skip(f"runpod {metadata.version('runpod')} installed; the vendored operations are {SDK_VERSION}'s")
    assert runpod is not None
    sdk_ops = [op for op in OPS if op.sdk is not None]
    assert {op.source for op in sdk_ops} == {SDK} and len(sdk_ops) == 8
    for op in sdk_ops:
        module, attr, args = op.sdk
        rendered = getattr(importlib.import_module(module), attr)
        assert (rendered if args is None else rendered(*args)) == op.query, op.name
