"""A hostile node on a real cluster: machines in network namespaces, a head (`coderai up --cluster-token`), a
good node and an evil one that both join with the token. The evil node, with credentials of its own, tries
every attack of docs/security.md (coderai.testing.hostile) and each is refused. A fake head replaying the head's
announcement gets no credentials; a revoked node is cut off at once and may not join again."""

from __future__ import annotations

import json
import shutil

import pytest

from coderai.runtime.cluster import new_token
from coderai.testing.netns import Lab, NetnsUnavailable
from coderai.testing.procs import ServiceProcess, wait_until
from coderai.testing.lab_cluster import LabCluster, head_of
from coderai.testing.stack import clean_env, node_up, write_models_file

pytestmark = pytest.mark.slow

TOKEN = new_token()
GOOD_FILE = "org/good/tiny.gguf"  # in the head's store, a file of a model only the good node holds
JOB_FILE = "finetune/ftjob-x/train.jsonl"  # a fine-tuning job's data (no job: no node trains it)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_gguf):
    try:
        lab = Lab(["head", "good", "evil", "spy"])
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with lab:  # closed (every process in it killed) whatever happened, after the graceful stops below
        root = tmp_path_factory.mktemp("hostile")
        store = root / "head" / "models"  # the head's model store: a model of the good node's, a tenant's job data
        for rel in (GOOD_FILE, JOB_FILE):
            (store / rel).parent.mkdir(parents=True)
        shutil.copyfile(tiny_gguf, store / GOOD_FILE)
        (store / JOB_FILE).write_text('{"messages": [{"role": "user", "content": "a tenant\'s secret"}]}\n')
        models = write_models_file(
            root / "models.toml",
            [  # the first answers before `coderai up` says ready
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
                {
                    "name": "good-store",
                    "engine": "llama",
                    "path": str(store / GOOD_FILE),
                    "store_path": GOOD_FILE,
                    "params": {"n_ctx": 256},
                    "nodes": ["good"],
                },
            ],
        )
        c = LabCluster(lab, root, clean_env())
        with head_of(c, models, TOKEN):
            good = node_up(lab["good"], "good", lab["head"].ip, root, TOKEN, c.env).start()
            c.procs["good"] = good
            wait_until(lambda: "good" in c.nodes(), 60, "the good node to join")
            yield c


def test_every_attack_of_a_hostile_node_is_refused(cluster):
    out = cluster.run(
        "evil",
        "-m",
        "coderai.testing.hostile",
        "--nats-url",
        f"nats://{cluster.lab['head'].ip}:4222",
        "--token",
        TOKEN,
        "--node-id",
        "evil",
        "--victim",
        "good",
        "--data-dir",
        str(cluster.root / "evil"),
        "--store-file",
        GOOD_FILE,
        "--store-file",
        JOB_FILE,
        timeout_s=400,
    )
    report = json.loads(out.strip().splitlines()[-1])
    for r in report["results"]:
        print(f"{'refused' if r['refused'] else 'SUCCEEDED'}: {r['attack']} ({r['detail']})")
    print(f"hostile node: {report['tried']} attacks tried, {len(report['succeeded'])} succeeded")
    assert report["tried"] >= 40
    assert report["succeeded"] == []
    # and the good node is none the worse: it still serves through the head
    assert "good" in cluster.nodes()


