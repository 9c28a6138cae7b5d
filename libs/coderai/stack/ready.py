"""When `coderai up` is ready, and what it says then: readiness is a real answer through the whole stack."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from coderai.runtime.cluster import fingerprint
from coderai.runtime.supervisor import Supervisor


def wait_ready(base: str, key: str, model: str, sup: Supervisor, timeout_s: float, chat: bool = True) -> None:
    """Ready means a real one-token chat answer came back through the whole stack; without a worker on this
    machine (`chat=False`: a head of the control plane only), that the gateway answers."""
    if not chat:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sup.tick()
            try:
                with urllib.request.urlopen(f"{base[:-3]}/healthz", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the gateway did not answer within {timeout_s:.0f}s")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        sup.tick()
        req = urllib.request.Request(
            f"{base}/chat/completions",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status == 200:
                    return
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.25)
    raise TimeoutError(f"the stack did not answer a chat request within {timeout_s:.0f}s (last: {last})")


def banner(
    base: str,
    key: str,
    model: str,
    nats_url: str,
    metrics_port: int,
    data: Path,
    others: tuple[str, ...] = (),
    pods: bool = False,
) -> str:
    """What `coderai up` prints once it answers: the base URL, where the key is, the models, an SDK example."""
    # the key itself is not printed (terminals and their scrollback, CI logs and screen shares keep what is)
    shown_key = f"in {data / 'admin.key'}" if key else "anything (auth is off)"
    sdk_key = f'open("{data / "admin.key"}").read().strip()' if key else '"none"'
    also = f"\n  also       {', '.join(others)}   (GET /v1/models: each with its kind)" if others else ""
    return f"""
coderai is up.

  base URL   {base}
  API key    {shown_key}
  model      {model}{also}
  NATS       {nats_url}
  metrics    {base[:-3]}/metrics (admin key, or the token in {data / "scrape.token"})
  pods       {"RunPod, through the pod broker (GET /admin/pods)" if pods else "off: no RunPod API key (--runpod-key-file)"}
  logs       {data / "logs"}

Try it with the official SDK:

  from openai import OpenAI
  client = OpenAI(base_url="{base}", api_key={sdk_key})
  r = client.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(r.choices[0].message.content)

Ctrl-C stops everything.
ready"""


def cluster_hint(token: str, nats_port: int) -> str:
    """How another machine joins this cluster (the fingerprint names it; the token itself is not printed)."""
    return (
        f"\ncluster {fingerprint(token)[:8]}: on another machine run `coderai worker --cluster-token <token>`"
        f" (found by mDNS), or add --nats-url nats://<this host>:{nats_port}"
    )
