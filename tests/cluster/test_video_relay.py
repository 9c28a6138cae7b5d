"""One video relayed over three machines in network namespaces: encode, denoise and decode each on its own node,
the tensors between them through the head's object store. The frames equal a single-node run with the same seed;
a denoise node killed mid-stage costs only its own stage, run again elsewhere from the last stored handoff."""

from __future__ import annotations

import json
import re
import sys

import pytest
from coderai.runtime.cluster import new_token
from coderai.testing.netns import Lab, NetnsUnavailable
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.stack import clean_env, head_up, write_models_file

pytest.importorskip("diffusers")
av = pytest.importorskip("av")
np = pytest.importorskip("numpy")

pytestmark = pytest.mark.slow

TOKEN = new_token()
WORKERS = ("n1", "n2", "n3")
TOLERANCE = 2  # max difference of any decoded pixel value (0..255); measured 0 (the MP4s are byte-identical)


class Cluster:
    def __init__(self, lab: Lab, root, env: dict[str, str]) -> None:
        self.lab, self.root, self.env = lab, root, env
        self.procs: dict[str, ServiceProcess] = {}
        self.key = ""

    def start_worker(self, host: str) -> ServiceProcess:
        args = [
            "--cluster-token",
            TOKEN,
            "--nats-url",
            f"nats://{self.lab['head'].ip}:4222",
            "--no-mdns",
            "--node-id",
            host,
            "--data-dir",
            str(self.root / host),
        ]
        p = ServiceProcess(
            f"worker-{host}",
            "coderai.engine_worker",
            args,
            self.env,
            self.root / "logs",
            prefix=self.lab[host].prefix(),
        ).start()
        self.procs[host] = p
        return p

    def probe(self, *args: str) -> dict:
        r = self.lab.run(
            "head",
            [
                sys.executable,
                "-m",
                "coderai.testing.video_probe",
                *args,
                "--base-url",
                "http://127.0.0.1:8000/v1",
                "--key",
                self.key,
            ],
            env=self.env,
            timeout_s=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    def video(self, model: str, **body) -> dict:
        made = self.probe(
            "create",
            "--body",
            json.dumps(
                {"model": model, "prompt": "a cat on a red sofa", "size": "64x64", "num_frames": 4, "fps": 4, **body}
            ),
        )
        assert made["http_status"] == 200, made
        return made

    def frames(self, video_id: str) -> np.ndarray:
        out = self.root / f"{video_id}.mp4"
        assert self.probe("content", "--id", video_id, "--out", str(out))["status"] == 200
        with av.open(str(out)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(int)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from coderai.tiny_models.diffusion import ensure_tiny_t2v

    try:
        lab = Lab(["head", *WORKERS])
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with lab:  # closed (every process in it killed) whatever happened, after the graceful stops below
        root = tmp_path_factory.mktemp("relay")
        path = str(ensure_tiny_t2v())
        models = write_models_file(
            root / "models.toml",
            [
                {
                    "name": "echo",
                    "engine": "echo",
                    "path": "builtin",
                    "nodes": ["head"],
                },  # what `up` asks to call it ready
                # the same weights three ways: whole on the head (the reference), relayed in 3 stages, and in 4 (the
                # denoise cut in two, so a death in its second half goes on from the first half's handoff)
                {
                    "name": "t2v-one",
                    "engine": "video",
                    "path": path,
                    "params": {"threads": 1, "steps": 4},
                    "nodes": ["head"],
                },
                {
                    "name": "t2v-relay",
                    "engine": "video",
                    "path": path,
                    "params": {"threads": 1, "steps": 4, "stages": True},
                    "nodes": list(WORKERS),
                },
                {
                    "name": "t2v-relay2",
                    "engine": "video",
                    "path": path,
                    "params": {"threads": 1, "steps": 4, "stages": 2},
                    "nodes": list(WORKERS),
                },
            ],
        )
        c = Cluster(lab, root, clean_env(CODERAI_WORKER_FAMILIES="echo,video"))
        up = head_up(lab["head"], root, models, TOKEN, c.env)
        c.procs["up"] = up
        try:
            up.start()
            up.wait_log("\nready", 180)
            for w in WORKERS:
                c.start_worker(w)
            c.key = (root / "head" / "admin.key").read_text().strip()
            want = {"head": ["echo", "t2v-one"], **{w: ["t2v-relay", "t2v-relay2"] for w in WORKERS}}
            wait_until(lambda: c.probe("engines") == want, 180, "every engine ready", interval_s=1)
            yield c
        finally:
            for p in reversed(list(c.procs.values())):
                p.stop(timeout_s=60 if p is up else 15)


def test_encode_denoise_decode_on_three_nodes_equal_the_single_node_frames(cluster):
    relayed = cluster.video("t2v-relay", seed=7)
    single = cluster.video("t2v-one", seed=7)
    rec = cluster.probe("wait", "--id", relayed["id"])
    one = cluster.probe("wait", "--id", single["id"])
    assert rec["status"] == one["status"] == "completed", (rec, one)
    stages = [(s["kind"], s["start"], s["end"]) for s in rec["stages"]]
    assert stages == [("encode", 0, 0), ("denoise", 0, 4), ("decode", 4, 4)]
    assert len({s["node"] for s in rec["stages"]}) == 3 and {s["node"] for s in rec["stages"]} <= set(WORKERS)
    assert rec["progress"] == 100 and rec["stage"] == "decode" and rec["node"] == rec["stages"][-1]["node"]
    a, b = cluster.frames(relayed["id"]), cluster.frames(single["id"])
    assert a.shape == b.shape == (4, 64, 64, 3)
    assert np.abs(a - b).max() <= TOLERANCE


def test_a_denoise_node_killed_mid_stage_is_replaced_from_the_stored_handoff(cluster):
    single = cluster.video("t2v-one", seed=11, steps=16)
    made = cluster.video("t2v-relay2", seed=11, steps=16)
    job = made["id"].removeprefix("video_")
    # the second half of the denoise (steps 8..16) logs each step; kill its node right after its first step,
    # with seven steps still to go
    needle = re.compile(rf"stage denoise 8\.\.16 of {job}: step 9/16 done")
    victim = wait_until(
        lambda: next((w for w in WORKERS if needle.search(cluster.procs[w].log_text())), None),
        240,
        "the second denoise stage to make a step",
        interval_s=0.02,
    )
    cluster.procs[victim].kill()
    mid = cluster.probe("get", "--id", made["id"])  # the gateway waits out its idle timeout before it re-plans
    assert mid["stage"] == "denoise" and mid["node"] == victim and mid["status"] == "in_progress"
    rec = cluster.probe("wait", "--id", made["id"])
    assert rec["status"] == "completed", rec
    runs = [(s["kind"], s["start"], s["end"]) for s in rec["stages"]]
    # nothing ran twice: encode and the first denoise half once, the killed half once more, elsewhere
    assert runs == [("encode", 0, 0), ("denoise", 0, 8), ("denoise", 8, 16), ("decode", 16, 16)]
    assert rec["stages"][2]["node"] != victim and victim not in {s["node"] for s in rec["stages"]}
    done = cluster.probe("wait", "--id", single["id"])
    assert done["status"] == "completed"
    assert np.abs(cluster.frames(made["id"]) - cluster.frames(single["id"])).max() <= TOLERANCE
