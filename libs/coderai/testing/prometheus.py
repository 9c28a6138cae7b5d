"""A real Prometheus (Debian's `prometheus`) for the soak and the compose test: it scrapes coderai's metrics service
and answers PromQL, so a figure is read back the way an operator reads it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx

from coderai.runtime.embedded import free_port
from coderai.testing.procs import wait_until


class Prometheus:
    """Debian's `prometheus`, scraping the metrics service every second (with the scrape token `bearer`, when given),
    on a loopback port of its own."""

    def __init__(self, root: Path, metrics_port: int, logs: Path, bearer: str = "") -> None:
        self.root, self.metrics_port, self.logs, self.bearer = root, metrics_port, logs, bearer
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Prometheus":
        binary = shutil.which("prometheus")
        if binary is None:
            raise SystemExit("needs Debian's prometheus (apt-get install prometheus)")
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "prometheus.yml"
        auth = f"    authorization:\n      credentials: '{self.bearer}'\n" if self.bearer else ""
        conf.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n"
            f"  - job_name: coderai\n{auth}    static_configs:\n      - targets: ['127.0.0.1:{self.metrics_port}']\n"
        )
        log = open(self.logs / "prometheus.log", "ab")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={conf}",
                f"--storage.tsdb.path={self.root / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{self.port}/-/ready", timeout=2).status_code == 200,
            60,
            "prometheus to be ready",
        )
        return self

    def query(self, q: str) -> list[dict]:
        r = httpx.get(f"http://127.0.0.1:{self.port}/api/v1/query", params={"query": q}, timeout=10)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def scalar(self, q: str) -> float:
        res = self.query(q)
        return float(res[0]["value"][1]) if res else 0.0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
