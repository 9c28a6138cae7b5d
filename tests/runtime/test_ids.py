"""Ids drawn from a pooled urandom block: right length, never repeated, and a forked child never hands out the ids
its parent is about to."""

from __future__ import annotations

import os

from coderai.runtime import ids


def test_ids_have_the_asked_length_and_never_repeat():
    seen = {ids.token_hex(12) for _ in range(5000)}  # more than one block's worth (4 KiB / 12 bytes)
    assert len(seen) == 5000
    assert all(len(t) == 24 and int(t, 16) >= 0 for t in seen)
    assert len(ids.token_bytes(ids.BLOCK + 7)) == ids.BLOCK + 7  # bigger than a block: drawn whole


def test_a_forked_child_does_not_repeat_its_parents_next_ids():
    ids.token_hex(1)  # the pool holds a block now
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(r)
        os.write(w, "".join(ids.token_hex(8) for _ in range(8)).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        child = f.read()
    os.waitpid(pid, 0)
    parent = "".join(ids.token_hex(8) for _ in range(8))
    assert len(child) == len(parent) == 128 and child != parent
    assert not {child[i : i + 16] for i in range(0, 128, 16)} & {parent[i : i + 16] for i in range(0, 128, 16)}
