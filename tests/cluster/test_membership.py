"""Three machines in network namespaces on one bridge: a head (`coderai up --cluster-token`) and two nodes that
join with nothing but the token (mDNS bound only to the namespaces' own addresses). A stranger with another
token joins nothing. A killed node leaves and its roaming model moves; a restarted node serves again."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from coderai.runtime.cluster import new_token
from coderai.testing.lab_cluster import LabCluster, head_of
from coderai.testing.netns import Lab, NetnsUnavailable
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.stack import clean_env, write_models_file

pytestmark = pytest.mark.slow

TOKEN = "correct horse battery staple"


class Cluster(LabCluster):
    def start_node(self, host: str, token: str = TOKEN, *extra: str) -> ServiceProcess:
        h = self.lab[host]
        args = [
            "--cluster-token",
            token,
            "--mdns-interface",
            h.ip,
            "--node-id",
            host,
            "--data-dir",
            str(self.root / host),
            *extra,
        ]
        env = {**self.env, "CODERAI_WORKER_DISCOVER_TIMEOUT_S": "3"}
        p = ServiceProcess(
            f"worker-{host}", "coderai.engine_worker", args, env, self.root / "logs", prefix=h.prefix()
        ).start()
        self.procs[host] = p
        return p


def loaded_at(node: ServiceProcess, model: str, after: float) -> float | None:
    """When the node logged that it loaded `model` (its JSON line's `ts`), at or after wall time `after`."""
    for line in node.log_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            record = json.loads(line)
            if record["ts"] >= after and record["msg"].startswith(f"loaded {model} as "):
                return record["ts"]
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_gguf):
    try:
        lab = Lab(["head", "n1", "n2", "rogue"])
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with lab:  # closed (every process in it killed) whatever happened, after the graceful stops below
        root = tmp_path_factory.mktemp("cluster")
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
                    "name": "n1-tiny",
                    "engine": "llama",
                    "path": str(tiny_gguf),
                    "params": {"n_ctx": 512},
                    "nodes": ["n1"],
                },
                {
                    "name": "n2-tiny",
                    "engine": "llama",
                    "path": str(tiny_gguf),
                    "params": {"n_ctx": 512},
                    "nodes": ["n2"],
                },
                {
                    "name": "roamer",
                    "engine": "llama",
                    "path": str(tiny_gguf),
                    "params": {"n_ctx": 512},
                    "nodes": ["n1", "n2"],
                    "replicas": 1,
                },
            ],
        )
        c = Cluster(lab, root, clean_env())
        with head_of(c, models, TOKEN):  # on exit, up stops its whole stack, NATS and Redis included
            yield c


def test_nodes_join_with_only_the_token_within_10s(cluster):
    # the times are the cluster's, read on the head every 0.1 s by one probe started first: a probe started per
    # poll adds its own start, seconds on a loaded machine, which is not what a node's join costs
    with cluster.watching_nodes(present=("head", "n1", "n2"), timeout_s=10) as seen:
        t0 = time.time()
        cluster.start_node("n1")
        cluster.start_node("n2")
        both = seen()
    assert both["met"], f"both nodes in coderai_nodes: {both}"
    assert both["at"] - t0 <= 10.5, both["at"] - t0
    assert "found head head at nats://" in cluster.procs["n1"].log_text()


def test_a_model_that_lives_only_on_a_node_answers_through_the_head(cluster):
    wait_until(lambda: cluster.chat("n1-tiny")["status"] == 200, 30, "n1-tiny served")
    r = cluster.chat("n1-tiny")
    assert r["status"] == 200 and r["engine"].startswith("n1-")
    r = cluster.chat("n2-tiny")
    assert r["status"] == 200 and r["engine"].startswith("n2-")


def test_a_wrong_token_joins_nothing(cluster):
    rogue = cluster.start_node("rogue", new_token())
    rogue.wait_log("no head with this cluster token's fingerprint", 30)  # it saw the head's record and passed
    # even told where NATS is, a wrong token is refused by NATS itself
    direct = ServiceProcess(
        "rogue-direct",
        "coderai.engine_worker",
        [
            "--cluster-token",
            new_token(),
            "--nats-url",
            f"nats://{cluster.lab['head'].ip}:4222",
            "--node-id",
            "rogue2",
            "--no-mdns",
            "--data-dir",
            str(cluster.root / "rogue2"),
        ],
        cluster.env,
        cluster.root / "logs",
        prefix=cluster.lab["rogue"].prefix(),
    ).start()
    cluster.procs["rogue-direct"] = direct
    wait_until(
        lambda: "Authorization Violation" in direct.log_text() or not direct.alive(),
        30,
        "NATS to refuse the wrong token",
    )
    nodes = cluster.nodes()
    assert "rogue" not in nodes and "rogue2" not in nodes


def test_a_killed_node_leaves_within_10s_and_its_roaming_model_moves(cluster):
    wait_until(lambda: cluster.chat("roamer")["status"] == 200, 30, "roamer served")
    holder = cluster.chat("roamer")["engine"].split("-")[0]
    other = "n2" if holder == "n1" else "n1"
    with cluster.watching_nodes(absent=(holder,), timeout_s=12) as seen:
        t0 = time.time()
        cluster.procs[holder].kill()
        gone = seen()
    assert gone["met"], f"{holder} to leave coderai_nodes: {gone}"
    assert gone["at"] - t0 <= 10.5, gone["at"] - t0
    wait_until(lambda: cluster.chat("roamer")["engine"].startswith(f"{other}-"), 30, f"roamer to move to {other}")

    # the dead node comes back: it reloads its own assignment from its key, with no push, within 10 s
    t1 = time.time()
    back = cluster.start_node(holder)
    wait_until(lambda: cluster.chat(f"{holder}-tiny")["status"] == 200, 10, f"{holder} to serve again")
    loaded = loaded_at(back, f"{holder}-tiny", t1)  # the node's own time for it, not the probes'
    assert loaded is not None and loaded - t1 <= 10.5, (t1, loaded)
    assert cluster.chat("roamer")["engine"].startswith(f"{other}-")  # the moved copy stays where it went
