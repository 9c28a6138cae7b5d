"""The cluster page as served: its CSP admits exactly its own inline script and style, and it builds the DOM
without parsing strings as HTML and loads nothing from elsewhere."""

from __future__ import annotations

import base64
import hashlib
import re
from importlib import resources

from coderai.gateway.ui import content_security_policy

PAGE = resources.files("coderai.gateway").joinpath("ui.html").read_bytes()


def _sha(body: bytes) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(body).digest()).decode() + "'"


def test_csp_pins_the_inline_script_and_style_by_hash():
    [script] = re.findall(rb"<script>(.*?)</script>", PAGE, re.S)
    [style] = re.findall(rb"<style>(.*?)</style>", PAGE, re.S)
    policy = dict(d.split(" ", 1) for d in content_security_policy(PAGE).split("; "))
    assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
    assert policy["script-src"] == _sha(script) and policy["style-src"] == _sha(style)
    assert policy["form-action"] == "'none'"


def test_no_html_parsing_of_strings_and_no_external_urls():
    text = PAGE.decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in text, sink
    # The only absolute URL is the SVG namespace inside the inline favicon, which is never fetched.
    assert re.findall(r"https?://[^\s'\"]+", text) == ["http://www.w3.org/2000/svg"]
