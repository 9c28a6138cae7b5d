"""Which store files a node may read: its models' and its running jobs' files, nothing else; and the scheduler's
handlers judge the asker by its reply inbox, refusing before the store is looked at."""

from __future__ import annotations

import types

import pytest

from coderai.contracts import Assignment, BusError, ModelConfig
from coderai.contracts.training import FineTuneJob
from coderai.runtime.members import requester
from coderai.scheduler import store_scope
from coderai.scheduler.service import Scheduler

FILE = ModelConfig(name="f", engine="llama", path="/nowhere/f.gguf", store_path="org/f/f.gguf")
FOLDER = ModelConfig(name="d", engine="embed", path="/nowhere/d", store_path="org/d/")
SOURCED = ModelConfig(name="s", engine="llama", path="/nowhere/s.gguf", source="store:org/s/s.gguf")


def job(status: str = "running", valid: bool = True, nodes=("a", "b")) -> FineTuneJob:
    return FineTuneJob(
        id="ftjob-1",
        model="base",
        training_file="file-t",
        validation_file="file-v" if valid else None,
        status=status,
        created_at=1,
        nodes=list(nodes),
    )


def test_a_node_reads_its_models_files_and_folders_only():
    granted = store_scope.grants("a", [FILE, FOLDER, SOURCED], [])
    ok = [
        ("org/f/f.gguf", False),
        ("org/d", True),
        ("org/d/", True),
        ("org/d/config.json", False),
        ("org/d/sub/w.bin", False),
        ("org/d/sub", True),
        ("org/s/s.gguf", False),
    ]
    for path, folder in ok:
        assert store_scope.may_read(path, folder, granted), path
    no = [
        ("org/f/f.gguf", True),
        ("org/f", True),
        ("org/f/other.gguf", False),
        ("org", True),
        ("org/dd/x", False),
        ("org/d-evil/x", False),
        ("org/s", True),
        ("finetune", True),
        ("other/m.gguf", False),
    ]
    for path, folder in no:
        assert not store_scope.may_read(path, folder, granted), path


def test_a_training_rank_reads_its_jobs_data_while_it_runs():
    assert store_scope.may_read("finetune/ftjob-1/train.jsonl", False, store_scope.grants("b", [], [job()]))
    assert store_scope.may_read("finetune/ftjob-1/valid.jsonl", False, store_scope.grants("a", [], [job()]))
    assert not store_scope.may_read(
        "finetune/ftjob-1/valid.jsonl", False, store_scope.grants("a", [], [job(valid=False)])
    )
    assert not store_scope.may_read("finetune/ftjob-1/train.jsonl", False, store_scope.grants("c", [], [job()]))
    assert not store_scope.may_read("finetune/ftjob-1", True, store_scope.grants("a", [], [job()]))
    assert not store_scope.may_read("finetune/ftjob-1/adapter.tar", False, store_scope.grants("a", [], [job()]))
    for ended in ("succeeded", "failed", "cancelled"):
        assert not store_scope.may_read(
            "finetune/ftjob-1/train.jsonl", False, store_scope.grants("a", [], [job(ended)])
        )


def test_the_asker_is_read_from_its_reply_inbox():
    assert requester("_N.node-1.abc.1") == "node-1"
    assert requester("_INBOX.xyz.1") == ""
    for other in ("", "_N", "_N..x", "coderai.engine.node-1.x", "coderai.cmd.node.n.x", "_INBOXX.a", "_JOIN.a.b"):
        assert requester(other) is None, other


class _Mirror:
    def __init__(self, values: dict) -> None:
        self.values = values


def _scheduler(assignments: dict, jobs: dict, fresh: dict | None = None) -> Scheduler:
    """A scheduler with only what `_may_read` reads: the assignment mirror, the training jobs, and (for a
    mirror that lags) the buckets read by `_fresh_grants`."""
    sched = Scheduler.__new__(Scheduler)
    sched.assignments = _Mirror(assignments)
    sched.models = [FILE, FOLDER]
    sched.training = types.SimpleNamespace(jobs=jobs, read_job=lambda _id: _none())

    async def fresh_grants(node_id: str, _path: str) -> list[str]:
        a = (fresh or {}).get(node_id)
        return sched._grants(node_id, a, None)

    sched._fresh_grants = fresh_grants
    return sched


async def _none():
    return None


def _msg(reply: str):
    return types.SimpleNamespace(reply=reply)


async def test_the_handler_refuses_before_the_store_is_read():
    sched = _scheduler({"a": Assignment(node_id="a", models=[FILE])}, {"ftjob-1": job()})
    await sched._may_read(_msg("_N.a.x.1"), "org/f/f.gguf", folder=False)
    await sched._may_read(_msg("_N.b.x.1"), "finetune/ftjob-1/train.jsonl", folder=False)
    await sched._may_read(_msg("_INBOX.svc.1"), "anything/at/all", folder=False)  # a service
    for reply, path, folder in (
        ("_N.b.x.1", "org/f/f.gguf", False),
        ("_N.c.x.1", "finetune", True),
        ("_N.c.x.1", "finetune/ftjob-1/train.jsonl", False),
        ("coderai.engine.a.x", "org/f/f.gguf", False),
        ("", "org/f/f.gguf", False),
    ):
        with pytest.raises(BusError) as exc:
            await sched._may_read(_msg(reply), path, folder=folder)
        assert exc.value.code == "forbidden", (reply, path)
    with pytest.raises(BusError) as exc:  # a path with `..` never reaches the scope's prefix test
        await sched._may_read(_msg("_N.a.x.1"), "org/f/../../etc/passwd", folder=False)
    assert exc.value.code == "bad_request"


async def test_an_assignment_newer_than_the_mirror_is_read_from_its_bucket():
    sched = _scheduler({}, {}, fresh={"a": Assignment(node_id="a", models=[FOLDER])})
    await sched._may_read(_msg("_N.a.x.1"), "org/d", folder=True)
    with pytest.raises(BusError):
        await sched._may_read(_msg("_N.b.x.1"), "org/d", folder=True)
