"""OpenAI's Responses API, a chat answer as the response object: its output items (reasoning, the message, tool
calls as the request named its tools), the response body and its usage, reasoning sealed for a client that asks
for it back.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from coderai.contracts import Choice, Final, Usage
from coderai.gateway.openai.responses_tools import NS_SEP, echoed, tool_names
from coderai.gateway.seal import sealer

if TYPE_CHECKING:
    from coderai.gateway.openai.responses_types import ResponseRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def usage_json(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens or u.prompt_tokens + u.completion_tokens,
    }


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model gave its one-string function (as is if not that)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    return args["input"] if isinstance(args, dict) and isinstance(args.get("input"), str) else arguments


def restored(item: dict[str, Any], names: dict[str, tuple[str, str | None, bool]] | None) -> dict[str, Any]:
    """A function_call item as the request named its tool: a namespace's tool with its `namespace` and own
    name, a custom tool's call as a `custom_tool_call` with its `input`."""
    known = (names or {}).get(item["name"])
    if known is None:
        return item
    name, ns, custom = known
    if custom:
        out = {
            "id": item["id"].replace("fc_", "ctc_", 1),
            "type": "custom_tool_call",
            "call_id": item["call_id"],
            "name": name,
            "input": custom_input(item["arguments"]),
            "status": item["status"],
        }
    else:
        out = {**item, "name": name}
    return {**out, "namespace": ns} if ns else out


def output_items(
    message: dict[str, Any], finish_reason: str | None, names: dict[str, tuple[str, str | None, bool]] | None = None
) -> list[dict[str, Any]]:
    """A chat answer's message as output items: reasoning, the text message, then one item per tool call."""
    out = []
    if message.get("reasoning_content"):
        out.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        status = "incomplete" if finish_reason == "length" else "completed"
        out.append(message_item(new_id("msg"), message.get("content") or "", status))
    for tc in calls:
        fn = tc.get("function") or {}
        out.append(
            restored(
                call_item(new_id("fc"), tc.get("id") or new_id("call"), fn.get("name", ""), fn.get("arguments", "")),
                names,
            )
        )
    return out


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The output items as the chat message a continuation sends back: text and tool calls, ids kept."""
    text = "".join(p["text"] for it in output if it["type"] == "message" for p in it["content"])
    calls = [
        {
            "id": it["call_id"],
            "type": "function",
            "function": {
                "name": it["namespace"] + NS_SEP + it["name"] if it.get("namespace") else it["name"],
                "arguments": it["arguments"]
                if it["type"] == "function_call"
                else json.dumps({"input": it["input"]}, ensure_ascii=False),
            },
        }
        for it in output
        if it["type"] in ("function_call", "custom_tool_call")
    ]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def response_body(
    resp_id: str,
    created: float,
    req: ResponseRequest,
    output: list[dict[str, Any]],
    usage: Usage | None,
    status: str,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The response object, in OpenAI's shape: `status` completed, incomplete (at the output token cap), queued,
    in_progress, cancelled or failed."""
    done = status in ("completed", "incomplete")
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(created),
        "status": status,
        "background": req.background,
        "completed_at": int(time.time()) if done else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": req.model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": fmt, "verbosity": "medium"},
        "tool_choice": req.tool_choice or "auto",
        "tools": echoed(req.tools),
        "top_p": req.top_p,
        "truncation": req.truncation or "disabled",
        **({"usage": usage_json(usage)} if usage is not None else {}),  # none yet: left out (no null in the schema)
        **({"user": req.user} if req.user is not None else {}),  # OpenAI's schema has no null `user`
    }


def final_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def from_choice(choice: Choice, req: ResponseRequest | None = None) -> list[dict[str, Any]]:
    items = output_items(choice.message or {}, choice.finish_reason, tool_names(req) if req is not None else None)
    if req is not None and sealed(req):
        for item in items:
            if item["type"] == "reasoning":
                seal_reasoning(item)
    return items


def sealed(req: ResponseRequest) -> bool:
    """Whether the client asked for its reasoning back sealed, to send with its next turn (Codex, `store: false`)."""
    return "reasoning.encrypted_content" in (req.include or [])


def seal_reasoning(item: dict[str, Any]) -> None:
    """A reasoning item's text sealed into its `encrypted_content` (gateway/seal.py)."""
    item["encrypted_content"] = sealer().seal("".join(p.get("text", "") for p in item.get("content") or []))


def final_body(resp_id: str, created: float, req: ResponseRequest, final: Final) -> dict[str, Any]:
    """The response object of a whole chat answer (what `/v1/responses` and a batch's line answer)."""
    choice = final.choices[0] if final.choices else Choice()
    return response_body(
        resp_id, created, req, from_choice(choice, req), final.usage, final_status(choice.finish_reason)
    )
