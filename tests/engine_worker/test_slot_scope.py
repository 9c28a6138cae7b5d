"""The llama-server engine's slot book (issue 40, item 8): a request never reuses a prefix another key left in a
slot, the shared fast path is untouched until a scoped request comes, and a server with a host RAM cache (one pool
for every slot) turns reuse off rather than risk it. The bodies the engine then sends say so (`id_slot`,
`cache_prompt`)."""

from __future__ import annotations

import threading

from coderai.contracts import ChatJob, CompletionJob, ModelConfig, SamplingParams
from coderai.engine_worker.engines.llama_server import LlamaServerEngine, cache_ram_mb, server_args
from coderai.engine_worker.engines.slot_scope import ALL, Plan, SlotBook
from coderai.testing.procs import wait_until

A, B = "scope-a", "scope-b"


def test_an_idle_book_leaves_shared_requests_to_the_server():
    book = SlotBook(2)
    for _ in range(3):
        plan = book.take("")
        assert plan == Plan(None, True)
        book.give(plan, "")
    assert not book.isolated and not book.no_reuse


def test_a_private_book_gives_each_key_its_own_warm_slot_and_never_another_s():
    book = SlotBook(2, isolated=True, ram_cache=False)
    pa = book.take(A)
    assert pa.reuse  # an empty slot: nothing to leak
    book.give(pa, A)
    pb = book.take(B)
    assert pb.slot != pa.slot and pb.reuse  # the other, still empty
    book.give(pb, B)
    again = book.take(A)
    assert (again.slot, again.reuse) == (pa.slot, True)  # A's own prefix: reused
    book.give(again, A)
    # both slots now hold someone's prompt; a third key takes the least recently used one, without reuse
    pc = book.take("scope-c")
    assert (pc.slot, pc.reuse) == (pb.slot, False)
    book.give(pc, "scope-c")
    pb2 = book.take(B)  # B's slot was taken over by C: B may not reuse what C left
    assert pb2.reuse is False
    print("private book: each key reuses only its own slot; a slot another key filled runs with cache_prompt off")


def test_the_shared_pool_is_a_scope_like_any_other_once_isolated():
    book = SlotBook(1, isolated=True, ram_cache=False)
    p = book.take(A)
    book.give(p, A)
    shared = book.take("")
    assert shared.reuse is False  # a sharer does not read a private key's prefix either
    book.give(shared, "")
    assert book.take("").reuse is True


def test_the_first_scoped_request_makes_what_the_server_placed_unknown():
    book = SlotBook(2, ram_cache=False)
    book.give(book.take(""), "")  # placed by the server, slot unknown to the book
    plan = book.take(A)
    assert book.isolated and plan.slot is not None and plan.reuse is False


def test_with_a_ram_cache_a_scoped_request_turns_reuse_off_for_everyone():
    book = SlotBook(2, ram_cache=True)
    assert book.take("") == Plan(None, True)
    assert book.take(A) == Plan(None, False)
    assert book.take("") == Plan(None, False) and book.take(B) == Plan(None, False)


def test_a_request_of_several_tasks_holds_every_slot_and_leaves_them_unknown():
    book = SlotBook(3, isolated=True, ram_cache=False)
    book.give(book.take(A), A)
    plan = book.take(B, several=True)
    assert plan == Plan(ALL, False)
    book.give(plan, B)
    assert book.take(A).reuse is False  # n > 1: the server spread B over slots the book cannot name


def test_take_waits_for_a_free_slot():
    book = SlotBook(1, isolated=True, ram_cache=False)
    first = book.take(A)
    got: list[Plan] = []
    t = threading.Thread(target=lambda: got.append(book.take(B)))
    t.start()
    wait_until(lambda: book._cv._waiters, 10, "bob to wait on the book")  # the only slot is taken
    assert not got
    book.give(first, A)
    t.join(10)
    assert got and got[0].slot == first.slot and got[0].reuse is False


def _engine(**kw) -> LlamaServerEngine:
    return LlamaServerEngine(ModelConfig(name="m", engine="llama-server", path="/m.gguf", params={"parallel": 2}, **kw))


