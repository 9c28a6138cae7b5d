"""`coderai up`, kept for its importers: the stack lives in `coderai.stack` (`coderai.stack.main:main`)."""

from __future__ import annotations

from coderai.stack.children import SECRET_ENV
from coderai.stack.datadir import (
    ensure_api_key,
    ensure_default_model,
    ensure_members,
    ensure_scrape_token,
    runpod_api_key,
)
from coderai.stack.local import head_bus, service_bus, service_urls
from coderai.stack.main import main
from coderai.stack.ready import banner, wait_ready
from coderai.stack.servers import keep_up

__all__ = [
    "SECRET_ENV",
    "banner",
    "ensure_api_key",
    "ensure_default_model",
    "ensure_members",
    "ensure_scrape_token",
    "head_bus",
    "keep_up",
    "main",
    "runpod_api_key",
    "service_bus",
    "service_urls",
    "wait_ready",
]

if __name__ == "__main__":
    raise SystemExit(main())
