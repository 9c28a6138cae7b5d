"""What the gateway's per-request limits check costs at a steady request rate, on each store it could live in
across heads, side by side in one run (issue 26, part 4: "Redis across heads").

The check is what `gateway/accounting.py:Accounts.admit` runs for a key with every limit set: the real
`accounts/limits.py:Limiter.admit` (tokens-per-minute check, requests-per-minute take, budget reservation: three Lua
scripts, three round trips), or its equivalent on NATS:
  redis       a plain redis-server, through `runtime/redis_client.connect("redis://...")`: the baseline
  sentinel    the same Limiter through a Sentinel-discovered master (`redis+sentinel://`), the master with one replica
              and one sentinel, as three heads would run it (asynchronous replication, as Redis does)
  kv-cas      JetStream KV, a bucket replicated on a 3-server cluster: one entry per key holding the two GCRA times
              and the reservation, read and written back with a revision check (compare-and-set), retried on a
              conflict. Two round trips per check when nothing races; the clock is the gateway's, not the store's
  kv-counter  the server's atomic counters (nats-server >= 2.12, ADR-49) on a replicated counter stream: a
              fixed per-minute window per key (a request counted by one increment) and the reservation as an
              increment in micro-dollars, undone when over; reads and increments in two round trips. Not GCRA: a
              window lets 2 x rpm through across its edge

Load is open-loop from one asyncio client: check i is due at t0 + i/rate whether or not earlier ones finished, and
its latency counts from when it was due (so the client's own lag shows). Server CPU is read from /proc for the
path's processes (the sentinel's three, the cluster's three nats-servers). Paths run in rounds, the order reversed
every other round, so machine noise hits all alike. Every server listens on a random loopback port and is stopped
at the end (and dies with this process if it is killed).

  python bench/redis_ha.py                     # 1,000 checks/s, 10 s per path and round, 2 rounds, 1 hot key
  python bench/redis_ha.py --keys 16           # the load spread over 16 keys (fewer compare-and-set races)
  python bench/redis_ha.py --smoke             # 2 s at 100 checks/s, one round: the bench runs end to end
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from coderai.accounts.limits import Limited, Limiter, period_id
from coderai.runtime import redis_client
from coderai.runtime.embedded import NatsServer, Routes, free_port
from coderai.runtime.embedded_redis import RedisSentinel, RedisServer

PATHS = ("redis", "sentinel", "kv-cas", "kv-counter")
# every limit on, none ever reached: each check does all of its work and is let through
RPM = TPM = 100_000_000
BUDGET_USD = 1e9
ESTIMATE_USD = 0.0001
CHECK_TIMEOUT_S = 5.0
CAS_TRIES = 50


@dataclass
class Cell:
    """One path's checks in one round."""

    path: str
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    refused: int = 0
    retries: int = 0
    seconds: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    first_error: str = ""


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (and their reaped children, e.g. a replication fork)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15])
    return total / tick


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]


class Store:
    """A store under test: `check(i)` does one check for key i % keys; `pids` are its server processes."""

    name = ""
    note = ""
    pids: list[int]
    retries = 0

    async def check(self, i: int) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class RedisPath(Store):
    """The gateway's real Limiter on a client from `redis_client.connect`."""

    def __init__(self, name: str, url: str, pids: list[int], keys: int, note: str = "") -> None:
        self.name, self.pids, self.keys, self.note = name, pids, keys, note
        self.redis = redis_client.connect(url)
        self.limiter = Limiter(self.redis)

    async def check(self, i: int) -> None:
        await self.limiter.admit(f"bench-{i % self.keys}", RPM, TPM, BUDGET_USD, "month", ESTIMATE_USD)

    async def close(self) -> None:
        await self.redis.aclose()


def _gcra(tat_ms: float, now_ms: float, per_minute: int, cost: float) -> tuple[float, float]:
    """Limiter's GCRA on a stored time: (the new theoretical arrival time, ms to wait; 0 when it passes)."""
    interval = 60_000 / per_minute
    tat = max(tat_ms, now_ms)
    new_tat = tat + interval * cost
    return new_tat, max(0.0, new_tat - interval * per_minute - now_ms)


