"""The worker's book of what a vLLM server's prefix cache holds (engines/kv_events.py), fed the events vLLM publishes:
msgpack batches `[ts, [event, ...]]`, each event a map tagged by `type` (`BlockStored` with the `session_id` the
request carried, `BlockRemoved`, `AllBlocksCleared`). What the server sends is checked like any input."""

from __future__ import annotations

import msgspec
import pytest

from coderai.contracts.nodes import EVICTED_MAX
from coderai.engine_worker.engines.kv_events import CacheBook, apply_batch

enc = msgspec.msgpack.Encoder()


def batch(*events: dict) -> bytes:
    return enc.encode([1.0, list(events)])


def stored(session: str | None, *hashes) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None, "token_ids": [1, 2],
            "block_size": 16, "lora_id": None, "medium": "CPU", "lora_name": None, "session_id": session}  # fmt: skip


def removed(*hashes) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "CPU"}


def test_a_key_is_lost_once_more_than_half_of_its_blocks_are_evicted():
    book = CacheBook()
    book.began("req-1", "m", ["k-first", "k-last"])
    assert apply_batch(book, batch(stored("req-1", 1, 2, 3), stored("req-1", 4))) == 2
    assert book.holds("m", "k-last") == 4
    apply_batch(book, batch(removed(4, 3)))  # vLLM evicts a prompt's tail first: half is still a hit
    assert book.drain("m") == [] and book.holds("m", "k-last") == 2
    apply_batch(book, batch(removed(2)))
    assert sorted(book.drain("m")) == ["k-first", "k-last"]
    assert book.drain("m") == [], "said once"
    assert book.holds("m", "k-last") == 0


def test_blocks_shared_by_two_conversations_count_for_both_and_a_new_turn_starts_afresh():
    book = CacheBook()
    book.began("a", "m", ["conv-a"])
    book.began("b", "m", ["conv-b"])
    apply_batch(book, batch(stored("a", b"sys", b"a1"), stored("b", b"sys", b"b1")))  # bytes hashes too
    book.began("a2", "m", ["conv-a"])  # the next turn of a: recorded again, on the blocks this request holds
    apply_batch(book, batch(stored("a2", b"sys", b"a1", b"a2")))
    apply_batch(book, batch(removed(b"b1", b"sys")))
    assert book.drain("m") == ["conv-b"]
    assert book.holds("m", "conv-a") == 2


def test_each_engine_on_one_server_drains_its_own_keys():
    """Adapters loaded into a base's server: one book, each engine (model name) told its own keys."""
    book = CacheBook()
    book.began("r1", "base", ["kb"])
    book.began("r2", "tuned", ["kt"])
    apply_batch(book, batch(stored("r1", 1), stored("r2", 2)))
    apply_batch(book, batch({"type": "AllBlocksCleared"}))
    assert book.drain("tuned") == ["kt"] and book.drain("base") == ["kb"]


def test_what_the_server_sends_is_checked():
    book = CacheBook()
    book.began("r", "m", ["k"])
    for bad in (b"", b"\xc1", enc.encode({"not": "a batch"}), enc.encode([1.0, "events"]), enc.encode([1.0])):
        assert apply_batch(book, bad) == 0
    odd = [None, 7, {"type": "Unknown"}, {"type": "BlockStored", "block_hashes": "abc", "session_id": "r"},
           {"type": "BlockStored", "block_hashes": [True, 1.5, [1], 5], "session_id": "r"},
           {"type": "BlockStored", "block_hashes": [6], "session_id": ["r"]}]  # fmt: skip
    apply_batch(book, enc.encode([1.0, odd]))
    assert book.holds("m", "k") == 1, "only the well-formed hash 5 of session r"
    apply_batch(book, batch(stored("someone-else", 9)))  # a request without keys (or another worker's): ignored
    apply_batch(book, batch(removed(9, "x", None)))
    assert book.drain("m") == []


def test_the_book_is_bounded():
    book = CacheBook(max_keys=3, max_sessions=2)
    for i in range(5):
        book.began(f"r{i}", "m", [f"k{i}"])
    apply_batch(book, batch(stored("r0", 0), stored("r2", 2), stored("r4", 4)))
    assert book.holds("m", "k0") == 0, "r0's key was dropped past the bound (three kept)"
    assert book.holds("m", "k2") == 0, "r2's session was forgotten (two kept)"
    assert book.holds("m", "k4") == 1
    many = CacheBook()
    keys = [f"k{i}" for i in range(EVICTED_MAX + 10)]
    many.began("r", "m", keys)
    apply_batch(many, batch(stored("r", 1)))
    apply_batch(many, batch(removed(1)))
    first, second = many.drain("m"), many.drain("m")
    assert len(first) == EVICTED_MAX and len(second) == 10, "the rest in the next heartbeat"
    assert set(first) | set(second) == set(keys)


@pytest.mark.parametrize("session", [None, 5, b"r"])
def test_an_event_without_a_session_of_ours_changes_nothing(session):
    book = CacheBook()
    book.began("r", "m", ["k"])
    apply_batch(book, batch(stored(session, 1)))
    assert book.holds("m", "k") == 0


def test_a_block_evicted_and_stored_again_counts_once():
    book = CacheBook()
    book.began("r", "m", ["k"])
    apply_batch(book, batch(stored("r", 1, 2, 3, 4)))
    apply_batch(book, batch(removed(4), stored("r", 4), removed(3, 2)))  # 4 came back: 2 of 4 still held
    assert book.drain("m") == [] and book.holds("m", "k") == 2
    apply_batch(book, batch(removed(1)))
    assert book.drain("m") == ["k"]
