"""A head (`coderai up --cluster-token`) and nodes on the machines of a netns `Lab`, for the tests that join real
nodes to it (tests/cluster, tests/security): commands run on a lab machine, and `coderai.testing.probe` asks the
head's side what the cluster holds."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from coderai.testing.netns import Lab
from coderai.testing.procs import ServiceProcess, deadline_scale, wait_until
from coderai.testing.stack import head_up


class LabCluster:
    probe_timeout_s = 60.0

    def __init__(self, lab: Lab, root: Path, env: dict[str, str]) -> None:
        self.lab, self.root, self.env = lab, root, env
        self.procs: dict[str, ServiceProcess] = {}
        self.key = ""  # the head's admin key, once it is up

    def run(self, host: str, *args: str, timeout_s: float = 120) -> str:
        """`python *args` on `host`; its stdout (a failure is an AssertionError with its output)."""
        r = self.lab.run(host, [sys.executable, *args], env=self.env, timeout_s=timeout_s)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        return r.stdout

    def last_json(self, host: str, *args: str, timeout_s: float = 120) -> object:
        return json.loads(self.run(host, *args, timeout_s=timeout_s).strip().splitlines()[-1])

    def probe(self, *args: str) -> object:
        return self.last_json("head", "-m", "coderai.testing.probe", *args, timeout_s=self.probe_timeout_s)

    def nodes(self) -> list[str]:
        nodes = self.probe("nodes", "--data-dir", str(self.root / "head"))
        assert isinstance(nodes, list), nodes
        return nodes

    @contextlib.contextmanager
    def watching_nodes(self, present: tuple[str, ...] = (), absent: tuple[str, ...] = (), timeout_s: float = 60):
        """A probe on the head that reads the nodes every 0.1 s until `present` are all there and `absent` all
        gone, started (its first read done) before the block runs. Yields a callable that waits for its answer:
        `{"nodes", "at", "met"}`, `at` the wall time of the read that saw it."""
        ready = self.root / f"watch-{time.monotonic_ns()}"
        watch_s = timeout_s * deadline_scale()
        args = ["nodes", "--data-dir", str(self.root / "head"), "--timeout", str(watch_s), "--ready-file", str(ready)]
        args += ["--until-present", ",".join(present), "--until-absent", ",".join(absent)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            run_s = watch_s + 60  # its own start, and the watch
            answer = pool.submit(self.last_json, "head", "-m", "coderai.testing.probe", *args, timeout_s=run_s)
            wait_until(lambda: ready.exists() or answer.done(), 60, "the nodes probe watching")

            def result() -> dict:
                got = answer.result(run_s + 10)
                assert isinstance(got, dict), got
                return got

            yield result

    def chat(self, model: str) -> dict:
        answer = self.probe("chat", "--base-url", "http://127.0.0.1:8000/v1", "--key", self.key, "--model", model)
        assert isinstance(answer, dict), answer
        return answer


@contextlib.contextmanager
def head_of(c: LabCluster, models: Path, token: str) -> Iterator[ServiceProcess]:
    """`coderai up` as the head on the lab's `head` machine, ready and its admin key read; on exit every process
    of `c` is stopped, the head (its whole stack, NATS and Redis included) last."""
    up = head_up(c.lab["head"], c.root, models, token, c.env)
    c.procs["up"] = up
    try:
        up.start()
        up.wait_log("\nready", 120)
        c.key = (c.root / "head" / "admin.key").read_text().strip()
        yield up
    finally:
        for p in reversed(list(c.procs.values())):
            p.stop(timeout_s=60 if p is up else 15)
