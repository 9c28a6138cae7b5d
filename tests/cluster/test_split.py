"""One GGUF split over two machines (network namespaces): the head's llama-server serves it with its CPU plus
node-b's llama.cpp rpc-server, which runs only while the split is placed there. Answers at temperature 0 equal the whole model's on one machine; killing node-b makes the model
answer 503 within 10 s, and the scheduler re-places it on the head alone, where it serves again; once node-b is
back, the model is split over it again."""

from __future__ import annotations

import json
import sys

import pytest

from coderai.runtime.cluster import new_token
from coderai.testing.netns import Lab, NetnsUnavailable
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.stack import clean_env, head_up, node_up, write_models_file

pytestmark = pytest.mark.slow

TOKEN = new_token()
PROMPTS = ["tell me a story about", "the quick brown fox"]


@pytest.fixture(scope="module")
def layered_gguf(tmp_path_factory):
    from coderai.tiny_models.llm import build_tiny_gguf

    path = tmp_path_factory.mktemp("split-model") / "layered.gguf"
    build_tiny_gguf(path, dim=128, layers=4, heads=4)
    return path


def test_a_model_split_over_an_rpc_node_answers_like_one_machine_and_survives_its_death(tmp_path, layered_gguf):
    try:
        lab = Lab(["head", "node-b"])
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    procs: list[ServiceProcess] = []
    try:  # the lab is closed (every process in it killed) whatever fails, set-up included
        root = tmp_path
        params = {"n_ctx": 512, "n_threads": 1, "parallel": 2}
        models = write_models_file(
            root / "models.toml",
            [
                {
                    "name": "whole",
                    "engine": "llama-server",
                    "path": str(layered_gguf),
                    "params": params,
                    "nodes": ["head"],
                },
                {
                    "name": "split",
                    "engine": "llama-server",
                    "path": str(layered_gguf),
                    "params": params,
                    "nodes": ["head"],
                    "replicas": 1,
                    "rpc_nodes": ["node-b"],
                },
            ],
        )
        env = clean_env()
        head, nb = lab["head"], lab["node-b"]
        up = head_up(head, root, models, TOKEN, env)
        procs.append(up.start())
        up.wait_log("\nready", 120)
        key = (root / "head" / "admin.key").read_text().strip()
        node = node_up(
            nb, "node-b", head.ip, root, TOKEN, env, "--rpc", "--rpc-port", "50052", "--families", "llama-server"
        )
        procs.append(node.start())

        def chat(model: str, prompt: str = PROMPTS[0]) -> dict:
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
                    model,
                    "--prompt",
                    prompt,
                    "--max-tokens",
                    "12",
                    "--temperature",
                    "0",
                ],
                env=env,
                timeout_s=60,
            )
            assert r.returncode == 0, r.stderr[-2000:]
            return json.loads(r.stdout.strip().splitlines()[-1])

        def admin(path: str) -> dict:
            r = lab.run(
                "head",
                [
                    sys.executable,
                    "-c",
                    (
                        "import sys, urllib.request; r = urllib.request.urlopen(urllib.request.Request("
                        f"'http://127.0.0.1:8000{path}', headers={{'Authorization': 'Bearer {key}'}}), timeout=10); "
                        "sys.stdout.write(r.read().decode())"
                    ),
                ],
                env=env,
                timeout_s=30,
            )
            assert r.returncode == 0, r.stderr[-2000:]
            return json.loads(r.stdout)

        def head_worker_log() -> str:
            path = root / "head" / "logs" / "worker.log"
            return path.read_text() if path.exists() else ""

        def split_engine_up() -> bool:
            return chat("split")["status"] == 200 and "split over" in head_worker_log()

        wait_until(split_engine_up, 120, "the split model to be served over node-b's RPC server")
        for prompt in PROMPTS:
            whole, split = chat("whole", prompt), chat("split", prompt)
            assert split["status"] == 200 and split["engine"].startswith("head-")
            assert split["content"] == whole["content"] and whole["content"]

        splits = admin("/admin/splits")["data"]
        assert [s["model"] for s in splits] == ["split"]
        devices = splits[0]["devices"]
        assert [d["node_id"] for d in devices] == ["head", "node-b"]
        assert devices[1]["endpoint"] == f"{nb.ip}:50052" and devices[0]["endpoint"] == ""
        assert sorted(devices[0]["layers"] + devices[1]["layers"]) == [0, 1, 2, 3] and devices[1]["layers"]
        assert "RPC gate" in node.log_text() and head.ip in node.log_text()  # only the head is admitted
        assert "RPC server started for a split" in node.log_text()  # started once the split was placed
        assert f"link to node-b ({nb.ip}:50052) measured at" in head_worker_log()  # the short probe through the gate

        node.kill()

        def clear_503() -> bool:  # a 503 that says why: the engine that took the job answers it with its error (the
            r = chat("split")  # router, asked again, names a failed engine by fault reference only)
            return r["status"] == 503 and (
                "unreachable" in r["body"] and "node-b" in r["body"] or "fault " in r["body"]
            )

        wait_until(clear_503, 10, "the split model to answer a clear 503 once node-b is gone")
        wait_until(lambda: chat("split")["status"] == 200, 90, "the split model to be re-placed on the head alone")
        again = chat("split", PROMPTS[1])
        assert again["content"] == chat("whole", PROMPTS[1])["content"]
        assert admin("/admin/splits")["data"] == []

        procs.append(
            node_up(
                nb, "node-b", head.ip, root, TOKEN, env, "--rpc", "--rpc-port", "50052", "--families", "llama-server"
            ).start()
        )  # node-b is back: the pinned split comes back too

        def split_again() -> bool:  # a second split loaded (the log says so), and it answers
            return head_worker_log().count('"msg": "split split over') >= 2 and chat("split")["status"] == 200

        wait_until(split_again, 90, "the model to be split over node-b again")
        assert chat("split", PROMPTS[0])["content"] == chat("whole", PROMPTS[0])["content"]
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=60 if p is procs[0] else 15)
        lab.close()
