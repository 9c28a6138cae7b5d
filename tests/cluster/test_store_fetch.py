"""A model pulled once into the head's store reaches a node in another network namespace over the bus: the node
lacks the head's path, fetches the file (`coderai.cmd.store.fetch`, node credentials) into its own data dir,
checks its sha256 and serves it through the head's gateway. The node also runs in its own mount namespace with an
empty tmpfs over the head's data dir, so the head's files are really out of its reach."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys

import pytest
from coderai.runtime.cluster import new_token
from coderai.testing.netns import Lab, NetnsUnavailable
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.stack import clean_env, head_up, node_up, write_models_file

pytestmark = pytest.mark.slow

TOKEN = new_token()
STORE_PATH = "test/tiny/tiny.gguf"


def _without(folder) -> list[str]:
    """A command prefix that hides `folder` (an empty tmpfs over it) from what it runs; execs, so the pid stays."""
    if not shutil.which("unshare"):
        pytest.skip("needs unshare (util-linux)")
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        'mount -t tmpfs tmpfs "$1" && shift && exec "$@"',
        "sh",
        str(folder),
    ]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_node_fetches_a_pulled_model_from_the_head_and_serves_it(tmp_path, tiny_gguf):
    try:
        lab = Lab(["head", "node-b"])
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    procs: list[ServiceProcess] = []
    try:  # the lab is closed (every process in it killed) whatever fails, set-up included
        root = tmp_path
        pulled = root / "head" / "models" / STORE_PATH  # what `coderai models pull` leaves in the head's store
        pulled.parent.mkdir(parents=True)
        shutil.copyfile(tiny_gguf, pulled)
        models = write_models_file(
            root / "models.toml",
            [
                {
                    "name": "head-tiny",
                    "engine": "llama",
                    "path": str(tiny_gguf),
                    "params": {"n_ctx": 512},
                    "nodes": ["head"],
                },
                {
                    "name": "fetched",
                    "engine": "llama",
                    "path": str(pulled),
                    "store_path": STORE_PATH,
                    "params": {"n_ctx": 512},
                    "nodes": ["node-b"],
                },
            ],
        )
        env = clean_env()
        head, nb = lab["head"], lab["node-b"]
        up = head_up(head, root, models, TOKEN, env)
        procs.append(up.start())
        up.wait_log("\nready", 120)
        key = (root / "head" / "admin.key").read_text().strip()
        node = node_up(nb, "node-b", head.ip, root, TOKEN, env, wrap=_without(root / "head"))
        procs.append(node.start())

        def chat() -> dict:
            r = lab.run(
                "head",
                [
                    sys.executable,
                    "-m",
                    "coderai.testing.probe",
                    "chat",
                    "--base-url",
                    "http://127.0.0.1:8000/v1",
                    "--key",
                    key,
                    "--model",
                    "fetched",
                ],
                env=env,
                timeout_s=60,
            )
            assert r.returncode == 0, r.stderr[-2000:]
            return json.loads(r.stdout.strip().splitlines()[-1])

        wait_until(lambda: chat()["status"] == 200, 90, "the fetched model to be served by node-b")
        r = chat()
        assert r["status"] == 200 and r["engine"].startswith("node-b-")
        fetched = root / "node-b" / "models" / STORE_PATH
        assert fetched.is_file() and _sha(fetched) == _sha(pulled)
        assert not list(fetched.parent.glob("*.partial"))
        assert "fetched test/tiny/tiny.gguf" in node.log_text()
        assert (
            not (root / "head" / "logs" / "worker.log").exists()
            or "fetching" not in (root / "head" / "logs" / "worker.log").read_text()
        )  # the head had it: no fetch there
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=60 if p is procs[0] else 15)
        lab.close()