class KvCasPath(Store):
    """The check on a KV entry per key: {rpm TAT, tpm TAT, period, reserved, spent}, CAS-updated."""

    def __init__(self, nc: Any, kv: Any, pids: list[int], keys: int, note: str) -> None:
        self.name, self.nc, self.kv, self.pids, self.keys, self.note = "kv-cas", nc, kv, pids, keys, note

    async def check(self, i: int) -> None:
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        key = f"bench-{i % self.keys}"
        for attempt in range(CAS_TRIES):
            try:
                entry = await self.kv.get(key)
                rev, st = entry.revision, json.loads(entry.value)
            except KeyNotFoundError:
                rev, st = None, {}
            now_ms = time.time() * 1000  # the gateway's clock: KV has no server-side script to read the store's
            _, wait = _gcra(st.get("tpm", 0.0), now_ms, TPM, 0)
            if wait > 0:
                raise Limited("tokens-per-minute", wait / 1000)
            st["rpm"], wait = _gcra(st.get("rpm", 0.0), now_ms, RPM, 1)
            if wait > 0:
                raise Limited("requests-per-minute", wait / 1000)
            pid, _ = period_id("month", now_ms / 1000)
            if st.get("period") != pid:
                st.update(period=pid, reserved=0.0, spent=0.0)
            if st["spent"] + st["reserved"] + ESTIMATE_USD > BUDGET_USD:
                raise Limited("budget", 60)
            st["reserved"] += ESTIMATE_USD
            value = json.dumps(st).encode()
            try:
                if rev is None:
                    await self.kv.create(key, value)
                else:
                    await self.kv.update(key, value, last=rev)
                return
            except KeyWrongLastSequenceError:  # another check wrote it first: read it again, after a jittered
                self.retries += 1  # backoff, or every racer retries at once and they collide again
                await asyncio.sleep(random.uniform(0, min(0.02, 0.0005 * 2**attempt)))
        raise RuntimeError(f"no compare-and-set won in {CAS_TRIES} tries")

    async def close(self) -> None:
        await self.nc.close()


class KvCounterPath(Store):
    """The check on ADR-49 counters: per-minute windows for rpm and tpm, the reservation in micro-dollars."""

    def __init__(self, nc: Any, js: Any, stream: str, pids: list[int], keys: int, note: str) -> None:
        self.name, self.nc, self.js, self.stream, self.pids, self.keys, self.note = (
            "kv-counter",
            nc,
            js,
            stream,
            pids,
            keys,
            note,
        )

    async def _read(self, subject: str) -> int:
        from nats.js.errors import NotFoundError

        try:
            msg = await self.js.get_last_msg(self.stream, subject, direct=True)
        except NotFoundError:
            return 0
        return int(json.loads(msg.data)["val"]) if msg.data else 0

    async def _incr(self, subject: str, by: int) -> int:
        ack = await self.js.publish(subject, b"", headers={"Nats-Incr": str(by)})
        return int(ack.val)

    async def check(self, i: int) -> None:
        name = f"bench-{i % self.keys}"
        now = time.time()
        minute = int(now // 60)
        pid, end = period_id("month", now)
        got = await asyncio.gather(
            self._read(f"rl.{name}.tpm.{minute}"),
            self._incr(f"rl.{name}.rpm.{minute}", 1),
            self._read(f"bud.{name}.spent.{pid}"),
            return_exceptions=True,
        )
        failed = next((x for x in got if isinstance(x, BaseException)), None)
        if failed is not None:
            raise failed
        tokens, requests, spent = got
        if tokens >= TPM:
            raise Limited("tokens-per-minute", 60 - now % 60)
        if requests > RPM:
            raise Limited("requests-per-minute", 60 - now % 60)
        micro = round(ESTIMATE_USD * 1e6)
        reserved = await self._incr(f"bud.{name}.reserved.{pid}", micro)
        if spent + reserved > BUDGET_USD * 1e6:
            await self._incr(f"bud.{name}.reserved.{pid}", -micro)
            raise Limited("budget", end - now)

    async def close(self) -> None:
        await self.nc.close()


async def run_cell(path: Store, rate: float, seconds: float) -> Cell:
    """`rate` checks a second for `seconds`, open-loop; then up to CHECK_TIMEOUT_S for the last ones."""
    cell = Cell(path.name)
    n = max(1, int(rate * seconds))
    pending: set[asyncio.Task] = set()

    async def one(i: int, due: float) -> None:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                await path.check(i)
        except Limited:
            cell.refused += 1
        except TimeoutError:
            cell.errors += 1
            cell.first_error = cell.first_error or f"timed out after {CHECK_TIMEOUT_S:g} s"
            return
        except Exception as exc:  # counted and shown, the run goes on
            cell.errors += 1
            cell.first_error = cell.first_error or f"{type(exc).__name__}: {exc}"[:200]
            return
        cell.latencies_s.append(time.perf_counter() - due)

    # perf_counter, not loop.time(): uvloop's clock has millisecond steps and stands still within a loop turn
    retries0, cpu0, client0 = path.retries, _cpu_s(path.pids), time.process_time()
    t0 = time.perf_counter() + 0.01
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(i, due))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.wait(set(pending), timeout=CHECK_TIMEOUT_S + 1)
    cell.seconds = time.perf_counter() - t0
    late = list(pending)  # none should be left (each has its timeout); none may run on into the next cell
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    cell.errors += len(late)
    cell.server_cpu_s = _cpu_s(path.pids) - cpu0
    cell.client_cpu_s = time.process_time() - client0
    cell.retries = path.retries - retries0
    return cell


