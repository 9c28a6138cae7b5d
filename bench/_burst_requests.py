"""The burst bench's requests (bench/burst.py): a streamed chat timed to its first content, and a plain download
of the same weights as a baseline for the fetch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Answer:
    sent: float
    first: float
    engine: str

    @property
    def ttft_s(self) -> float:
        return self.first - self.sent


def _content(line: str) -> str:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return ""
    choices = json.loads(line[6:]).get("choices") or [{}]
    return (choices[0].get("delta") or {}).get("content") or ""


async def stream_chat(http: httpx.AsyncClient, model: str, max_tokens: int) -> Answer:
    """One streamed chat, read to its end; when it was sent and when its first content arrived (wall clock, as
    the events' timestamps). Each prompt starts with a word of its own, so a warm engine evaluates it whole
    instead of reusing the last request's cached prefix, as a cold one must."""
    content = f"{uuid.uuid4().hex[:8]}: say hello."
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    first = None
    sent = time.time()
    async with http.stream("POST", "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{model}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        engine = r.headers.get("coderai-engine", "")
        async for line in r.aiter_lines():
            if first is None and _content(line):
                first = time.time()
    if first is None:
        raise RuntimeError(f"{model}: the streamed answer carried no content")
    return Answer(sent, first, engine)


PLAIN_GET = """
import hashlib, sys, time, httpx
url, dest = sys.argv[1:3]
with httpx.Client(timeout=300) as client:  # made before the clock starts, as the pull's session is
    t = time.perf_counter()
    with client.stream("GET", url) as r, open(dest, "wb") as fh:
        r.raise_for_status()
        for chunk in r.iter_bytes(1 << 20):
            fh.write(chunk)
    got = time.perf_counter() - t
with open(dest, "rb") as fh:
    hashlib.file_digest(fh, "sha256")
print(got, time.perf_counter() - t)
"""


def plain_download(url: str, dest: Path) -> tuple[float, float]:
    """GET `url` into `dest` with a plain httpx client in a process of its own (as a pod's worker is: the Hub-like
    server runs in this one); seconds for the download, and for the download plus a sha256 of the file. The file
    is kept, as a pod keeps its weights: deleting a gigabyte, or not, changes how fast the next one is written."""
    r = subprocess.run(
        [sys.executable, "-c", PLAIN_GET, url, str(dest)],
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    if r.returncode != 0:
        raise RuntimeError(f"plain download of {url} failed:\n{r.stderr[-2000:]}")
    got, both = (float(x) for x in r.stdout.split())
    return got, both
