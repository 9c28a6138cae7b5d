"""Prompt-head snapshots on llama-server (issue 39): a second session of an agent, started while the first keeps the
slot that holds their shared system prompt busy, gets that head restored into its own slot instead of prefilling it.
The chain and the slot book's placement alone, then a real llama-server on the tiny GGUF, with snapshots and
without, through the engine as the worker drives it."""

from __future__ import annotations

import os
import threading

import pytest

from coderai.contracts import ChatJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.prompt_heads import HeadSnapshots, chat_chain, text_chain
from coderai.engine_worker.engines.slot_scope import Plan, SlotBook, common_chars
from coderai.testing.procs import wait_until

SYSTEM = {"role": "system", "content": " ".join(f"rule{j} keep answers short" for j in range(60))}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_two_sessions_of_one_agent_share_their_head_and_nothing_after_it():
    a, head_a = chat_chain([SYSTEM, _user("session one")], TOOLS)
    b, head_b = chat_chain([SYSTEM, _user("session two")], TOOLS)
    assert head_a == head_b > len(SYSTEM["content"]) and a[0] == b[0] and a[1] != b[1]
    assert common_chars(a, b) == head_a
    turn2, _ = chat_chain([SYSTEM, _user("session one"), {"role": "assistant", "content": "ok"}, _user("more")], TOOLS)
    assert common_chars(a, turn2) == a[-1][1]  # a later turn extends its session's chain
    other_tools, _ = chat_chain([SYSTEM, _user("session one")], TOOLS + TOOLS)
    assert common_chars(a, other_tools) == 0  # the tools are part of the head
    assert chat_chain([_user("hi")], None)[1] == 0  # no head
    assert common_chars(text_chain("x" * 3000), text_chain("x" * 2500 + "y" * 500)) == 2048


def test_a_placing_book_sends_a_session_where_its_prompt_lies_and_a_new_one_elsewhere_while_that_slot_is_busy():
    book = SlotBook(2, place_shared=True)
    s1, head = chat_chain([SYSTEM, _user("session one")], TOOLS)
    first = book.take("", chain=s1)
    assert first.shared == 0 and first.reuse
    book.give(first, "", s1)
    s1b, _ = chat_chain([SYSTEM, _user("session one"), {"role": "assistant", "content": "ok"}, _user("go")], TOOLS)
    turn2 = book.take("", chain=s1b)
    assert turn2.slot == first.slot and turn2.shared == s1[-1][1]  # its own session's slot, warm
    s2, _ = chat_chain([SYSTEM, _user("session two")], TOOLS)
    second = book.take("", chain=s2)  # the warm slot is busy: the other one, which has nothing of it
    assert second.slot != first.slot and second.shared == 0
    book.give(turn2, "", s1b)
    book.give(second, "", s2)
    s3, _ = chat_chain([SYSTEM, _user("session three")], TOOLS)
    third = book.take("", chain=s3)  # both free now, both hold the head: the most recently used
    assert third.slot == second.slot and third.shared == head
    book.give(third, "", s3)
    assert book.take("", several=True) == Plan(None, True)  # n > 1: the server places it
    book.give(Plan(None, True), "")
    assert book.chain == [(), ()]  # and nothing is known of the free slots after it


def test_snapshots_keep_within_their_budget_and_are_saved_once(tmp_path):
    snaps = HeadSnapshots(max_bytes=250)
    try:
        assert os.stat(snaps.dir).st_mode & 0o777 == 0o700
        assert snaps.claim(1) and not snaps.claim(1)  # one save at a time
        for head, size in ((1, 100), (2, 100)):
            with open(os.path.join(snaps.dir, snaps.name(head)), "wb") as fh:
                fh.write(b"k" * size)
            snaps.claim(head)
            snaps.saved(head, True)
        assert snaps.has(1) and snaps.has(2) and not snaps.claim(1)
        with open(os.path.join(snaps.dir, snaps.name(3)), "wb") as fh:
            fh.write(b"k" * 100)
        snaps.claim(3)
        snaps.saved(3, True)  # 300 bytes > 250: the least recently used (1, read before 2) goes
        assert not snaps.has(1) and snaps.has(2) and snaps.has(3)
        assert not os.path.exists(os.path.join(snaps.dir, snaps.name(1)))
        with open(os.path.join(snaps.dir, snaps.name(4)), "wb") as fh:
            fh.write(b"k" * 400)
        snaps.claim(4)
        snaps.saved(4, True)  # larger than the whole budget: not kept, and never tried again
        assert not snaps.has(4) and snaps.has(3) and not snaps.claim(4)
        folder = snaps.dir
    finally:
        snaps.close()
    assert not os.path.exists(folder)


@pytest.fixture
def engine_for(tiny_gguf, monkeypatch):
    from coderai.engine_worker.engines import llama_server

    if llama_server.find_binary() is None:
        pytest.skip("no llama-server: scripts/setup builds it into .venv/bin")
    monkeypatch.setattr(llama_server, "MIN_HEAD_CHARS", 200)  # the tiny GGUF's context holds a short head only
    made = []

    def make(**params):
        eng = llama_server.LlamaServerEngine(
            ModelConfig(
                name="m",
                engine="llama-server",
                path=str(tiny_gguf),
                params={"parallel": 2, "n_ctx": 2048, "n_threads": 1, "cache_ram_mb": 64, **params},
            )
        )
        made.append(eng)
        eng.load()
        return eng

    yield make
    for eng in made:
        eng.close()


