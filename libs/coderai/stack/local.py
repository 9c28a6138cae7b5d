"""How the CLI finds and reaches the `coderai up` running on a data dir: `run/up.json` (written once the stack's
children are started, with no secrets in it), the service login and the CA kept beside it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec

from coderai.runtime import members
from coderai.runtime.bus import Bus
from coderai.runtime.cluster import with_user
from coderai.runtime.settings import CommonSettings
from coderai.runtime.tls import client_context
from coderai.stack.heads import Head


def write_record(
    data: Path, base: str, nats_url: str, redis_url: str, metrics_port: int, pids: dict[str, int], heads: list[Head]
) -> None:
    """Write `run/up.json`: where the running stack answers and its processes' ids (what `service_urls` and the
    tests read back)."""
    run = data / "run"
    run.mkdir(exist_ok=True)
    (run / "up.json").write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "base_url": base,
                "nats_url": nats_url,  # no secrets: see secrets/
                "redis_url": redis_url,
                "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
                "pids": pids,
                "heads": [msgspec.to_builtins(h) for h in heads],
            },
            indent=2,
        )
    )


def service_urls(data: Path) -> tuple[str, str]:
    """(NATS URL as a service, Redis URL with its password) of the `coderai up` running on `data`, for the CLI."""
    up = json.loads((data / "run" / "up.json").read_text())
    nats_url = with_user(
        up["nats_url"], members.SERVICE_USER, members.read_secret(data / "secrets" / "nats-service.password")
    )
    redis_password = members.read_secret(data / "secrets" / "redis.password")
    return nats_url, up["redis_url"].replace("://", f"://:{redis_password}@", 1)


async def service_bus(data: Path, name: str) -> Bus:
    """A bus connection as a service to the `coderai up` running on `data` (its password, its CA), for the CLI."""
    ca = data / "nats" / "tls" / "ca.pem"
    tls = client_context(ca.read_text()) if ca.exists() else None
    return await Bus.connect(service_urls(data)[0], name, connect_timeout_s=5.0, tls=tls)


async def head_bus(name: str, nats_url: str, data: Path) -> Bus:
    """The CLI's connection to a head as a service: `nats_url` with CODERAI_NATS_PASSWORD_FILE and CODERAI_NATS_CA
    from the environment, else the `coderai up` running on `data`."""
    if not nats_url:
        return await service_bus(data, name)
    settings = CommonSettings(
        nats_url=nats_url,
        nats_password_file=os.environ.get("CODERAI_NATS_PASSWORD_FILE", ""),
        nats_ca=os.environ.get("CODERAI_NATS_CA", ""),
    )
    return await Bus.connect_as(settings, name, connect_timeout_s=5.0)
