"""One leader per singleton (`runtime/leader.py`) on a real nats-server: one holder at a time, a dead holder's lease
lapses and another wins it with a larger fencing token, a holder that steps down hands over at once, and one that
cannot reach the bus stops acting before its lease can lapse at the server."""

from __future__ import annotations

from coderai.contracts.topology import BucketSpec
from coderai.runtime.bus import Bus
from coderai.runtime.leader import Fence, Leader, leaders
from coderai.runtime.lifecycle import wait_for

TTL_S = 2.0


def _pair(bus, unique, **kw):
    spec = BucketSpec(f"test_leaders_{unique}", ttl_s=TTL_S)
    return spec, Leader(bus, "placement", "head-a", spec=spec, **kw), Leader(bus, "placement", "head-b", spec=spec)


async def test_one_holder_at_a_time_and_a_dead_one_is_replaced_with_a_larger_token(bus, unique):
    changes: list[bool] = []
    spec, a, b = _pair(bus, unique, on_change=changes.append)
    a.start()
    await wait_for(lambda: a.held, 10, what="head-a to win")
    b.start()
    first_rev = a._rev

    def renewed_for_two_ttls() -> bool:  # eight renewals of a's: b never wins while a renews
        assert not b.held
        return a._rev >= first_rev + 8

    await wait_for(renewed_for_two_ttls, TTL_S * 6, what="head-a to renew for two TTLs")
    assert b.leader == "head-a"
    [info] = await leaders(await bus.kv(spec), ("placement",))
    assert (info.holder, info.token) == ("head-a", a.token) and info.age_s < TTL_S

    first = a.token
    a._task.cancel()  # a head SIGKILLed: no step-down, its record lapses by the bucket's TTL
    await wait_for(lambda: not a.held, 10, what="head-a to stop acting")
    await wait_for(lambda: b.held, TTL_S * 4, what="head-b to win the lapsed lease")
    assert b.token > first, "a later leader's token is larger"
    fence = Fence()
    assert fence.admits(b.token) and not fence.admits(first), "the old leader's commands are refused"
    assert fence.admits(0), "a writer outside any lease is let through"
    assert changes == [True], "a killed process is told nothing"
    await b.stop()


async def test_stepping_down_hands_over_at_once(bus, unique):
    spec, a, b = _pair(bus, unique)
    a.start()
    await wait_for(lambda: a.held, 10, what="head-a to win")
    b.start()
    await a.stop()
    assert not a.held
    await wait_for(lambda: b.held, TTL_S, what="head-b to win")  # a renewal period, not the TTL
    [info] = await leaders(await bus.kv(spec), ("placement",))
    assert info.holder == "head-b"
    await b.stop()
    [info] = await leaders(await bus.kv(spec), ("placement",))
    assert info.holder == "", "nobody holds a lease its holder gave up"


async def test_a_restarted_process_on_the_same_head_takes_its_own_lease_back(bus, unique):
    spec, a, _ = _pair(bus, unique)
    a.start()
    await wait_for(lambda: a.held, 10, what="head-a to win")
    a._task.cancel()
    again = Leader(bus, "placement", "head-a", spec=spec)
    again.start()
    await wait_for(lambda: again.held, TTL_S / 2, what="the restarted head-a to win")
    assert again.token > a.token
    await again.stop()


async def test_a_holder_cut_off_from_the_bus_stops_acting_before_its_lease_lapses(nats_server, bus, unique):
    spec = BucketSpec(f"test_leaders_{unique}", ttl_s=TTL_S)
    cut = await Bus.connect(nats_server.url, "cut-off")
    changes: list[bool] = []
    a = Leader(cut, "placement", "head-a", spec=spec, on_change=changes.append)
    b = Leader(bus, "placement", "head-b", spec=spec)
    a.start()
    await wait_for(lambda: a.held, 10, what="head-a to win")
    b.start()
    await cut.nc.close()  # its renewals fail from now on
    overlap = []

    def watch() -> bool:
        overlap.append(a.held and b.held)
        return b.held

    await wait_for(watch, TTL_S * 4, what="head-b to win")
    assert not any(overlap), "head-a stopped acting before head-b could win"
    assert not a.held and a.token == 0 and changes == [True, False], "a live process is told it lost the lease"
    await a.stop()
    await b.stop()
