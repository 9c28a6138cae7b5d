"""The cluster page at `/ui`: one static HTML file with its CSS and JS inline, no build step, no external URLs.

Loading it needs no key; it shows nothing until the operator signs in with an admin key, and every number on it
comes from the admin API with that key. A strict Content-Security-Policy pins the inline script and style by hash,
so even a string that slipped past the page's escaping could not run."""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from litestar import Response, get

_INLINE = re.compile(rb"<(script|style)>(.*?)</\1>", re.S)


def content_security_policy(page: bytes) -> str:
    """Allow exactly the page's own inline `<script>` and `<style>` blocks, and fetches to this origin."""
    hashes: dict[bytes, list[str]] = {b"script": [], b"style": []}
    for tag, body in _INLINE.findall(page):
        hashes[tag].append("'sha256-" + base64.b64encode(hashlib.sha256(body).digest()).decode() + "'")
    return "; ".join(
        [
            "default-src 'none'",
            "script-src " + (" ".join(hashes[b"script"]) or "'none'"),
            "style-src " + (" ".join(hashes[b"style"]) or "'none'"),
            "img-src data:",
            "connect-src 'self'",
            "base-uri 'none'",
            "form-action 'none'",  # the sign-in form is handled in script; the key must never go into a URL
            "frame-ancestors 'none'",
        ]
    )


def ui_routes() -> list:
    """The `/ui` route; the page is read once, when the app is built."""
    page = resources.files("coderai.gateway").joinpath("ui.html").read_bytes()
    headers = {
        "Content-Security-Policy": content_security_policy(page),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }

    @get("/ui", include_in_schema=False)
    async def ui() -> Response:
        return Response(content=page, media_type="text/html; charset=utf-8", headers=headers)

    return [ui]
