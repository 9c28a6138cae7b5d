"""What Codex CLI 0.171 sends the Responses API (docs/api.md, Responses): the tools it cannot turn off (a namespace
of MCP tools, a custom apply_patch, web_search), for the tests that speak as it."""

from __future__ import annotations

SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Run a command",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"],
    },
}
PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"},
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
MCP = {
    "type": "namespace",
    "name": "mcp__files",
    "description": "An MCP server",
    "tools": [
        {
            "type": "function",
            "name": "read",
            "description": "Read a file",
            "strict": False,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        }
    ],
}
