"""Bounded master state (issue 24 part 3), over time: idle namespaces expire and come back on
registration, model activation survives expiry, and 1,000 flush / re-register / version-switch cycles or
10,000 distinct salts leave O(1) state (namespace records, index namespace slots, blocks, leases,
reservations) and little RSS growth. A real `Master` with its real maintenance tick and an injected clock;
a smaller run of the flush cycles goes over gRPC.
"""

from __future__ import annotations

from pathlib import Path

from kvpool.client import MasterClient
from kvpool.master.core import Master
from kvpool.master.maintenance import Maintenance
from kvpool.types import FakeClock, NamespaceId
from tests.tenant_files import write_private
from tests.test_master_bounded_state import EXPIRY_MS, FP, chain, put, rss_bytes, served, settings

MIB = 1 << 20


def register(m: Master, salt: str = "", model: str = "m", version: str = "v1") -> bytes:
    ns, _ = m.register_namespace(
        model_id=model,
        weights_version=version,
        layout_fingerprint=FP,
        cache_salt=salt,
        adapter_digest="",
        extra={},
    )
    return ns


def counts(m: Master) -> dict[str, int]:
    with m.lock:
        return {
            "namespaces": len(m.namespaces),
            "index_namespaces": m.index.num_namespaces,
            "index_slots": m.index.num_namespace_slots,
            "blocks": m.index.num_blocks,
            "leases": m.index.num_live_leases,
            "reservations": len(m.publisher.reservations),
        }


def test_idle_namespace_expires_and_registering_recreates_it() -> None:
    clock = FakeClock(1_000_000)
    m = Master(settings(), clock=clock)
    maint = Maintenance(m)
    idle = register(m, "idle")
    used = register(m, "used")
    full = register(m, "full")
    m.set_model_version("m", "v2", force=True)  # explicit activation: v1 namespaces are fenced now
    assert not m.namespaces.is_active(idle)
    m.set_model_version("m", "v1")  # and back: they start again empty
    put(m, full, chain(full, 0, 2))
    clock.advance(EXPIRY_MS - 1000)
    m.match(used, chain(used, 0, 1), count_hit=True, lease_ttl_ms=0, num_prompt_tokens=0)
    clock.advance(1001)
    maint.tick()
    assert not m.namespaces.is_known(idle)  # idle, no blocks: forgotten
    assert m.namespaces.is_known(used) and m.namespaces.is_known(full)  # matched lately / holds blocks
    assert m.namespaces.active_version("m") == "v1"  # activation outlives its namespaces
    assert register(m, "idle") == idle and m.namespaces.is_active(idle)  # simply recreated
    assert m.index.num_blocks_in(NamespaceId(full)) == 2
    m.index.check_invariants()


def test_1000_flush_and_version_cycles_leave_o1_state() -> None:
    clock = FakeClock(1_000_000)
    m = Master(settings(), clock=clock)
    maint = Maintenance(m)
    ns = register(m)
    hashes = chain(ns, 0, 4)
    before: dict[str, int] = {}
    rss0 = 0
    for i in range(1000):
        put(m, ns, hashes, slot0=4 * i)
        res, _ = m.match(ns, hashes, count_hit=True, lease_ttl_ms=1000, num_prompt_tokens=0)
        assert res.num_matched == 4 and res.lease_id
        m.release_lease(res.lease_id)
        if i % 2:
            m.invalidate_namespace(ns)  # a flush: the namespace starts again empty
        else:
            m.set_model_version("m", "v2", force=True)  # a version switch and back
            m.set_model_version("m", "v1")
        clock.advance(10)
        maint.tick()  # reclaims the flushed blocks
        if i == 9:
            before, rss0 = counts(m), rss_bytes()
    after = counts(m)
    assert after == before, (before, after)
    assert after["index_slots"] <= 2 and after["namespaces"] == 1 and after["blocks"] == 0
    assert rss_bytes() - rss0 < 50 * MIB
    m.index.check_invariants()


def test_10000_salts_expire_and_their_slots_are_reused() -> None:
    clock = FakeClock(1_000_000)
    m = Master(settings(), clock=clock)
    maint = Maintenance(m)
    rss0 = rss_bytes()
    for round_ in range(2):
        for i in range(10_000):
            ns = register(m, f"tenant/{round_}-{i}")
            if i % 100 == 0:
                put(m, ns, chain(ns, 0, 1), slot0=i)
                m.invalidate_namespace(ns)
        maint.tick()
        slots = counts(m)["index_slots"]
        assert counts(m)["namespaces"] == 10_000
        clock.advance(EXPIRY_MS + 1)
        maint.tick()
        assert counts(m)["namespaces"] == counts(m)["index_namespaces"] == 0
    # 10,000 active + the 100 flushed awaiting reclamation at the peak; the second round reused them all
    assert slots <= 10_100 and counts(m)["index_slots"] == slots
    assert rss_bytes() - rss0 < 50 * MIB
    m.index.check_invariants()


def test_tenant_usage_counts_stay_exact_through_flushes(tmp_path: Path) -> None:
    tenants = write_private(
        tmp_path / "tenants.toml",
        '[[tenants]]\nname = "a"\napi_keys = ["k"]\ncache_salt = "sa"\npool_quota_blocks = 64\n',
    )
    clock = FakeClock(1_000_000)
    m = Master(settings(tenants=str(tenants)), clock=clock)
    maint = Maintenance(m)
    a1, a2, other = register(m, "sa"), register(m, "sa/sub"), register(m, "sb")
    for cycle in range(50):
        put(m, a1, chain(a1, 0, 3), slot0=10 * cycle)
        put(m, a2, chain(a2, 0, 2), slot0=10 * cycle + 5)
        put(m, other, chain(other, 0, 4), slot0=10 * cycle + 1000)
        assert m.quotas.usage(m, "sa") == 5
        m.invalidate_namespace(a1 if cycle % 2 else other)
        assert m.quotas.usage(m, "sa") == (2 if cycle % 2 else 5)
        m.invalidate_namespace(a2)
        m.invalidate_namespace(a1)
        m.invalidate_namespace(other)
        maint.tick()
        assert m.quotas.usage(m, "sa") == 0
        m.index.check_invariants()
    assert len(m.quotas._reserved) == 1  # per tenant of the file, never per namespace


def test_flush_cycles_over_grpc_leave_o1_state() -> None:
    clock = FakeClock(1_000_000)
    for server in served(settings(), clock):
        m = server.master
        with MasterClient(server.address) as c:
            before: dict[str, int] = {}
            for i in range(100):
                ns, _ = c.register_namespace("g", "v1", FP, cache_salt="s")
                hashes = chain(ns, 0, 2)
                put(m, ns, hashes, slot0=2 * i)
                match = c.match(ns, hashes, lease_ttl_ms=1000)
                assert match.num_matched == 2
                c.release_lease(match.lease_id)
                c.invalidate(ns)
                with m.lock:
                    Maintenance(m).tick()
                if i == 4:
                    before = counts(m)
            assert counts(m) == before
