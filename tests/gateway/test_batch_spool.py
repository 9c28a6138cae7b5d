"""A finished batch's files are made through temporary files, not in memory: lines read in any order come out in
input order, each in its file; what is held in memory per line is its place in the spool, not its answer; the
tally of a running batch keeps counts, not answers. The whole path (a real batch through a stack):
tests/integration/test_batches.py."""

from __future__ import annotations

import json

import msgspec

from coderai.gateway.batches.output import Spool
from coderai.gateway.batches.records import LineResult, Tally


def _res(i: int, ok: bool, size: int = 10) -> LineResult:
    body = msgspec.Raw(json.dumps({"answer": "x" * size}).encode())
    return LineResult(
        index=i,
        custom_id=f"c{i}",
        id=f"batch_req_{i}",
        status_code=200 if ok else 500,
        body=body,
        prompt_tokens=2,
        completion_tokens=3 if ok else 0,
    )


def _lines(got) -> list[dict]:
    fh, size = got
    with fh:
        data = fh.read()
    assert len(data) == size
    return [json.loads(x) for x in data.splitlines()]


def test_lines_come_out_in_input_order_each_in_its_file():
    spool = Spool()
    for i in (5, 0, 3, 1, 4, 2):
        spool.add(_res(i, ok=i % 2 == 0, size=100_000))
    spool.add(_res(3, ok=True))  # a line seen twice (a replayed key) counts once, as first seen
    ok, failed = _lines(spool.file(True)), _lines(spool.file(False))
    assert [x["custom_id"] for x in ok] == ["c0", "c2", "c4"] and [x["custom_id"] for x in failed] == ["c1", "c3", "c5"]
    assert ok[0]["response"]["status_code"] == 200 and ok[0]["response"]["body"]["answer"] == "x" * 100_000
    assert spool.completed == 3 and len(spool.at) == 6
    assert all(isinstance(v, tuple) and len(v) == 3 for v in spool.at.values())  # places, not answers
    spool.close()


def test_a_kind_with_no_lines_makes_no_file():
    spool = Spool()
    spool.add(_res(0, ok=True))
    assert spool.file(False) is None
    assert len(_lines(spool.file(True))) == 1
    spool.close()


def test_the_tally_counts_each_line_once():
    tally = Tally()
    for i in (0, 1, 1, 2):
        tally.add(_res(i, ok=i != 1))
    assert tally.done == {0, 1, 2}
    assert tally.counts() == {"completed": 2, "failed": 1, "prompt_tokens": 6, "completion_tokens": 6}
