"""docs/subjects.md describes the bus as the code has it: every subject, stream and bucket, and example payloads
that the code would accept. Reads the doc and the contracts only: no servers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coderai.contracts import subjects, topology
from coderai.contracts.ops import ENGINE_OPS, OPS
from coderai.contracts.subjects import Subject

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "subjects.md"
DOC = DOC_PATH.read_text(encoding="utf-8")
GENERIC_OP = "coderai.engine.<node_id>.<engine_id>.<op>"
REPLY_SUBJECTS = ("coderai.reply.", "_INBOX.")  # reply subjects: made by runtime/bus.py, not Subjects

SUBJECTS: dict[str, Subject] = {name: v for name, v in vars(subjects).items() if isinstance(v, Subject)}
SPECS = {name: v for name, v in vars(topology).items() if isinstance(v, (topology.StreamSpec, topology.BucketSpec))}
HEADERS = {name: v for name, v in vars(topology).items() if name.startswith("HDR_") and isinstance(v, str)}


def doc_pattern(subject: Subject) -> str:
    """The subject's pattern as the doc writes it: `{x}` placeholders as `<x>`."""
    return re.sub(r"\{(\w+)\}", r"<\1>", subject.pattern)


def generic_op_rows() -> list[str]:
    """The lines that cover the per-op engine subjects with one `coderai.engine.<node_id>.<engine_id>.<op>` row."""
    return [line for line in DOC.splitlines() if f"`{GENERIC_OP}`" in line]


def glance_rows() -> list[str]:
    """The first cell of each row of the "Subjects at a glance" table."""
    section = DOC.split("## Subjects at a glance", 1)[1].split("\n## ", 1)[0]
    cells = []
    for line in section.splitlines():
        if line.startswith("| `"):
            cells.append(line.split("|")[1].strip())
    return cells


def test_the_doc_finds_subjects_to_check():
    assert len(SUBJECTS) > 30 and "ROUTE_PICK" in SUBJECTS and "EVENTS_ALL" in SUBJECTS
    assert set(ENGINE_OPS.values()) <= set(SUBJECTS.values())


@pytest.mark.parametrize("name", sorted(SUBJECTS))
def test_every_subject_is_documented(name):
    subject = SUBJECTS[name]
    pattern = doc_pattern(subject)
    if f"`{pattern}" in DOC:
        return
    ops = [op for op, s in ENGINE_OPS.items() if s is subject]
    assert ops, f"{name} ({pattern}) is not in docs/subjects.md"
    rows = generic_op_rows()
    assert rows, f"{name} ({pattern}) is not in docs/subjects.md, and no row names `{GENERIC_OP}`"
    assert any(f"`{ops[0]}`" in row for row in rows), (
        f"{name}: the `{GENERIC_OP}` row of docs/subjects.md does not name op `{ops[0]}`"
    )


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_engine_op_is_documented(op):
    """Each op of `OPS` has its subject written out, or is named on the generic `<op>` row."""
    literal = doc_pattern(OPS[op].subject)
    assert f"`{literal}`" in DOC or any(f"`{op}`" in row for row in generic_op_rows()), (
        f"op {op!r}: neither `{literal}` nor the `{GENERIC_OP}` row names it in docs/subjects.md"
    )


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_stream_and_bucket_is_documented(name):
    spec = SPECS[name]
    assert f"`{spec.name}`" in DOC, f"{name} ({spec.name}) is not in docs/subjects.md"
    if isinstance(spec, topology.StreamSpec):
        for subject in spec.subjects:
            assert f"`{subject}`" in DOC, f"stream {spec.name}'s subject {subject} is not in docs/subjects.md"


@pytest.mark.parametrize("name", sorted(HEADERS))
def test_every_header_is_documented(name):
    assert f"`{HEADERS[name]}`" in DOC, f"{name} ({HEADERS[name]}) is not in docs/subjects.md"


def test_the_table_lists_only_subjects_that_exist():
    """A row of "Subjects at a glance" is a Subject of the code (or the generic op row, or a reply subject)."""
    known = {doc_pattern(s) for s in SUBJECTS.values()} | {GENERIC_OP}
    rows = glance_rows()
    assert len(rows) >= len(SUBJECTS) - len(ENGINE_OPS)
    for cell in rows:
        first = re.match(r"`([^`]+)`", cell)
        assert first, f"a row of the table does not start with a subject: {cell!r}"
        pattern = first.group(1)
        if pattern.startswith(REPLY_SUBJECTS):
            continue
        assert pattern in known, f"docs/subjects.md lists {pattern}, which no Subject in subjects.py has"


NATS_EXAMPLES = re.findall(r"^nats (req|pub) (\S+) '(\{.*?\})'", DOC, re.M)


def _subject_of(concrete: str) -> Subject | None:
    for s in SUBJECTS.values():
        if s is subjects.EVENTS_ALL:
            continue
        try:
            s.parse(concrete)
        except ValueError:
            continue
        return s
    return None


def test_the_doc_has_nats_examples():
    assert len(NATS_EXAMPLES) >= 5


@pytest.mark.parametrize(("verb", "concrete", "payload"), NATS_EXAMPLES, ids=[e[1] for e in NATS_EXAMPLES])
def test_nats_examples_decode_as_their_subjects_messages(verb, concrete, payload):
    """Every `nats req|pub <subject> '<json>'` of the doc would be accepted (field names, types) by its handler."""
    subject = _subject_of(concrete)
    assert subject is not None, f"docs/subjects.md sends to {concrete}, which matches no Subject"
    subject.decode(payload.encode())