def test_a_private_model_runs_without_the_host_ram_cache():
    private = ModelConfig(
        name="m", engine="llama-server", path="/m.gguf", share_cache=False, params={"cache_ram_mb": 512}
    )
    args = server_args(private, 1)
    assert args[args.index("--cache-ram") + 1] == "0" and cache_ram_mb(private) == 0
    shared = ModelConfig(name="m", engine="llama-server", path="/m.gguf", params={"cache_ram_mb": 512})
    assert cache_ram_mb(shared) == 512


def test_bodies_carry_the_slot_and_the_reuse_the_book_chose():
    eng = _engine(share_cache=False)
    job = ChatJob(request_id="r", model="m", messages=[{"role": "user", "content": "hi"}], cache_scope=A)
    with eng._placed(A, False):
        body = eng.chat_body(job, False)
    assert body["id_slot"] in (0, 1) and body["cache_prompt"] is True
    eng.book.owner = [B, B]
    with eng._placed(A, False):
        body = eng.completion_body(CompletionJob(request_id="r", model="m", prompt="x", cache_scope=A), False)
    assert body["cache_prompt"] is False and "id_slot" in body
    with eng._placed(A, True):
        body = eng.chat_body(job, False)
    assert body["cache_prompt"] is False and "id_slot" not in body


def test_the_shared_fast_path_body_is_unchanged():
    eng = LlamaServerEngine(
        ModelConfig(name="m", engine="llama-server", path="/m.gguf", params={"parallel": 2, "head_snapshots_mb": 0})
    )
    job = ChatJob(
        request_id="r", model="m", messages=[{"role": "user", "content": "hi"}], params=SamplingParams(max_tokens=3)
    )
    with eng._placed("", False):
        body = eng.chat_body(job, False)
    assert "id_slot" not in body and "cache_prompt" not in body
    assert body == LlamaServerEngine.__mro__[1].chat_body(eng, job, False)


def test_with_head_snapshots_the_book_places_shared_requests_with_reuse():
    eng = _engine()  # head snapshots on by default: the book knows where each prompt lies (prompt_heads)
    job = ChatJob(request_id="r", model="m", messages=[{"role": "user", "content": "hi"}])
    with eng._placed("", False, ((1, 10),)):
        body = eng.chat_body(job, False)
    assert body["id_slot"] in (0, 1) and body["cache_prompt"] is True
    assert eng.book.chain[body["id_slot"]] == ((1, 10),)
    assert "--slot-save-path" not in server_args(eng.config, 1)  # added by the engine's command, with its folder


async def test_the_worker_default_makes_a_model_that_does_not_say_private(monkeypatch):
    """CODERAI_WORKER_SHARE_CACHE (or CODERAI_SHARE_CACHE) off: a model without its own `share_cache` is built as a
    private one (its server then starts with --cache-ram 0); a model's own word wins."""
    from coderai.engine_worker.engines.base import EngineLoadError
    from coderai.engine_worker.host import EngineHost

    seen: list[ModelConfig] = []

    class Stop:
        max_concurrency = 1

        def __init__(self, cfg: ModelConfig) -> None:
            seen.append(cfg)

        def load(self) -> None:
            raise EngineLoadError("the config is all this test wants")

    monkeypatch.setattr("coderai.engine_worker.host.engine_class", lambda family: Stop)
    for default, own in ((False, None), (True, None), (False, True)):
        cfg = ModelConfig(name="m", engine="echo", path="-", share_cache=own)
        assert await EngineHost(None, "n1", cfg, 1.0, share_cache=default).load() is False
    assert [c.share_cache for c in seen] == [False, None, True]


def test_vllm_gets_the_scope_as_its_cache_salt():
    from coderai.engine_worker.engines.vllm import VllmEngine

    eng = VllmEngine(ModelConfig(name="m", engine="vllm", path="/m"))
    scoped = ChatJob(request_id="r", model="m", messages=[{"role": "user", "content": "hi"}], cache_scope=A)
    assert eng.chat_body(scoped, False)["cache_salt"] == A
    assert (
        eng.completion_body(CompletionJob(request_id="r", model="m", prompt="x", cache_scope=B), True)["cache_salt"]
        == B
    )
    shared = ChatJob(request_id="r", model="m", messages=[{"role": "user", "content": "hi"}])
    assert "cache_salt" not in eng.chat_body(shared, False)  # the shared fast path sends what it always sent
