"""A node's identity is held, not claimed: on a real cluster (machines in network namespaces, a head with
`coderai up --cluster-token`, a good node that joined), a token holder joining again under a member's id (the
good node's, the head's own worker's) is refused with a clear error; the member keeps its credential, stays
connected and serves. A node that restarts with its own saved credential still gets back in, and an operator
re-admits an id with `coderai nodes revoke ID --forget`."""

from __future__ import annotations

import json

import pytest

from coderai.runtime import members
from coderai.runtime.cluster import new_token
from coderai.testing.netns import Lab, NetnsUnavailable
from coderai.testing.procs import wait_until
from coderai.testing.lab_cluster import LabCluster, head_of
from coderai.testing.stack import clean_env, node_up, write_models_file

pytestmark = pytest.mark.slow

TOKEN = new_token()


class Cluster(LabCluster):
    probe_timeout_s = 120.0

    def stored_hash(self, node_id: str) -> str:
        return members.load(self.root / "head" / "nats" / "members.json").members[node_id].password_hash

    def claim(self, victim: str, data_dir: str) -> dict:
        """The evil machine joins under `victim`'s id with the token and a data dir of its own."""
        report = self.last_json(
            "evil",
            "-m",
            "coderai.testing.hostile",
            "--nats-url",
            f"nats://{self.lab['head'].ip}:4222",
            "--token",
            TOKEN,
            "--claim",
            victim,
            "--data-dir",
            str(self.root / data_dir),
        )
        r = report["results"][0]
        print(f"{'refused' if r['refused'] else 'SUCCEEDED'}: {r['attack']} ({r['detail']})")
        return r


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_gguf):
    try:
        lab = Lab(["head", "good", "evil"])
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with lab:  # closed (every process in it killed) whatever happened, after the graceful stops below
        root = tmp_path_factory.mktemp("identity")
        models = write_models_file(
            root / "models.toml",
            [
                {
                    "name": "head-tiny",
                    "engine": "llama",
                    "path": str(tiny_gguf),
                    "params": {"n_ctx": 256},
                    "nodes": ["head"],
                },
                {
                    "name": "good-tiny",
                    "engine": "llama",
                    "path": str(tiny_gguf),
                    "params": {"n_ctx": 256},
                    "nodes": ["good"],
                },
            ],
        )
        c = Cluster(lab, root, clean_env())
        with head_of(c, models, TOKEN):
            c.procs["good"] = node_up(lab["good"], "good", lab["head"].ip, root, TOKEN, c.env).start()
            wait_until(lambda: c.chat("good-tiny")["status"] == 200, 90, "the good node to join and serve")
            yield c


def test_a_token_holder_cannot_join_under_a_members_id(cluster):
    good = cluster.procs["good"]
    seen = len(good.log_text())  # its own join's connection closing says "disconnected" too: only what follows counts
    for victim, model in (("good", "good-tiny"), ("head", "head-tiny")):  # a joined node, and the head's own worker
        before = cluster.stored_hash(victim)
        r = cluster.claim(victim, f"claim-{victim}")
        assert r["refused"], r["detail"]
        assert f"{victim} is already a member" in r["detail"] and "--forget" in r["detail"]
        assert cluster.stored_hash(victim) == before, "the member's credential is unchanged"
        assert "user" not in json.loads((cluster.root / f"claim-{victim}" / "node-credentials.json").read_text())
        assert victim in cluster.nodes()
        answer = cluster.chat(model)
        assert answer["status"] == 200 and answer["engine"].startswith(f"{victim}-"), answer
    assert good.alive()
    log = good.log_text()[seen:]
    assert "disconnected from NATS" not in log and "joining again" not in log and "Authorization Violation" not in log


def test_a_node_restarting_with_its_saved_credential_gets_back_in(cluster):
    good = cluster.procs.pop("good")
    good.stop(timeout_s=15)
    before = cluster.stored_hash("good")
    # the same data dir: it logs in with what it saved
    again = node_up(cluster.lab["good"], "good", cluster.lab["head"].ip, cluster.root, TOKEN, cluster.env).start()
    cluster.procs["good"] = again
    wait_until(lambda: cluster.chat("good-tiny")["status"] == 200, 60, "the restarted node to serve")
    assert "joined the cluster" not in again.log_text()[again.log_offset :] and cluster.stored_hash("good") == before
    again.stop(timeout_s=15)
    # saved for another address of the head: it joins again, proving the credential it holds, and gets in
    creds = cluster.root / "good" / "node-credentials.json"
    saved = json.loads(creds.read_text())
    saved["head"] = "nats://head.invalid:4222"
    creds.write_text(json.dumps(saved))
    moved = node_up(cluster.lab["good"], "good", cluster.lab["head"].ip, cluster.root, TOKEN, cluster.env).start()
    cluster.procs["good"] = moved
    wait_until(lambda: cluster.chat("good-tiny")["status"] == 200, 60, "the node to rejoin with its proof and serve")
    assert "joined the cluster" in moved.log_text()[moved.log_offset :] and cluster.stored_hash("good") != before


def test_an_operator_re_admits_an_id_with_revoke_forget(cluster):
    out = cluster.run(
        "head", "-m", "coderai.cli", "nodes", "--data-dir", str(cluster.root / "head"), "revoke", "good", "--forget"
    )
    assert '"node_id": "good"' not in out
    cluster.procs.pop("good").stop(timeout_s=15)
    # the machine lost its data dir (a reinstall): with the member record gone, its id joins afresh
    fresh = node_up(
        cluster.lab["good"], "good", cluster.lab["head"].ip, cluster.root / "reinstalled", TOKEN, cluster.env
    ).start()
    cluster.procs["good"] = fresh
    wait_until(lambda: cluster.chat("good-tiny")["status"] == 200, 90, "the re-admitted node to serve")
    assert "joined the cluster" in fresh.log_text()[fresh.log_offset :]