async def quiet(pids: list[int], timeout_s: float = 15.0) -> None:
    """Wait until these servers use under a tenth of a core (a backlog from the last cell worked off), so one
    path's leftovers are not charged to the next."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = _cpu_s(pids)
        await asyncio.sleep(0.3)
        if _cpu_s(pids) - before < 0.03:
            return


async def _until(predicate: Callable[[], Awaitable[Any]], timeout_s: float, what: str) -> Any:
    """Poll an async `predicate` until it returns something truthy without raising (a cluster still forming)."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            got = await predicate()
            if got:
                return got
        except Exception as exc:  # remembered for the timeout message
            last = exc
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{what} not ready within {timeout_s}s (last error: {last!r})")


def start_redis(root: Path, stack: contextlib.ExitStack, keys: int) -> list[Store]:
    """The plain redis-server, and a master + replica + sentinel trio."""
    import redis

    plain = stack.enter_context(RedisServer(root / "redis").start(log_file=root / "redis.log"))
    master = stack.enter_context(RedisServer(root / "master").start(log_file=root / "master.log"))
    with redis.Redis(port=master.port) as r:
        r.config_set("repl-diskless-sync-delay", 0)
        replica = stack.enter_context(
            RedisServer(root / "replica", replicaof=f"127.0.0.1:{master.port}").start(log_file=root / "replica.log")
        )
        deadline = time.monotonic() + 30
        while r.info("replication").get("slave0", {}).get("state") != "online":
            if time.monotonic() > deadline:
                raise TimeoutError("the replica did not link to its master within 30 s")
            time.sleep(0.05)
    sentinel = stack.enter_context(
        RedisSentinel(root / "sentinel", f"127.0.0.1:{master.port}").start(log_file=root / "sentinel.log")
    )
    sentinel.wait_replicas(1)
    trio = [master.proc.pid, replica.proc.pid, sentinel.proc.pid]
    return [
        RedisPath("redis", plain.url, [plain.proc.pid], keys),
        RedisPath("sentinel", sentinel.url, trio, keys, "master + 1 replica + 1 sentinel"),
    ]


def start_nats(root: Path, stack: contextlib.ExitStack, replicas: int) -> list[NatsServer]:
    """`replicas` nats-servers routed into one cluster (one alone when 1)."""
    names = [chr(ord("a") + i) for i in range(replicas)]
    routes = {n: f"127.0.0.1:{free_port()}" for n in names}
    servers = []
    for n in names:
        cluster = None
        if replicas > 1:
            cluster = Routes(f"head-{n}", routes[n], tuple(r for m, r in routes.items() if m != n))
        servers.append(NatsServer(root / f"nats-{n}", port=free_port(), cluster=cluster))
    for s in servers:
        stack.enter_context(s.start(log_file=s.data_dir / "nats.log"))
    return servers


@contextlib.asynccontextmanager
async def _admin(server: NatsServer):
    import nats

    nc = await nats.connect(server.url)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


async def _follower(js: Any, stream: str, servers: list[NatsServer]) -> tuple[NatsServer, str]:
    """A server that does not lead `stream`, where the client then connects: on two heads of three a gateway's
    own nats-server is not the leader, so a write crosses a route to it (the first server when there is one)."""

    async def leader_known() -> Any:
        info = await js.stream_info(stream)
        return info if len(servers) == 1 or (info.cluster and info.cluster.leader) else None

    info = await _until(leader_known, 30, f"{stream}'s leader")
    leader = info.cluster.leader if info.cluster else None
    for s in servers:
        if s.cluster is None or s.cluster.name != leader:
            return s, f"client on {s.cluster.name if s.cluster else 'it'}, stream leader {leader or '-'}"
    return servers[0], "client on the leader"


