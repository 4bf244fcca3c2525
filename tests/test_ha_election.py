"""Leader election through a real etcd (kvpool.master.ha.election): one leader, growing epochs, fast
hand-over on a clean stop, take-over when the leader's lease lapses, step-down when etcd goes away."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvpool.master.ha.election import DEPOSED, LEADER, STANDBY, Election, parse_endpoints
from tests.etcd_server import etcd  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(60)


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
                lease_ttl_s=2,
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
        first.stop()  # revokes its lease: a standby takes over within a watch round trip
        rest = [m for m in masters if m is not first]
        wait_until(lambda: sum(m.is_leader for m in rest) == 1, 5, "a new leader")
        assert time.monotonic() - t0 < 1.5
        second = next(m for m in rest if m.is_leader).view()
        assert second.epoch > v.epoch and second.address != v.address
        wait_until(lambda: all(m.view().leader == second.address for m in rest), 5, "the new leader known")
        assert sum(m.view().failovers for m in rest) == 2  # each standby saw one change of leader
    finally:
        for m in masters:
            m.stop()


def test_lapsed_lease_hands_over_and_dead_etcd_deposes(etcd) -> None:  # noqa: F811
    a = Election(parse_endpoints(etcd.endpoint), prefix="/t2", lease_ttl_s=2)
    b = Election(parse_endpoints(etcd.endpoint), prefix="/t2", lease_ttl_s=2)
    a.start("a:1")
    wait_until(lambda: a.is_leader, 10, "a leads")
    b.start("b:1")
    wait_until(lambda: b.view().leader == "a:1", 10, "b sees a")
    epoch_a = a.view().epoch
    # a's election thread freezes (as a starved process's would): no keep-alive, no watchdog; its role
    # still reads DEPOSED from the clock before the lease can lapse at etcd
    a._loop.call_soon_threadsafe(time.sleep, 3.5)
    t0 = time.monotonic()
    wait_until(lambda: a.role == DEPOSED, 3, "a steps down before its lease lapses")
    assert not b.is_leader  # a stepped down first: never two leaders at once
    wait_until(lambda: b.is_leader, 6, "b takes over")
    assert time.monotonic() - t0 < 2 + 1.5 and b.view().epoch > epoch_a
    wait_until(lambda: a.role == STANDBY and a.view().leader == "b:1", 6, "a rejoins as a standby")
    etcd.stop()  # no etcd: the leader cannot keep its lease, so it steps down within the TTL
    t1 = time.monotonic()
    wait_until(lambda: b.role == DEPOSED, 3, "b steps down")
    assert time.monotonic() - t1 <= 2.0
    assert a.role != LEADER
    a.stop()
    b.stop()


def test_a_deposed_leader_ends_its_own_stale_key_and_campaigns_again(etcd) -> None:  # noqa: F811
    """Keep-alives past due (as after a stall shorter than etcd's TTL): the master stops leading at once;
    its old key, still alive at etcd under the old lease, is revoked instead of waited out (TTL 6 s)."""
    a = Election(parse_endpoints(etcd.endpoint), prefix="/t3", lease_ttl_s=6)
    a.start("a:1")
    try:
        wait_until(lambda: a.is_leader, 10, "a leads")
        e1 = a.view().epoch
        a._loop.call_soon_threadsafe(setattr, a, "_deadline", 0.0)  # no keep-alive answered in time
        wait_until(lambda: a.role != LEADER, 1, "a stops leading at once")
        t0 = time.monotonic()
        wait_until(lambda: a.is_leader and a.view().epoch > e1, 4, "a leads again under a new key")
        assert time.monotonic() - t0 < 4 and a.view().elections == 2  # well before the old lease's 6 s
    finally:
        a.stop()
