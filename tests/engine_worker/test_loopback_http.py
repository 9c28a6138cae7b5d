"""LoopbackClient: kept connections, a stale one sent again on a new connection, streams closed early."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from coderai.engine_worker.engines.base import CancelFlag
from coderai.engine_worker.engines.loopback_http import LoopbackClient


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    drop_after_answer = False  # close the socket after each answer without saying so: the next reuse is stale
    seen: list[str] = []
    release = threading.Event()  # a silent stream's handler waits for it (set at teardown)

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen.append(self.path)
        if self.path == "/silent":  # one line, then nothing and no end: a server stuck in the middle of an answer
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            line = b"data: 0\n\n"
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            self.wfile.flush()
            type(self).release.wait(60)
            return
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(int(json.loads(body)["n"])):
                line = f"data: {i}\n\n".encode()
                self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        out = json.dumps({"echo": json.loads(body), "rid": self.headers.get("X-Request-Id")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
        if type(self).drop_after_answer:
            self.wfile.flush()
            self.close_connection = True


@pytest.fixture
def server():
    _Handler.seen = []
    _Handler.drop_after_answer = False
    _Handler.release = threading.Event()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    _Handler.release.set()
    srv.shutdown()
    srv.server_close()


def test_answers_come_back_on_one_kept_connection(server):
    c = LoopbackClient("127.0.0.1", server.server_address[1])
    for i in range(3):
        a = c.post("/x", json.dumps({"i": i}).encode(), {"X-Request-Id": f"r{i}"})
        assert a.status == 200 and json.loads(a.body) == {"echo": {"i": i}, "rid": f"r{i}"}
    assert len(c._all) == 1  # one connection served all three
    c.close()


def test_connections_number_the_requests_at_once_not_the_threads_that_ran_them(server):
    """A connection belongs to no thread: one freed by a thread that ended serves the next request of any other
    (tied to its thread, each engine thread an executor ever started kept one open for good: the soak's fd
    growth on a worker whose pool grew after warm-up). Two streams at once need two; after them, twenty
    requests from twenty threads one after another reuse those two."""
    c = LoopbackClient("127.0.0.1", server.server_address[1])
    with c.stream("/stream", b'{"n": 2}', {}) as (_, a), c.stream("/stream", b'{"n": 2}', {}) as (_, b):
        assert len(list(a)) == len(list(b)) == 4  # two events, each a line and a blank one
    assert len(c._all) == 2
    answers = []
    for i in range(20):
        t = threading.Thread(target=lambda i=i: answers.append(c.post("/x", json.dumps({"i": i}).encode(), {})))
        t.start()
        t.join(10)
    assert [json.loads(a.body)["echo"]["i"] for a in answers] == list(range(20))
    assert len(c._all) == 2
    assert c.post("/x", b"{}", {}, keep=False).status == 200 and len(c._all) == 1  # a probe's is not kept
    c.close()


def test_connections_idle_too_long_are_closed_and_the_pool_shrinks_back(server):
    """A burst grows the pool to the requests it had at once; once they wait unused for `idle_s` they are closed
    (by `prune`, which the engine's supervisor calls on every poll, or by the next request), so a worker's fds
    come back to what they were after the burst (the soak read three kept connections as fd growth +2)."""
    port = server.server_address[1]
    kept = LoopbackClient("127.0.0.1", port, idle_s=3600.0)
    gone = LoopbackClient("127.0.0.1", port, idle_s=0.0)
    for c in (kept, gone):
        with (
            c.stream("/stream", b'{"n": 1}', {}) as (_, a),
            c.stream("/stream", b'{"n": 1}', {}) as (_, b),
            c.stream("/stream", b'{"n": 1}', {}) as (_, d),
        ):
            assert len(list(a)) == len(list(b)) == len(list(d)) == 2
        assert len(c._all) == len(c._idle) == 3  # the burst's three, kept
    assert kept.prune() == 0 and len(kept._all) == 3  # not idle long enough
    assert gone.prune() == 3 and not gone._all and not gone._idle
    socks = {conn.sock.getsockname() for conn in kept._all}
    assert json.loads(kept.post("/x", b'{"i": 1}', {}).body)["echo"] == {"i": 1}
    assert {conn.sock.getsockname() for conn in kept._all} == socks  # reused one of its three
    gone.post("/x", b"{}", {})
    gone.post("/x", b"{}", {})  # the first one's connection, idle past 0 s, is closed before this one goes
    assert len(gone._all) == 1
    kept.close()
    gone.close()


def test_a_connection_the_server_closed_is_replaced_and_the_request_sent_once(server):
    _Handler.drop_after_answer = True
    c = LoopbackClient("127.0.0.1", server.server_address[1])
    for i in range(3):
        assert json.loads(c.post("/x", b'{"i": 1}', {}).body)["echo"] == {"i": 1}
    assert _Handler.seen == ["/x", "/x", "/x"]  # no request reached the server twice
    c.close()


def test_a_stream_read_to_its_end_and_one_left_early(server):
    c = LoopbackClient("127.0.0.1", server.server_address[1])
    with c.stream("/stream", b'{"n": 5}', {}) as (status, lines):
        got = [line for line in lines if line.strip()]
    assert status == 200 and got == [f"data: {i}\n".encode() for i in range(5)]
    with c.stream("/stream", b'{"n": 50}', {}) as (status, lines):
        assert next(lines) == b"data: 0\n"
    assert not c._all  # left early: its connection was closed, as an abort tells the server
    assert json.loads(c.post("/x", b"{}", {}).body)["echo"] == {}  # and a new one serves the next request
    c.close()


def test_an_sse_stream_that_ends_without_done_is_an_error_unless_cancelled():
    from coderai.engine_worker.engines.base import CancelFlag
    from coderai.engine_worker.engines.openai_wire import sse_events

    whole = ['data: {"a": 1}\n', "\n", "data: [DONE]\n"]
    assert list(sse_events(iter(whole), CancelFlag())) == [{"a": 1}]
    with pytest.raises(RuntimeError, match=r"before \[DONE\]"):
        list(sse_events(iter(whole[:2]), CancelFlag()))
    cancelled = CancelFlag()
    cancelled.set()
    assert list(sse_events(iter(whole[:2]), cancelled)) == []


def test_cancel_ends_a_stream_whose_server_went_silent(server):
    """A thread blocked reading a server that never ends its answer (llama-server with an empty prompt and n > 1)
    is woken by the request's cancel: the lines end, the thread returns and the connection is dropped."""
    c = LoopbackClient("127.0.0.1", server.server_address[1])
    cancel = CancelFlag()
    first, got, ended = threading.Event(), [], threading.Event()

    def read() -> None:
        with c.stream("/silent", b"{}", {}, cancel) as (status, lines):
            for line in lines:
                got.append(line)
                first.set()
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(10), "the silent server's first line never came"
    assert not ended.is_set()
    cancel.set()
    reader.join(10)
    assert ended.is_set(), "cancel did not wake the thread blocked on the silent stream"
    assert got[0].startswith(b"data: 0")
    assert not c._all  # the cut connection is not kept for a next request


def test_a_hook_on_a_flag_set_already_runs_at_once_and_a_removed_one_never():
    flag, ran = CancelFlag(), []
    remove = flag.on_set(lambda: ran.append("kept"))
    flag.on_set(lambda: ran.append("removed"))()  # removed before the flag is set
    flag.set()
    flag.on_set(lambda: ran.append("late"))
    remove()  # after it ran: nothing to remove
    assert ran == ["kept", "late"]
