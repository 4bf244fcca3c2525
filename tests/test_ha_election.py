"""Leader election through a real etcd (kvpool.master.ha.election): one leader, growing epochs, fast
hand-over on a clean stop, take-over when the leader's lease lapses, step-down when etcd goes away."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvpool.master.ha.election import DEPOSED, LEADER, STANDBY, Election, parse_endpoints
from tests.etcd_server import etcd  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)

# Time bounds here separate a mechanism from its flaw by several times the mechanism's own time, so that
# a loaded 2-core host cannot break them: a revoked lease hands over within a watch round trip (tens of
# ms) where waiting it out takes the TTL, so the hand-over test uses a long TTL and allows half of it.
HANDOVER_TTL_S = 10


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def test_parse_endpoints() -> None:
    assert parse_endpoints("a:1, http://b:2") == (("a", 1), ("b", 2))
    for bad in ("", "a", "a:", ":1", "a:x", "a:70000"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    with pytest.raises(ValueError):
        Election([("a", 1)], lease_ttl_s=1)


def test_one_leader_then_hand_over_with_a_higher_epoch(etcd) -> None:  # noqa: F811
    led: dict[str, list[int]] = {}
    masters = []
    for i in range(3):
        name = f"m{i}:1"
        masters.append(
            Election(
                parse_endpoints(etcd.endpoint),
                prefix="/t1",
                lease_ttl_s=HANDOVER_TTL_S,
                on_lead=lambda e, n=name: led.setdefault(n, []).append(e),
            )
        )
        masters[-1].start(name)
    try:
        wait_until(lambda: sum(m.is_leader for m in masters) == 1, 10, "one leader")
        wait_until(lambda: all(m.view().leader for m in masters), 10, "every master knows the leader")
        first = next(m for m in masters if m.is_leader)
        v = first.view()
        assert v.epoch > 0 and led == {v.address: [v.epoch]} and v.elections == 1
        assert all(m.view().leader == v.address and m.view().epoch == v.epoch for m in masters)
        assert all(m.role == STANDBY for m in masters if m is not first)
        others = sorted(m.view().address for m in masters if m is not first)
        wait_until(lambda: all(list(m.view().standbys) == others for m in masters), 5, "the standby list")
        t0 = time.monotonic()
        first.stop()  # revokes its lease: a standby takes over within a watch round trip, not the TTL
        rest = [m for m in masters if m is not first]
        wait_until(lambda: sum(m.is_leader for m in rest) == 1, HANDOVER_TTL_S / 2, "a new leader")
        assert time.monotonic() - t0 < HANDOVER_TTL_S / 2
        second = next(m for m in rest if m.is_leader).view()
        assert second.epoch > v.epoch and second.address != v.address
        wait_until(lambda: all(m.view().leader == second.address for m in rest), 5, "the new leader known")
        assert sum(m.view().failovers for m in rest) == 2  # each standby saw one change of leader
    finally:
        for m in masters:
            m.stop()


def test_lapsed_lease_hands_over_and_dead_etcd_deposes(etcd) -> None:  # noqa: F811
    """a's thread freezes for FREEZE_S: it reads DEPOSED (from the clock) before its 2 s lease lapses at
    etcd, and b takes over when it lapses, long before a thaws; with etcd gone, b steps down within the TTL.
    Each order of events is read from the instants the code itself acts on, not from polling."""
    ttl_s, freeze_s = 2, 8.0
    b_led_at: list[float] = []
    a = Election(parse_endpoints(etcd.endpoint), prefix="/t2", lease_ttl_s=ttl_s)
    b = Election(
        parse_endpoints(etcd.endpoint),
        prefix="/t2",
        lease_ttl_s=ttl_s,
        on_lead=lambda _epoch: b_led_at.append(time.monotonic()),
    )
    a.start("a:1")
    wait_until(lambda: a.is_leader, 10, "a leads")
    b.start("b:1")
    wait_until(lambda: b.view().leader == "a:1", 10, "b sees a")
    epoch_a = a.view().epoch
    # a's election thread freezes (as a starved process's would): no keep-alive, no watchdog; its role
    # still reads DEPOSED from the clock before the lease can lapse at etcd
    a._loop.call_soon_threadsafe(time.sleep, freeze_s)
    t0 = time.monotonic()
    a_deposed_at = a._deadline - a._margin_s  # when a's role reads DEPOSED, whatever its thread does
    assert a_deposed_at <= t0 + ttl_s
    wait_until(lambda: a.role == DEPOSED, ttl_s + 3, "a steps down before its lease lapses")
    wait_until(lambda: b.is_leader, ttl_s + 4, "b takes over")
    assert a_deposed_at < b_led_at[0]  # a stepped down first: never two leaders at once
    # the lease lapses within the TTL, etcd reaps it within 0.5 s, b's watch wakes at once: 4 s of margin
    # for a loaded host, and still well before a thaws (freeze_s)
    assert b_led_at[0] - t0 < ttl_s + 4 < freeze_s and b.view().epoch > epoch_a
    wait_until(lambda: a.role == STANDBY and a.view().leader == "b:1", freeze_s + 6, "a rejoins as a standby")
    etcd.stop()  # no etcd: the leader cannot keep its lease, so it steps down within the TTL
    t1 = time.monotonic()
    # b's role reads DEPOSED from its own clock at this instant, whether or not its thread runs
    assert b._deadline - b._margin_s <= t1 + ttl_s
    wait_until(lambda: b.role == DEPOSED, ttl_s + 3, "b steps down")
    assert a.role != LEADER
    a.stop()
    b.stop()


def test_a_deposed_leader_ends_its_own_stale_key_and_campaigns_again(etcd) -> None:  # noqa: F811
    """Keep-alives past due (as after a stall shorter than etcd's TTL): the master stops leading at once;
    its old key, still alive at etcd under the old lease, is revoked instead of waited out: it leads again
    at its next keep-alive round (TTL / 3), before the old lease could lapse (at least 2/3 of the TTL
    away, seconds of margin for a loaded host); waiting it out would lead only after that instant."""
    ttl_s = 12
    led_at: list[float] = []
    a = Election(
        parse_endpoints(etcd.endpoint),
        prefix="/t3",
        lease_ttl_s=ttl_s,
        on_lead=lambda _epoch: led_at.append(time.monotonic()),
    )
    a.start("a:1")
    try:
        wait_until(lambda: a.is_leader, 10, "a leads")
        e1 = a.view().epoch
        old_expiry = a._deadline  # etcd keeps the old lease, and the key under it, at least until then
        a._loop.call_soon_threadsafe(setattr, a, "_deadline", 0.0)  # no keep-alive answered in time
        wait_until(lambda: a.role != LEADER, 1, "a stops leading at once")
        wait_until(lambda: a.is_leader and a.view().epoch > e1, ttl_s, "a leads again under a new key")
        assert len(led_at) == 2 and led_at[1] < old_expiry and a.view().elections == 2
    finally:
        a.stop()