def test_a_fake_head_replaying_the_announcement_gets_no_credentials(cluster):
    """The spy runs a NATS of its own (it takes any login) and announces the head's fingerprint, as a replay of
    the head's mDNS record would; a joining worker reaches it, the spy cannot answer the challenge without the
    token, and the worker gives up on it having sent nothing but the join user's password."""
    spy = cluster.lab["spy"]
    fake = ServiceProcess(
        "fake-head",
        "coderai.testing.fake_head",
        ["--host", spy.ip, "--port", "4222", "--record", str(cluster.root / "fake.json")],
        cluster.env,
        cluster.root / "logs",
        prefix=spy.prefix(),
    ).start()
    cluster.procs["fake-head"] = fake
    fake.wait_log("fake head up", 30)
    victim = ServiceProcess(
        "worker-victim",
        "coderai.engine_worker",
        [
            "--cluster-token",
            TOKEN,
            "--nats-url",
            f"nats://{spy.ip}:4222",
            "--no-mdns",
            "--node-id",
            "victim",
            "--data-dir",
            str(cluster.root / "victim"),
        ],
        cluster.env,
        cluster.root / "logs",
        prefix=cluster.lab["good"].prefix(),
    ).start()
    cluster.procs["victim"] = victim
    wait_until(
        lambda: not victim.alive() or "not our head" in victim.log_text(), 60, "the worker to refuse the fake head"
    )
    assert "not our head" in victim.log_text()
    seen = json.loads((cluster.root / "fake.json").read_text())
    assert seen["subjects"] == ["coderai.join.hello"], "the worker sent nothing after the unanswerable challenge"
    assert TOKEN not in json.dumps(seen)
    assert not (cluster.root / "victim" / "node-credentials.json").exists()

    # a node that joined the real head and pinned its CA, sent to the impostor at what it believes is the head's
    # address: the TLS handshake fails before any login, and a fresh join gets nowhere either
    pinned = cluster.root / "pinned"
    pinned.mkdir()
    saved = json.loads((cluster.root / "good" / "node-credentials.json").read_text())
    assert saved["ca_pem"] and saved["tls_fingerprint"]
    saved["head"] = f"nats://{spy.ip}:4222"
    (pinned / "node-credentials.json").write_text(json.dumps(saved))
    (pinned / "node-credentials.json").chmod(0o600)
    fooled = ServiceProcess(
        "worker-pinned",
        "coderai.engine_worker",
        [
            "--cluster-token",
            TOKEN,
            "--nats-url",
            f"nats://{spy.ip}:4222",
            "--no-mdns",
            "--node-id",
            "good",
            "--data-dir",
            str(pinned),
        ],
        cluster.env,
        cluster.root / "logs",
        prefix=cluster.lab["good"].prefix(),
    ).start()
    cluster.procs["pinned"] = fooled
    wait_until(lambda: not fooled.alive() or "not our head" in fooled.log_text(), 90, "the pinned worker to refuse")
    log = fooled.log_text()
    assert "certificate verify failed" in log.lower() and "not the server this connection trusts" in log
    assert "not our head" in log
    assert json.loads((cluster.root / "fake.json").read_text())["subjects"] == ["coderai.join.hello"] * 2


def test_a_revoked_node_is_cut_off_at_once_and_may_not_join_again(cluster):
    spare = node_up(cluster.lab["evil"], "spare", cluster.lab["head"].ip, cluster.root, TOKEN, cluster.env).start()
    cluster.procs["spare"] = spare
    wait_until(lambda: "spare" in cluster.nodes(), 60, "the spare node to join")
    out = cluster.run("head", "-m", "coderai.cli", "nodes", "--data-dir", str(cluster.root / "head"), "revoke", "spare")
    assert '"revoked": ["spare"]' in out
    wait_until(lambda: "spare" not in cluster.nodes(), 15, "the revoked node to leave")
    wait_until(
        lambda: "Authorization Violation" in spare.log_text() or "authorization violation" in spare.log_text(),
        15,
        "NATS to cut the revoked node off",
    )
    members = cluster.run("head", "-m", "coderai.cli", "nodes", "--data-dir", str(cluster.root / "head"), "list")
    assert '"node_id": "good"' in members and '"node_id": "spare"' not in members
    spare.stop()
    # it still has the token, but its id may not join again
    again = node_up(
        cluster.lab["evil"], "spare", cluster.lab["head"].ip, cluster.root / "again", TOKEN, cluster.env
    ).start()
    cluster.procs["spare-again"] = again
    wait_until(lambda: not again.alive() or "was revoked" in again.log_text(), 60, "the rejoin to be refused")
    assert "was revoked" in again.log_text()
    assert "spare" not in cluster.nodes()
