"""Ollama chat messages as OpenAI's (`coderai.gateway.ollama.openai_messages`): what a client sends is checked
like any input, so a malformed one is a 400 naming it, never a 500."""

from __future__ import annotations

import json

import pytest

from coderai.gateway.errors import ApiError
from coderai.gateway.ollama import openai_messages


def test_images_and_tool_calls_become_openai_parts():
    [user, assistant] = openai_messages(
        [
            {"role": "user", "content": "what is it", "images": ["AAAA"]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
        ]
    )
    assert user["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    [call] = assistant["tool_calls"]
    assert call["id"] == "call_0" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize(
    "message, param",
    [
        ({"role": "assistant", "tool_calls": [{"name": "f"}]}, "messages[0].tool_calls[0].function"),
        ({"role": "assistant", "tool_calls": ["f"]}, "messages[0].tool_calls[0].function"),
        ({"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}, "messages[0].tool_calls[0].function"),
        ({"role": "assistant", "tool_calls": {"function": {"name": "f"}}}, "messages[0].tool_calls"),
        ({"role": "user", "images": "AAAA"}, "messages[0].images"),
        ({"role": "user", "images": [1]}, "messages[0].images"),
    ],
)
def test_a_malformed_message_is_a_400_naming_it(message, param):
    with pytest.raises(ApiError) as exc:
        openai_messages([message])
    assert exc.value.status == 400 and exc.value.param == param
