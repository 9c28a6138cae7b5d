"""A streamed response as OpenAI sends it: `event: <type>\\ndata: {json}\\n\\n`, `sequence_number` from 0.

response.created, response.in_progress, then per output item: output_item.added, (content_part.added,
output_text.delta..., output_text.done, content_part.done | function_call_arguments.delta..., .done |
reasoning_text.delta..., .done | custom_tool_call_input.done), output_item.done; then response.completed (or .incomplete at the output token
cap; an engine failure is an `error` event and response.failed). The chat op's deltas drive it: an item opens
when its first delta comes and closes when another kind of delta (or the end) does.
"""

from __future__ import annotations

from typing import Any

import msgspec

from coderai.contracts import Chunk, Usage
from coderai.gateway.errors import ApiError
from coderai.gateway.openai.responses_types import (
    ResponseRequest,
    call_item,
    final_status,
    message_item,
    new_id,
    reasoning_item,
    response_body,
    restored,
    seal_reasoning,
    sealed,
    tool_names,
)

_enc = msgspec.json.Encoder()


class EventStream:
    """The events of one response; `output` is what it has produced so far (the items, finished)."""

    def __init__(self, resp_id: str, created: float, req: ResponseRequest) -> None:
        self.resp_id, self.created, self.req = resp_id, created, req
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.kind = ""  # the open item's: "reasoning", "message", "call" (or none)
        self.call_index: int | None = None  # the chat delta index of the open tool call
        self.finish_reason: str | None = None
        self.names = tool_names(req)  # namespace and custom tools, as the template names them

    def _event(self, type_: str, **fields: object) -> bytes:
        data = _enc.encode({"type": type_, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + data + b"\n\n"

    def body(self, status: str, usage: Usage | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_body(self.resp_id, self.created, self.req, self.output, usage, status, error)

    def start(self) -> bytes:
        return self._event("response.created", response=self.body("in_progress")) + self._event(
            "response.in_progress", response=self.body("in_progress")
        )

    # --- items -------------------------------------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open(self, kind: str, item: dict[str, Any], part: dict[str, Any] | None) -> bytes:
        out = self._close()
        self.kind = kind
        self.output.append(item)
        added = {**(restored(item, self.names) if kind == "call" else item), "status": "in_progress"}
        if part is not None:
            added["content"] = []
        out += self._event("response.output_item.added", output_index=len(self.output) - 1, item=added)
        if part is not None:
            out += self._event("response.content_part.added", **self._where(), content_index=0, part=part)
        return out

    def _close(self) -> bytes:
        """Finish the open item: its done events, with the whole text or arguments."""
        if not self.kind:
            return b""
        item, where, out = self.output[-1], self._where(), b""
        if self.kind == "message":
            part = item["content"][0]
            if self.finish_reason == "length":
                item["status"] = "incomplete"
            out += self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
        elif self.kind == "reasoning":
            part = item["content"][0]
            if sealed(self.req):
                seal_reasoning(item)
            out += self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            out += self._event("response.content_part.done", **where, content_index=0, part=part)
        else:
            item = self.output[-1] = restored(item, self.names)
            if item["type"] == "custom_tool_call":
                out += self._event("response.custom_tool_call_input.done", **where, input=item["input"])
            else:
                out += self._event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
                )
        self.kind, self.call_index = "", None
        return out + self._event("response.output_item.done", output_index=where["output_index"], item=item)

    def _text(self, text: str) -> bytes:
        out = b""
        if self.kind != "message":
            out = self._open(
                "message",
                message_item(new_id("msg"), ""),
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        self.output[-1]["content"][0]["text"] += text
        return out + self._event(
            "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=[]
        )

    def _reasoning(self, text: str) -> bytes:
        out = b""
        if self.kind != "reasoning":
            out = self._open("reasoning", reasoning_item(new_id("rs"), ""), {"type": "reasoning_text", "text": ""})
        self.output[-1]["content"][0]["text"] += text
        return out + self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)

    def _call(self, tc: dict[str, Any]) -> bytes:
        fn = tc.get("function") or {}
        index = tc.get("index", 0)
        out = b""
        if self.kind != "call" or self.call_index != index:
            out = self._open(
                "call", call_item(new_id("fc"), tc.get("id") or new_id("call"), fn.get("name") or "", ""), None
            )
            self.call_index = index
        elif fn.get("name"):
            self.output[-1]["name"] += fn["name"]
        args = fn.get("arguments") or ""
        if not args:
            return out
        self.output[-1]["arguments"] += args
        if self._custom():  # its input is whole only once the arguments are: told at its .done
            return out
        return out + self._event("response.function_call_arguments.delta", **self._where(), delta=args)

    def _custom(self) -> bool:
        known = self.names.get(self.output[-1]["name"])
        return known is not None and known[2]

    # --- the pipeline's callbacks ------------------------------------------------------------------------

    def chunk(self, ch: Chunk) -> bytes:
        d = ch.delta or {}
        if ch.finish_reason:
            self.finish_reason = ch.finish_reason
        out = b""
        if isinstance(thought := d.get("reasoning_content"), str) and thought:
            out += self._reasoning(thought)
        if isinstance(text := d.get("content"), str) and text:
            out += self._text(text)
        calls = d.get("tool_calls")
        for tc in calls if isinstance(calls, list) else ():
            out += self._call(tc)
        return out

    def end(self, usage: Usage) -> tuple[bytes, dict[str, Any]]:
        """The last events, and the finished response object."""
        out = self._close()
        if not any(it["type"] in ("message", "function_call", "custom_tool_call") for it in self.output):
            out += self._empty_message()
        status = final_status(self.finish_reason)
        body = self.body(status, usage)
        return out + self._event(f"response.{status}", response=body), body

    def _empty_message(self) -> bytes:
        out = self._open(
            "message",
            message_item(new_id("msg"), ""),
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
        )
        return out + self._close()

    def fail(self, err: ApiError) -> tuple[bytes, dict[str, Any]]:
        """An engine failure after the headers: OpenAI's `error` event, then response.failed."""
        self.kind = ""  # an item cut off stays as far as it got
        body = self.body("failed", error={"code": "server_error", "message": err.message})
        return (
            self._event("error", code=err.code, message=err.message, param=err.param)
            + self._event("response.failed", response=body)
        ), body
