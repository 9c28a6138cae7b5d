"""A schema's depth and size are bounded before any engine builds a grammar from it."""

from __future__ import annotations

import pytest

from coderai.contracts import ChatJob, RequestId
from coderai.gateway.bounds import MAX_SCHEMA_DEPTH, check_schemas, depth
from coderai.gateway.errors import ApiError


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def job(**kw) -> ChatJob:
    return ChatJob(request_id=RequestId("r"), model="m", messages=[{"role": "user", "content": "x"}], **kw)


def test_depth_counts_objects_and_arrays_without_recursion():
    assert depth("x", 5) == 0 and depth({"a": [1, {"b": 2}]}, 5) == 3
    assert depth(nested(5000), MAX_SCHEMA_DEPTH) == MAX_SCHEMA_DEPTH + 1  # stops early, no RecursionError


def test_deep_or_huge_schemas_are_400s_naming_the_field():
    with pytest.raises(ApiError) as exc:
        check_schemas(job(response_format={"type": "json_schema", "json_schema": {"schema": nested(40)}}))
    assert (exc.value.status, exc.value.param, exc.value.code) == (400, "response_format", "schema_too_complex")
    with pytest.raises(ApiError) as exc:
        check_schemas(job(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(40)}}]))
    assert exc.value.param == "tools"
    with pytest.raises(ApiError) as exc:
        check_schemas(
            job(response_format={"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 300_000]}}})
        )
    assert exc.value.code == "schema_too_large"
    check_schemas(job(response_format={"type": "json_schema", "json_schema": {"schema": nested(10)}}))