async def nats_paths(servers: list[NatsServer], keys: int, want: set[str]) -> tuple[list[Store], list[str]]:
    import nats
    from nats.js.api import KeyValueConfig, StorageType, StreamConfig

    replicas = len(servers)
    pids = [s.proc.pid for s in servers]
    out: list[Store] = []
    skipped: list[str] = []
    where = f"R{replicas}" + (f" on {replicas} clustered nats-servers" if replicas > 1 else ", one nats-server")
    if "kv-cas" in want:
        async with _admin(servers[0]) as js:
            # direct=False: a get is answered by the leader, so it sees the last write (a direct get may be answered
            # by a lagging follower, and a compare-and-set on what it read then fails over and over)
            await _until(
                lambda: js.create_key_value(
                    KeyValueConfig(
                        bucket="bench_limits", history=1, replicas=replicas, storage=StorageType.FILE, direct=False
                    )
                ),
                60,
                "the KV bucket",
            )
            server, note = await _follower(js, "KV_bench_limits", servers)
        nc = await nats.connect(server.url)
        kv = await nc.jetstream().key_value("bench_limits")
        await _until(lambda: kv.put("warm", b"{}"), 30, "a KV write")
        out.append(KvCasPath(nc, kv, pids, keys, f"{where}; {note}"))
    if "kv-counter" in want:
        nc = await nats.connect(servers[0].url)
        js = nc.jetstream()
        config = StreamConfig(
            name="bench_counters",
            subjects=["rl.>", "bud.>"],
            allow_msg_counter=True,
            allow_direct=True,
            max_msgs_per_subject=1,
            max_age=3 * 86400,
            num_replicas=replicas,
            storage=StorageType.FILE,
        )
        try:
            await _until(lambda: js.add_stream(config), 60, "the counter stream")
            await _until(lambda: js.publish("rl.warm", b"", headers={"Nats-Incr": "1"}), 30, "a counter increment")
        except Exception as exc:  # an older server without counters: said in the report
            skipped.append(f"kv-counter: this nats-server has no counters ({exc})")
            await nc.close()
        else:
            server, note = await _follower(js, "bench_counters", servers)
            await nc.close()
            nc = await nats.connect(server.url)
            out.append(KvCounterPath(nc, nc.jetstream(), "bench_counters", pids, keys, f"{where}; {note}"))
    return out, skipped


