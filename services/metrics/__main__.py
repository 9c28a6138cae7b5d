"""python -m coderai.metrics"""

from coderai.metrics.service import make
from coderai.metrics.settings import MetricsSettings
from coderai.runtime.entry import run_service


def _args(ap) -> None:
    ap.add_argument("--host", help="address for /metrics (CODERAI_METRICS_HOST, default 127.0.0.1)")
    ap.add_argument("--port", type=int, help="port for /metrics (CODERAI_METRICS_PORT, default 9464)")
    ap.add_argument("--redis-url", dest="redis_url", help="Redis for per-key usage (CODERAI_METRICS_REDIS_URL)")


def main(argv: list[str] | None = None) -> int:
    return run_service(
        "metrics",
        "Consumes request events; serves Prometheus /metrics and per-key usage.",
        MetricsSettings,
        make,
        argv,
        add_args=_args,
    )


if __name__ == "__main__":
    raise SystemExit(main())
