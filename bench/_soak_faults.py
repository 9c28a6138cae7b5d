"""The soak's faults (bench/soak.py): a seeded schedule of them, each injected and healed in turn, and the
watch that restarts nats-server once its store failed on a full disk, as `coderai up` does."""

from __future__ import annotations

import os
import signal
import sys
import time

from _soak_clients import Fault


class Faults:
    """Mixed into `Soak`: uses its stack, servers, link, disk, rng and stop event, and records into its `faults`,
    `restarted` and `store_restarts`."""

    def schedule(self) -> list[str]:
        """Each kind once in a seeded order, then seeded random picks for the rest of the run."""
        kinds = list(self.a.faults)
        self.rng.shuffle(kinds)
        return kinds

    def run_faults(self, end: float) -> None:
        order = self.schedule()
        i = 0
        while not self.stop.is_set():
            kind = order[i] if i < len(order) else self.rng.choice(self.a.faults)
            if i >= len(order) and time.monotonic() + self.hold(kind) + self.a.gap_s > end:
                return
            self.inject(kind)
            i += 1
            if self.stop.wait(self.a.gap_s):
                return

    def hold(self, kind: str) -> float:
        return {"stop-worker": self.a.stop_s, "slow-link": 15.0, "disk-full": 10.0}.get(kind, 2.0)

    def inject(self, kind: str) -> None:
        worker = self.rng.choice(["w1", "w2"])
        f = Fault(
            kind,
            worker
            if kind in ("kill-worker", "stop-worker")
            else {
                "nats": "nats-server",
                "redis": "redis-server",
                "gateway": "gateway",
                "slow-link": "w2 link",
                "disk-full": "data dir",
            }[kind],
            time.monotonic(),
        )
        print(f"[soak] {time.strftime('%H:%M:%S')} fault {kind} on {f.target}", file=sys.stderr, flush=True)
        hold = self.hold(kind)
        if kind == "kill-worker":
            p = self.stack.procs[f"worker-{worker}"]
            p.kill()
            self.stop.wait(hold)
            p.start()
            self.restarted.add(f"worker-{worker}")
        elif kind == "stop-worker":
            pid = self.stack.procs[f"worker-{worker}"].proc.pid
            os.killpg(pid, signal.SIGSTOP)
            try:
                self.stop.wait(hold)
            finally:
                os.killpg(pid, signal.SIGCONT)
        elif kind == "nats":
            with self.nats_lock:
                self.nats.kill()
                self.stop.wait(hold)
                self.nats.start(log_file=self.root / "logs" / "nats.log")
            self.restarted.add("nats-server")
        elif kind == "redis":
            self.redis.kill()
            self.stop.wait(hold)
            self.redis.start(log_file=self.root / "logs" / "redis.log")
            self.restarted.add("redis-server")
        elif kind == "gateway":
            self.stack.procs["gateway"].kill()
            self.stack.procs["gateway"].start()
            f.t1 = time.monotonic()  # the restart is the fault's end: its boot time counts as recovery
            self.restarted.add("gateway")
            self.start_gateway()
        elif kind == "slow-link":
            if self.netem:
                self.link.netem(200, 50, 5.0)
            else:
                self.link.drop(5.0)
                self.relay.set_delay(0.2, 0.05)
            f.detail = "netem" if self.netem else "nftables loss + delaying relay"
            try:
                self.stop.wait(hold)
            finally:
                self.link.heal()
                self.relay.set_delay(0.0)
        elif kind == "disk-full":
            f.detail = f"{self.disk.fill() >> 20} MiB written"
            try:
                self.stop.wait(hold)
            finally:
                self.disk.free()
        f.t1 = f.t1 or time.monotonic()
        self.faults.append(f)

    def keep_store(self) -> None:
        """What `coderai up` does for its nats-server (`up.keep_up`): restart it once its JetStream store failed
        on the full disk and there is room again. Runs for the whole soak (the server dies with the thread that
        started it)."""
        while not self.done.wait(0.5):
            with self.nats_lock:
                if self.store.due():
                    self.nats.stop()
                    self.nats.start(log_file=self.root / "logs" / "nats.log")
                    self.store.restarted()
                    self.store_restarts.append(time.monotonic())
                    self.restarted.add("nats-server")
