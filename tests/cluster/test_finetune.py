"""Fine-tuning across two machines in network namespaces: a head (`coderai up`) and node-b train a LoRA on the
tiny random HF llama data-parallel (gloo over the namespaces' link), through the official openai SDK: bad files
are refused at upload naming the line, loss goes down, events stream the steps (with the validation loss at each
epoch's end: the job has a validation file), both ranks end with the same adapter, and `tiny:ft1-<job id>` answers a chat through the gateway. A second job loses its rank on node-b mid-training
(the trainer process is killed) and ends `failed`, naming node-b, within 30 s; nothing of it is registered. A
cancelled job stops on both nodes. A last one loses node-b's whole worker (the trainer dies with it): its reports
stop and the job fails naming node-b within 30 s."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

from coderai.contracts.training import TERMINAL
from coderai.models_file import load_models, write_models_file
from coderai.runtime.cluster import new_token
from coderai.testing.netns import Lab, NetnsUnavailable
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.tiny_hf_llama import tiny_hf_llama

pytestmark = pytest.mark.slow

TOKEN = new_token()
CLIENT = str(Path(__file__).with_name("finetune_client.py"))
EXAMPLES = [
    {
        "messages": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
        ]
    }
    for i in range(6)
]


def _gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True


def test_two_hosts_train_a_lora_and_serve_it_and_a_lost_rank_fails_the_job(tmp_path):
    try:
        lab = Lab(["head", "node-b"])
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    procs: list[ServiceProcess] = []
    try:  # the lab is closed (every process in it killed) whatever fails, set-up included
        root = tmp_path
        base = tiny_hf_llama()
        models = write_models_file(
            root / "models.toml",
            [
                {
                    "name": "tiny",
                    "engine": "transformers",
                    "path": str(base),
                    "params": {"max_tokens": 8},
                    "nodes": ["head"],
                },
            ],
        )
        data, valid = root / "train.jsonl", root / "valid.jsonl"
        data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES[:4]))
        valid.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES[4:]))
        env = {k: v for k, v in os.environ.items() if not k.startswith("CODERAI_")} | {
            "CODERAI_LOG_FORMAT": "json",
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        head, nb = lab["head"], lab["node-b"]

        def client(*args: str, as_key: str = "") -> dict | list:
            r = lab.run(
                "head",
                [sys.executable, CLIENT, "http://127.0.0.1:8000/v1", as_key or key, *args],
                env=env,
                timeout_s=120,
            )
            assert r.returncode == 0, r.stderr[-3000:]
            return json.loads(r.stdout.strip().splitlines()[-1])

        def job(job_id: str) -> dict:
            return client("get", job_id)

        up = ServiceProcess(
            "up",
            "coderai.cli",
            [
                "up",
                "--data-dir",
                str(root / "head"),
                "--port",
                "8000",
                "--cluster-token",
                TOKEN,
                "--mdns-interface",
                head.ip,
                "--node-id",
                "head",
                "--models-file",
                str(models),
            ],
            env,
            root / "logs",
            prefix=head.prefix(),
        )
        procs.append(up.start())
        node = ServiceProcess(
            "worker-node-b",
            "coderai.engine_worker",
            [
                "--cluster-token",
                TOKEN,
                "--nats-url",
                f"nats://{head.ip}:4222",
                "--no-mdns",
                "--node-id",
                "node-b",
                "--data-dir",
                str(root / "node-b"),
            ],
            env,
            root / "logs",
            prefix=nb.prefix(),
        )
        procs.append(node.start())
        up.wait_log("\nready", 180)
        key = (root / "head" / "admin.key").read_text().strip()

        bad = client("bad")  # refused at upload, naming the line
        assert bad["not_jsonl"]["status"] == 400 and "line 2" in bad["not_jsonl"]["message"]
        assert bad["wrong_role"]["status"] == 400 and "line 3" in bad["wrong_role"]["message"]
        assert "wizard" in bad["wrong_role"]["message"] and bad["wrong_role"]["param"] == "file"
        assert bad["empty"]["status"] == 400 and "empty" in bad["empty"]["message"]
        assert bad["unknown_job"]["status"] == 404
        assert bad["unknown_file"]["status"] == 400 and bad["unknown_file"]["param"] == "training_file"
        assert bad["unknown_model"]["status"] == 400 and bad["unknown_model"]["param"] == "model"

        up_file = client("upload", str(data))
        assert up_file["object"] == "file" and up_file["purpose"] == "fine-tune" and up_file["id"].startswith("file-")
        file_id = up_file["id"]
        valid_id = client("upload", str(valid))["id"]
        no_valid = client("create", file_id, "v", "1", "lora", "file-nope")
        assert no_valid["status"] == 400 and no_valid["param"] == "validation_file", no_valid

        def start(
            suffix: str, epochs: str, *valid_file: str, training: str = "", as_key: str = "", method: str = "lora"
        ) -> str:
            created: dict = {}

            def accepted() -> bool:  # node-b may not have joined yet: two nodes are asked for
                created.update(
                    client("create", training or file_id, suffix, epochs, method, *valid_file, as_key=as_key)
                )
                assert created["status"] in (200, 400), created
                return created["status"] == 200

            wait_until(accepted, 90, f"job {suffix} on two nodes to be accepted", interval_s=1)
            return created["id"]

        def finished(jid: str, timeout_s: float, what: str) -> dict:
            """The job and its events once it has ended (succeeded, failed or cancelled)."""
            wait_until(lambda: job(jid)["job"]["status"] in TERMINAL, timeout_s, what, interval_s=1)
            return job(jid)

        job_id = start("ft1", "3", valid_id)
        got = finished(job_id, 180, "the fine-tuning job to end")
        j, events = got["job"], got["events"]
        assert j["status"] == "succeeded", (j, [e["message"] for e in events], node.log_text()[-3000:])
        ft1 = j["fine_tuned_model"]  # the suffix and the job's own id: no other key's choice of suffix meets it
        assert ft1 == f"tiny:ft1-{job_id.removeprefix('ftjob-')[:8]}" and j["object"] == "fine_tuning.job"
        assert job_id in got["listed"]
        assert j["coderai"]["nodes"] == ["head", "node-b"] and j["trained_tokens"] > 0
        steps = sorted((e for e in events if e["type"] == "metrics"), key=lambda e: e["data"]["step"])
        assert [e["data"]["step"] for e in steps] == list(range(1, 7))  # 4 examples / 2 ranks x 3 epochs
        assert all(e["object"] == "fine_tuning.job.event" and e["data"]["tokens_per_s"] > 0 for e in steps)
        assert steps[-1]["data"]["train_loss"] < steps[0]["data"]["train_loss"]
        checked = [(e["data"]["step"], e["data"]["valid_loss"]) for e in steps if "valid_loss" in e["data"]]
        assert [s for s, _ in checked] == [2, 4, 6], checked  # each epoch's end, the last one the end of training
        assert checked[-1][1] < checked[0][1] and j["coderai"]["valid_loss"] == checked[-1][1]
        assert j["validation_file"] == valid_id and f"fetched finetune/{job_id}/valid.jsonl" in node.log_text()
        # the tenant's data was for the ranks alone: gone from node-b and from the head's store once the job ended
        # (the adapter stays: it is the model), and what is left of the job is the owner's alone (0700/0600)
        staged = root / "head" / "models" / "finetune" / job_id
        for where in (root / "node-b" / "models" / "finetune" / job_id, staged):
            assert not (where / "train.jsonl").exists() and not (where / "valid.jsonl").exists(), list(where.iterdir())
        assert (staged.stat().st_mode & 0o777, (staged / "adapter.tar").stat().st_mode & 0o777) == (0o700, 0o600)
        assert any("rendezvous at " + head.ip in e["message"] for e in events)

        import torch
        from safetensors.torch import load_file

        a = load_file(root / "head" / "finetune" / job_id / "adapter" / "adapter_model.safetensors")
        b = load_file(root / "node-b" / "finetune" / job_id / "adapter" / "adapter_model.safetensors")
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a)
        assert (root / "head" / "models" / "finetune" / job_id / "adapter.tar").is_file()
        kept = {m.name: m for m in load_models(str(models))}  # appended: still served after a restart
        assert kept[ft1].params["base"] == str(base) and kept[ft1].engine == "transformers"

        chat: dict = {}
        wait_until(
            lambda: chat.update(client("chat", ft1)) or chat["status"] == 200,
            90,
            f"{ft1} to answer through the gateway",
            interval_s=1,
        )
        assert chat["model"] == ft1 and isinstance(chat["content"], str)

        # the fine-tuned model is the key's that trained it: another key neither lists, uses nor deletes it
        tenant = client("newkey", "tenant-b")["key"]
        assert "tiny" in client("models", as_key=tenant) and ft1 not in client("models", as_key=tenant)
        for cmd in ("chat", "delete"):
            seen = client(cmd, ft1, as_key=tenant)
            print(f"tenant-b tried to {cmd} another key's fine-tuned model: {seen}")
            assert seen["status"] == 404, seen
        assert client("delete", "tiny", as_key=tenant)["status"] == 403  # nor may it delete the operator's model

        # QLoRA runs for real on these CPUs: bitsandbytes (0.47 on) quantizes the base to 4 bits and computes there
        q = finished(start("q", "1", method="qlora"), 240, "the QLoRA job to end")
        assert q["job"]["status"] == "succeeded", (q["job"], [e["message"] for e in q["events"]])
        assert q["job"]["coderai"]["method"] == "qlora" and q["job"]["trained_tokens"] > 0

        # a rank killed mid-job: the job fails naming its node, and nothing is registered. The jobs stopped on
        # purpose train on 100 examples (5,000 steps at 100 epochs): 4 examples trained to the end in 15 s on a
        # loaded machine, before the test had seen the first step
        long_data = root / "long.jsonl"
        long_data.write_text("".join(json.dumps(e) + "\n" for e in EXAMPLES[:4] * 25))
        long_file = client("upload", str(long_data))["id"]
        long_id = start("ft2", "100", training=long_file)
        wait_until(
            lambda: any(e["type"] == "metrics" for e in job(long_id)["events"]),
            120,
            "the second job's first step",
            interval_s=1,
        )
        pid = int(re.search(rf"training job {long_id}: rank 1 runs as pid (\d+)", node.log_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: job(long_id)["job"]["status"] == "failed", 30, "the job to fail after its rank died", interval_s=0.5
        )
        failed = job(long_id)["job"]
        assert failed["error"]["code"] == "rank_failed", failed["error"]
        assert failed["error"]["message"] == "rank 1 on node node-b failed: the trainer process was killed by SIGKILL"
        assert not any(m.startswith("tiny:ft2-") for m in client("models")) and ft1 in client("models")
        assert not (root / "head" / "models" / "finetune" / long_id / "adapter.tar").exists()

        # a cancelled job stops on both nodes
        stop_me = start("ftc", "100", training=long_file)
        wait_until(lambda: job(stop_me)["job"]["status"] == "running", 60, "the job's ranks to start", interval_s=0.5)
        assert client("cancel", stop_me)["status"] == "cancelled"
        stopped = f"stopping training job {stop_me}: cancelled"
        head_log = root / "head" / "logs" / "worker.log"
        wait_until(
            lambda: stopped in node.log_text() and stopped in head_log.read_text(),
            30,
            "both ranks of the cancelled job to stop",
        )
        assert job(stop_me)["job"]["status"] == "cancelled"

        # a key revoked while its job trains: the job is cancelled as its owner would, and stops on both nodes
        own_file = client("upload", str(long_data), as_key=tenant)["id"]
        doomed = start("ft1", "100", training=own_file, as_key=tenant)  # the suffix the operator's model has: taken
        assert doomed != job_id  # without a word that another key's model has it (a 400 "exists" was that word)
        wait_until(lambda: job(doomed)["job"]["status"] == "running", 60, "the tenant's job to run", interval_s=0.5)
        assert client("revoke", "tenant-b")["status"] == 200
        wait_until(
            lambda: job(doomed)["job"]["status"] == "cancelled",
            30,
            "the revoked key's job to be cancelled",
            interval_s=0.5,
        )
        stopped = f"stopping training job {doomed}: cancelled"
        wait_until(
            lambda: stopped in node.log_text() and stopped in head_log.read_text(),
            30,
            "both ranks of the revoked key's job to stop",
        )
        print(f"a key revoked while its fine-tuning job ran: the job ended {job(doomed)['job']['status']}")

        # node-b's worker dies mid-job (its trainer dies with it): its reports stop, the job fails naming node-b
        third = start("ft3", "100", training=long_file)
        ran = rf"training job {third}: rank 1 runs as pid (\d+)"
        wait_until(lambda: re.search(ran, node.log_text()), 60, "node-b's trainer to start")
        pid = int(re.search(ran, node.log_text()).group(1))
        os.kill(node.proc.pid, signal.SIGKILL)
        wait_until(lambda: _gone(pid), 10, "the orphaned trainer to die with its worker")
        wait_until(
            lambda: job(third)["job"]["status"] == "failed", 30, "the job to fail after its node died", interval_s=0.5
        )
        failed = job(third)["job"]["error"]
        assert failed["message"].startswith("rank 1 on node node-b stopped reporting"), failed

        # its owner deletes it (OpenAI's models.delete): no longer listed nor served
        gone = client("delete", ft1)
        assert gone["status"] == 200 and gone["deleted"] is True and gone["id"] == ft1, gone
        assert ft1 not in client("models")
    finally:
        for p in reversed(procs):
            p.stop(timeout_s=60 if p is procs[0] else 15)
        lab.close()