def _second_session_cached(eng) -> int:
    """Session one's first turn, then its second turn (900 tokens, its stream held by the test) while session two's
    first turn runs: the tokens session two found cached."""
    eos = eng.post_json("/tokenize", {"content": "<|im_end|>", "parse_special": True}, "t")["tokens"]

    def job(messages, rid, max_tokens=4):  # a long turn has no end of turn: it runs all its tokens
        bias = {str(eos[0]): -100.0} if max_tokens > 4 else None
        return ChatJob(
            request_id=rid,
            model="m",
            messages=messages,
            params=SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=bias),
        )

    eng.chat(job([SYSTEM, _user("session one")], "s1-t1"), CancelFlag(), None)
    if eng.heads is not None:
        wait_until(lambda: eng.heads.saves == 1, 30, "the head's snapshot")
    release, streaming = threading.Event(), threading.Event()

    def hold(*_a, **_k):
        streaming.set()
        release.wait(60)

    turn2 = threading.Thread(
        target=eng.chat,
        args=(
            job([SYSTEM, _user("session one"), {"role": "assistant", "content": "ok"}, _user("next")], "s1-t2", 900),
            CancelFlag(),
            hold,
        ),
    )
    turn2.start()
    try:
        assert streaming.wait(60), "session one's second turn did not start"
        _, usage = eng.chat(job([SYSTEM, _user("session two")], "s2-t1"), CancelFlag(), None)
    finally:
        release.set()
        turn2.join(60)
    return usage.cached_tokens


def test_a_second_session_started_while_the_first_is_busy_reads_the_head_from_its_snapshot(engine_for, monkeypatch):
    from coderai.engine_worker.engines.loopback_http import LoopbackClient

    made_by: dict = {}  # each connection the engine's client opened, and the thread it was opened for
    opened = LoopbackClient._conn

    def noted(client, fresh=False):
        conn, reused = opened(client, fresh)
        made_by.setdefault(conn, threading.current_thread())
        return conn, reused

    monkeypatch.setattr(LoopbackClient, "_conn", noted)
    with_snapshots = engine_for()
    head_tokens = len(with_snapshots.post_json("/tokenize", {"content": SYSTEM["content"]}, "t")["tokens"])
    cached = _second_session_cached(with_snapshots)
    assert cached >= head_tokens and with_snapshots.heads.restores == 1, (cached, head_tokens)
    for t in threading.enumerate():
        if t.name.startswith("save-head-"):
            t.join(30)
    # the save ran on a thread of its own that has ended: no connection of an ended thread is left open
    assert not [c for c in with_snapshots.client.http._all if not made_by[c].is_alive()]
    assert os.listdir(with_snapshots.heads.dir) == [
        with_snapshots.heads.name(chat_chain([SYSTEM, _user("x")], None)[0][0][0])
    ]
    without = engine_for(head_snapshots_mb=0)  # the same, as llama-server does it alone: a prefill from zero
    assert without.heads is None and _second_session_cached(without) == 0


def test_once_a_request_of_one_key_came_no_snapshot_is_restored_or_kept(monkeypatch):
    """The attack: key B's request placed in a slot that gets a snapshot of shared prompts restored, once the
    server's cache is scoped per key. The book turns scoped at the first scoped request: the snapshots are deleted
    and none is restored or saved from then on."""
    from coderai.engine_worker.engines.llama_server import LlamaServerEngine

    eng = LlamaServerEngine(ModelConfig(name="m", engine="llama-server", path="/m.gguf", params={"parallel": 2}))
    actions: list[tuple] = []

    def slot_action(slot, action, name, keep=True):  # what the server does: a save writes the file
        actions.append((slot, action))
        if action == "save":
            with open(os.path.join(eng.heads.dir, name), "wb") as fh:
                fh.write(b"kv cells")
        return True

    monkeypatch.setattr(eng, "_slot_action", slot_action)
    chain, head_chars = chat_chain([SYSTEM, _user("one")], TOOLS)
    head = chain[0][0]
    try:
        with eng._placed("", False, chain, head, head_chars):
            pass
        wait_until(lambda: eng.heads.saves == 1, 10, "the head's save")
        assert [a for _, a in actions] == ["save"] and eng.heads.has(head)
        busy = eng.book.take("", chain=chain)  # the slot with the head is busy: the next session's gets it restored
        with eng._placed("", False, chat_chain([SYSTEM, _user("two")], TOOLS)[0], head, head_chars):
            pass
        eng.book.give(busy, "", chain)
        assert [a for _, a in actions] == ["save", "restore"]
        with eng._placed("key-b", False):
            pass  # the first scoped request: the book stops sharing
        actions.clear()
        other, _ = chat_chain([SYSTEM, _user("three")], TOOLS)
        with eng._placed("", False, other, head, head_chars):
            pass
        assert actions == [] and not eng.heads.has(head) and os.listdir(eng.heads.dir) == []
    finally:
        eng.heads.close()
