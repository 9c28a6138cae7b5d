"""A stored response's record (`StoredResponse`), the running gateway's hold on it (`ResponseTenure`) and the input
items as `input_items` lists them. `responses_store` keeps these records in the `coderai_responses` bucket."""

from __future__ import annotations

from typing import Any

import msgspec

from coderai.gateway.errors import ApiError
from coderai.gateway.openai.responses_types import new_id
from coderai.gateway.takeover import Superseded, Tenure

RUNNING = ("queued", "in_progress")


class StoredResponse(msgspec.Struct, kw_only=True):
    id: str
    owner: str
    created_at: float
    response: dict[str, Any]
    input_items: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []  # the conversation without instructions, this response's output included
    runner: str = ""  # a background response's gateway process, which touches `updated_at` while it runs
    updated_at: float = 0.0


class ResponseTenure(Tenure[StoredResponse]):
    """The running gateway's hold on a background response's record: ended (cancelled through another gateway,
    or failed by the read that found it lost) means the work stops."""

    record = StoredResponse

    def lost(self, current: StoredResponse, changes: dict[str, Any]) -> dict[str, Any]:
        if current.response.get("status") not in RUNNING:
            raise Superseded(f"{current.id} is {current.response.get('status')} now")
        return changes


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as `input_items` lists them: each with an id and a type (a bare role message is a message)."""
    out = []
    for it in items:
        it = {**it, "type": it.get("type") or "message"}
        if it["type"] == "message" and isinstance(it.get("content"), str):
            kind = "output_text" if it.get("role") == "assistant" else "input_text"
            it["content"] = [{"type": kind, "text": it["content"]}]
        if not it.get("id"):
            prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
            it = {"id": new_id(prefix.get(it["type"], "item")), **it}
        out.append(it)
    return out


def not_found(resp_id: str) -> ApiError:
    return ApiError(404, f"No response with id '{resp_id}'.", param="response_id", code="not_found")
