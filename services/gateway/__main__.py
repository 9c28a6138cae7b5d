"""python -m coderai.gateway: the OpenAI-compatible HTTP API, served by granian."""

from __future__ import annotations

import os
import resource
import sys

from coderai.gateway.settings import GatewaySettings
from coderai.runtime.entry import parser, settings_from_args
from coderai.runtime.settings import SettingsError


def main(argv: list[str] | None = None) -> int:
    ap = parser("gateway", "The OpenAI-compatible HTTP API (and admin API) in front of the cluster.")
    ap.add_argument("--host", help="address to listen on (CODERAI_GATEWAY_HOST, default 127.0.0.1)")
    ap.add_argument("--port", type=int, help="port (CODERAI_GATEWAY_PORT, default 8000)")
    ap.add_argument("--workers", type=int, help="HTTP worker processes (CODERAI_GATEWAY_WORKERS)")
    ap.add_argument(
        "--api-keys-file", dest="api_keys_file", help="TOML of hashed API keys (CODERAI_GATEWAY_API_KEYS_FILE)"
    )
    ap.add_argument(
        "--no-auth",
        dest="no_auth",
        action="store_const",
        const=True,
        help="serve without API keys (loopback hosts only)",
    )
    args = ap.parse_args(argv)
    try:
        settings = settings_from_args(GatewaySettings, "gateway", args)
        from coderai.gateway.settings import check_auth_settings  # not app: its imports cost a second
        from coderai.accounts.keyfile import load_keys

        check_auth_settings(settings)
        if settings.api_keys_file and not settings.no_auth:
            load_keys(settings.api_keys_file)
    except SettingsError as exc:
        print(f"coderai gateway: {exc}", file=sys.stderr)
        return 2
    # granian's workers build the app from the environment: hand them the flags given here
    for name, value in vars(args).items():
        if value is not None and name in GatewaySettings.__struct_fields__:
            os.environ[f"CODERAI_GATEWAY_{name.upper()}"] = str(value)

    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, RuntimeModes, TaskImpl
    from granian.http import HTTP1Settings
    from granian.log import LogLevels

    from coderai.runtime.logging import setup_logging

    server = Granian(
        "coderai.gateway.app:create_app",
        factory=True,
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        # HTTP/1.1 only: the header timer then runs from the accept; in `auto` mode nothing times out a socket
        # that never sends a byte, while granian sniffs for an HTTP/2 preface (tests/integration/test_http_abuse)
        http=HTTPModes.http1,
        http1_settings=HTTP1Settings(header_read_timeout=max(1, round(settings.header_timeout_s * 1000))),
        workers=settings.workers,
        task_impl=TaskImpl(settings.task_impl),
        runtime_mode=RuntimeModes(settings.runtime_mode),
        backpressure=connection_limit(settings.max_connections),
        log_level=LogLevels.warning,
        backlog=2048,
        log_dictconfig=GRANIAN_LOGGING,
    )
    setup_logging("gateway", settings.node_id, settings.log_level, settings.log_format)  # after granian's own setup
    server.serve()
    return 0


GRANIAN_LOGGING = {
    "loggers": {"_granian": {"handlers": [], "propagate": True}, "granian.access": {"handlers": [], "propagate": True}}
}
"""Granian's loggers without handlers of their own: what it logs goes through the root logger, as every line of the
gateway does (JSON off a terminal), in its main process and in each worker (whose app sets the root logger up)."""


def connection_limit(configured: int) -> int:
    """Connections one granian worker may hold. Granian's own default (backlog / workers: 2048) let 2048 idle
    sockets stop the gateway answering anyone; the true bound is open files, so the soft limit is raised to the hard
    one (as Go's runtime does) and all of it but 256 files (NATS, Redis, logs) may be connections."""
    if configured > 0:
        return configured
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = 1 << 20  # files enough for any gateway; an unlimited or huge hard limit is not taken whole
    want = most if hard == resource.RLIM_INFINITY else min(hard, most)
    if soft == resource.RLIM_INFINITY or soft > most:
        soft = most
    elif soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # granian's workers inherit it
            soft = want
        except (ValueError, OSError):  # above the system's cap (fs.nr_open, macOS' OPEN_MAX): keep the one there is
            pass
    return max(256, soft - 256)


if __name__ == "__main__":
    raise SystemExit(main())