def _versions() -> dict[str, str]:
    import importlib.metadata

    def first_line(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return "unknown"

    nats_bin = Path(sys.executable).parent / "nats-server"
    return {
        "redis-server": first_line(["redis-server", "--version"]).split(" sha=")[0],
        "nats-server": first_line([str(nats_bin) if nats_bin.exists() else "nats-server", "--version"]),
        "redis-py": importlib.metadata.version("redis"),
        "nats-py": importlib.metadata.version("nats-py"),
        "python": platform.python_version(),
        "nproc": str(os.cpu_count()),
        "load average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def table(cells: dict[str, list[Cell]], order: list[str], notes: dict[str, str], rate: float) -> str:
    """The markdown table: every path's rounds pooled, latency and CPU also as a ratio to `redis`."""
    rows = {}
    for name in order:
        cs = cells.get(name, [])
        if not cs:
            continue
        lat = [x for c in cs for x in c.latencies_s]
        done = len(lat)
        secs = sum(c.seconds for c in cs)
        rows[name] = {
            "checks": done,
            "rate": done / secs if secs else 0.0,
            "p50": 1e3 * _pct(lat, 50),
            "p99": 1e3 * _pct(lat, 99),
            "max": 1e3 * max(lat) if lat else float("nan"),
            "errors": sum(c.errors for c in cs),
            "refused": sum(c.refused for c in cs),
            "retries": sum(c.retries for c in cs) / done if done else 0.0,
            "cpu": sum(c.server_cpu_s for c in cs),
            "cpu_ms": 1e3 * sum(c.server_cpu_s for c in cs) / done if done else 0,
            "client_ms": 1e3 * sum(c.client_cpu_s for c in cs) / done if done else 0,
            "error": next((c.first_error for c in cs if c.first_error), ""),
        }
    base = rows.get("redis")

    def ratio(name: str, k: str) -> str:
        if not base or not base[k]:
            return "-"
        return f"{rows[name][k] / base[k]:.2f}"

    out = [
        f"Target rate {rate:g} checks/s.",
        "",
        "| path | checks | achieved/s | p50 ms | p99 ms | max ms | errors | CAS retries/check | server CPU s | "
        "server CPU ms/check | client CPU ms/check | p50 vs redis | p99 vs redis | server CPU vs redis | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        note = notes.get(name, "")
        if r["error"]:
            note += f"; first error: {r['error']}"
        if r["refused"]:
            note += f"; {r['refused']} refused"
        out.append(
            f"| {name} | {r['checks']} | {r['rate']:.0f} | {r['p50']:.2f} | {r['p99']:.2f} | {r['max']:.1f} | "
            f"{r['errors']} | {r['retries']:.3f} | {r['cpu']:.2f} | {r['cpu_ms']:.3f} | {r['client_ms']:.3f} | "
            f"{ratio(name, 'p50')} | {ratio(name, 'p99')} | {ratio(name, 'cpu_ms')} | {note.strip('; ')} |"
        )
    return "\n".join(out)


async def run(args: argparse.Namespace) -> int:
    want = [p for p in args.paths.split(",") if p]
    bad = [p for p in want if p not in PATHS]
    if bad:
        raise SystemExit(f"unknown path(s) {', '.join(bad)}: choose from {', '.join(PATHS)}")
    cells: dict[str, list[Cell]] = {}
    with tempfile.TemporaryDirectory(prefix="coderai-redis-ha-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        paths: list[Store] = []
        skipped: list[str] = []
        try:
            if {"redis", "sentinel"} & set(want):
                paths += [p for p in start_redis(root, stack, args.keys) if p.name in want]
            if {"kv-cas", "kv-counter"} & set(want):
                servers = start_nats(root, stack, args.replicas)
                more, skipped = await nats_paths(servers, args.keys, set(want))
                paths += more
            paths.sort(key=lambda p: want.index(p.name))
            for p in paths:  # warm: connections made, scripts loaded, keys and streams written once
                await run_cell(p, args.rate, args.warmup)
            for rnd in range(args.rounds):
                for p in paths if rnd % 2 == 0 else list(reversed(paths)):
                    await quiet([pid for q in paths for pid in q.pids])
                    cell = await run_cell(p, args.rate, args.seconds)
                    cells.setdefault(p.name, []).append(cell)
                    print(
                        f"round {rnd + 1}: {p.name}: {len(cell.latencies_s)} checks, p50 "
                        f"{1e3 * _pct(cell.latencies_s, 50):.2f} ms, {cell.errors} errors",
                        file=sys.stderr,
                    )
        finally:
            for p in paths:
                with contextlib.suppress(Exception):
                    await p.close()
    notes = {p.name: p.note for p in paths}
    print("## Limits check across heads (bench/redis_ha.py)\n")
    print(" ".join(f"{k}: {v};" for k, v in _versions().items()).rstrip(";"))
    print(
        f"\n{args.keys} key(s), {args.rounds} round(s) of {args.seconds:g} s per path, every limit on (rpm, tpm, "
        f"budget), none reached.\n"
    )
    print(table(cells, want, notes, args.rate))
    for s in skipped:
        print(f"\n- skipped {s}")
    if args.json:
        Path(args.json).write_text(json.dumps({k: [vars(c) for c in v] for k, v in cells.items()}))
    errors = sum(c.errors for cs in cells.values() for c in cs)
    return 1 if errors and not args.smoke else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000.0, help="checks a second (default 1000)")
    ap.add_argument("--seconds", type=float, default=10.0, help="per path and round (default 10)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, the order reversed every other one (default 2)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds of unmeasured checks per path first")
    ap.add_argument("--keys", type=int, default=1, help="API keys the checks are spread over (default 1: one hot key)")
    ap.add_argument("--replicas", type=int, default=3, help="nats-servers in the cluster and the KV replicas (1-5)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, from {', '.join(PATHS)}")
    ap.add_argument("--json", help="also write every cell's raw numbers here")
    ap.add_argument("--smoke", action="store_true", help="2 s at 100 checks/s, one round, a short warm-up")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rate, args.seconds, args.rounds, args.warmup = 100.0, 2.0, 1, 0.2
    if not 1 <= args.replicas <= 5 or args.keys < 1 or args.rate <= 0 or args.seconds <= 0:
        ap.error("--replicas 1-5, --keys >= 1, --rate and --seconds > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # the services' own loop (runtime/entry.run): the client's share of the cost is what a gateway pays
        import uvloop
    except ImportError:
        return asyncio.run(run(args))
    return uvloop.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
