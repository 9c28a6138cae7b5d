"""Which tenant's prompt each llama-server slot holds, so that no request is served from another tenant's prefix.

llama-server reuses the longest common prefix of whatever a slot last held (`cache_prompt`, on by default) and picks
the slot itself (by prefix similarity, else least recently used); its host RAM cache (`--cache-ram`) is one pool for
every slot and hands any slot the best-matching saved prompt. A tenant that guesses another's system prompt would see
the hit in `cached_tokens` and in the time to first token. For requests with a cache scope (ChatJob.cache_scope) the
engine therefore picks the slot itself (`id_slot`) from this book and sends `cache_prompt: false` whenever the slot
was last filled by another scope; with `cache_prompt` off llama-server recomputes the whole prompt (n_past = 0),
whatever the slot or the RAM cache held (tools/server/server-context.cpp, `launch_slot_with_task` and the prompt
loop). A server started with a RAM cache cannot be made safe by slot choice (the cache loads another scope's saved
prompt into the chosen slot, and saves idle slots on every new task), so there every request runs without reuse
(`Plan.reuse` false) once one scoped request came: `no_reuse`.

A book made with `place_shared` (a server that snapshots prompt heads, see prompt_heads) places shared requests
too: each slot's content is known as a chain of prefix digests (`Chain`), and a request goes to the free slot that
shares the longest prefix with it, as the server's own similarity pick would, else to an empty slot, else to the
least recently used one. Knowing where each prompt lies is what lets the engine restore a snapshot of a prompt head
into a slot that lacks it while the slot that has it is busy.

Pure bookkeeping under one lock; the engine's threads take a slot before they post and give it back after.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

UNKNOWN = "\x00unknown"  # a slot filled by a request the book did not place: nobody may reuse it
ALL = -1  # `Plan.slot` of a request that holds every slot (n > 1 or a list of prompts: the server spreads it)


Chain = tuple[tuple[int, int], ...]
"""A prompt as cumulative digests of its parts, each with the bytes up to its end: two prompts share a prefix
as long as their chains agree (prompt_heads makes them)."""


@dataclass(frozen=True)
class Plan:
    """Where one request runs: `slot` (an `id_slot`, ALL, or None: the server picks) and whether it may reuse the
    prefix cached there (`cache_prompt`); `shared`, for a placed shared request, is how many bytes of its
    prompt the slot held already (by the book's chains)."""

    slot: int | None
    reuse: bool
    shared: int = 0


def common_chars(a: Chain, b: Chain) -> int:
    """The bytes of the longest prefix chains `a` and `b` agree on."""
    chars = 0
    for x, y in zip(a, b):
        if x != y:
            break
        chars = x[1]
    return chars


class SlotBook:
    """The scope each of `n` slots was last filled by, and which slots are taken now.

    `isolated` from the start for a model whose cache is not shared (its server has no RAM cache); otherwise the
    book is idle (every request goes to the server as it is: today's fast path) until the first scoped request.
    Then, with `ram_cache` on, every request runs without reuse; without one, requests are placed by scope."""

    def __init__(self, n: int, isolated: bool = False, ram_cache: bool = True, place_shared: bool = False) -> None:
        self.n = n
        self.place_shared = place_shared
        self.chain: list[Chain] = [()] * n  # what a placed shared request left in each slot
        self.ram_cache = ram_cache
        self.isolated = isolated
        self.no_reuse = False
        self.owner: list[str | None] = [None] * n  # None: empty (nothing to reuse, nothing to leak)
        self.used_at = [0] * n
        self.taken = [False] * n
        self._tick = itertools.count(1)
        self._cv = threading.Condition()

    def take(self, scope: str, several: bool = False, chain: Chain | None = None) -> Plan:
        """A slot for a request of `scope` ("" shared), waiting while every slot is taken. `several`: the request
        runs as several server tasks (n > 1, a list of prompts): it takes every slot, and runs without reuse.
        `chain`: the request's prompt, for a book that places shared requests."""
        with self._cv:
            if not self.isolated and not self.no_reuse:
                if not scope and self.place_shared and chain is not None and not several:
                    self._cv.wait_for(lambda: not all(self.taken))
                    slot, shared = self._nearest(chain)
                    self.taken[slot] = True
                    return Plan(slot, True, shared)
                if not scope:
                    return Plan(None, True)  # nothing scoped came yet: the server places and reuses as ever
                self._scoped_arrived()
            if self.no_reuse:
                return Plan(None, False)
            if several:
                self._cv.wait_for(lambda: not any(self.taken))
                self.taken = [True] * self.n
                return Plan(ALL, False)
            self._cv.wait_for(lambda: not all(self.taken))
            slot, reuse = self._pick(scope)
            self.taken[slot] = True
            return Plan(slot, reuse)

    def give(self, plan: Plan, scope: str, chain: Chain = ()) -> None:
        """The request of `plan` ended: its slot now holds `scope`'s prompt, `chain` (every slot it may have used
        is unknown, for a request that held them all)."""
        if plan.slot is None:
            if self.place_shared:  # the server placed it (n > 1 on a shared book): any free slot may hold it now
                with self._cv:
                    self.chain = [c if self.taken[i] else () for i, c in enumerate(self.chain)]
            return
        with self._cv:
            if plan.slot == ALL:
                self.owner = [UNKNOWN] * self.n
                self.chain = [()] * self.n
                self.taken = [False] * self.n
            else:
                self.owner[plan.slot] = scope
                self.chain[plan.slot] = chain
                self.used_at[plan.slot] = next(self._tick)
                self.taken[plan.slot] = False
            self._cv.notify_all()

    def reset(self) -> None:
        """The server restarted: every slot is empty (the mode stays)."""
        with self._cv:
            self.owner = [None] * self.n
            self.chain = [()] * self.n

    def _scoped_arrived(self) -> None:
        """The first scoped request on a book that was idle: what the server placed by itself so far is unknown."""
        if self.ram_cache:
            self.no_reuse = True
            return
        self.isolated = True
        self.owner = [UNKNOWN] * self.n

    def _nearest(self, chain: Chain) -> tuple[int, int]:
        """The free slot whose prompt shares the most with `chain` (the most recently used of equals), else an
        empty one, else the least recently used; with the bytes it shares."""
        free = [i for i in range(self.n) if not self.taken[i]]
        best = max(free, key=lambda i: (common_chars(self.chain[i], chain), self.used_at[i]))
        shared = common_chars(self.chain[best], chain)
        if shared:
            return best, shared
        empty = [i for i in free if self.owner[i] is None]
        return (empty[0] if empty else min(free, key=lambda i: self.used_at[i])), 0

    def _pick(self, scope: str) -> tuple[int, bool]:
        """The free slot this scope filled last, else an empty one, else the least recently used (without reuse)."""
        free = [i for i in range(self.n) if not self.taken[i]]
        own = [i for i in free if self.owner[i] == scope]
        if own:
            return max(own, key=lambda i: self.used_at[i]), True
        empty = [i for i in free if self.owner[i] is None]
        if empty:
            return empty[0], True
        return min(free, key=lambda i: self.used_at[i]), False
