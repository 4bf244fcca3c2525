"""Per-tenant pool quotas (issue #12) against a real master and two real store nodes.

Tenant A (quota 8 blocks) publishes beyond its quota: its resident blocks never pass 8, its own least
recently used leaves make room, its leased blocks are never evicted (a publish that cannot fit is refused
with `ResourceExhausted`), and tenant B (no quota) is unaffected.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.errors import InvalidArgument, ResourceExhausted
from kvpool.hashing import hash_blocks
from kvpool.index import RadixIndex
from kvpool.master.procs import LAYOUT, Proc, start, start_store
from kvpool.tenants import Tenants, tenant_id, tenant_salt
from kvpool.types import BlockHash, FakeClock, KVLayout, Location, NamespaceId
from tests.capabilities import require_ucx
from tests.tenant_files import write_private
from tests.test_master_cluster import wait_stores

LAY = KVLayout.from_fingerprint(LAYOUT)
QUOTA_BLOCKS = 8
transfer = pytest.importorskip("transfer")

TENANTS = f"""
[[tenants]]
name = "a"
api_keys = ["key-a"]
cache_salt = "salt-a"
pool_quota_blocks = {QUOTA_BLOCKS}

[[tenants]]
name = "b"
api_keys = ["key-b"]
cache_salt = "salt-b"
"""


@pytest.fixture(scope="module")
def master_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    require_ucx()
    tfile = write_private(Path(tmp_path_factory.mktemp("quota")) / "tenants.toml", TENANTS)
    m = start(["master", "--port", "0", "--layout", LAYOUT], env={"KVPOOL_TENANTS": str(tfile)})
    stores: list[Proc] = []
    try:
        stores = [start_store(m.grpc_address, f"q{i}") for i in range(2)]
        wait_stores(m.grpc_address, 2)
        yield m
    finally:
        for s in stores:
            s.kill()
        m.kill()


def _value(text: str, name: str) -> float:
    return next(float(x.split()[1]) for x in text.splitlines() if x.startswith(name + " "))


def chain(ns: bytes, start_token: int, n: int) -> list[BlockHash]:
    return hash_blocks(ns, list(range(start_token, start_token + n * LAY.block_size)), LAY.block_size)


def data(n: int) -> list[np.ndarray]:
    return [np.full(LAY.block_nbytes, i, dtype=np.uint8) for i in range(n)]


def test_quota_bounds_a_tenant_and_spares_the_others(master_proc: Proc) -> None:
    master = master_proc.grpc_address
    transport = transfer.UcxTransport()
    with MasterClient(master) as c, PoolClient(master, transport, block_nbytes=LAY.block_nbytes) as pc:
        ns_a, _ = c.register_namespace("quota", "v1", LAYOUT, cache_salt="salt-a")
        ns_a_sub, _ = c.register_namespace("quota", "v1", LAYOUT, cache_salt="salt-a/sub")
        ns_b, _ = c.register_namespace("quota", "v1", LAYOUT, cache_salt="salt-b")
        b_chain = chain(ns_b, 0, 20)
        assert pc.put_blocks(ns_b, None, b_chain, data(20)).num_committed == 20

        a_chains = [chain(ns_a, 10_000 * i, 4) for i in range(6)]

        def resident_a() -> int:
            return sum(c.match(ns_a, h).num_matched for h in a_chains)

        for i, hashes in enumerate(a_chains):
            assert pc.put_blocks(ns_a, None, hashes, data(4)).num_committed == 4
            assert resident_a() <= QUOTA_BLOCKS
            assert c.match(ns_a, hashes).num_matched == 4  # the newest chain is whole
            assert c.match(ns_b, b_chain).num_matched == 20  # tenant B untouched
            if i >= 1:
                assert resident_a() == QUOTA_BLOCKS
        # the oldest chains made room (LRU over the tenant's own leaves)
        assert [c.match(ns_a, h).num_matched for h in a_chains] == [0, 0, 0, 0, 4, 4]

        # leased blocks are never evicted for the quota: with all 8 leased, a new publish is refused
        leases = [c.match(ns_a, h, lease_ttl_ms=60_000) for h in a_chains[4:]]
        assert all(m.num_matched == 4 and m.lease_id for m in leases)
        with pytest.raises(ResourceExhausted):
            pc.put_blocks(ns_a, None, chain(ns_a, 90_000, 4), data(4))
        assert [c.match(ns_a, h).num_matched for h in a_chains[4:]] == [4, 4]
        for m in leases:
            assert m.lease_id is not None
            c.release_lease(m.lease_id)

        # a client sub-salt shares its tenant's quota
        sub = chain(ns_a_sub, 0, 4)
        assert pc.put_blocks(ns_a_sub, None, sub, data(4)).num_committed == 4
        assert resident_a() + c.match(ns_a_sub, sub).num_matched == QUOTA_BLOCKS

        # one publish larger than the whole quota is refused outright
        with pytest.raises(ResourceExhausted):
            pc.put_blocks(ns_a, None, chain(ns_a, 70_000, QUOTA_BLOCKS + 1), data(QUOTA_BLOCKS + 1))
        assert c.match(ns_b, b_chain).num_matched == 20
        assert c.stats().num_blocks == 20 + QUOTA_BLOCKS
    metrics = httpx.get(f"http://{master_proc.ready['metrics_address']}/metrics").text
    a, b = tenant_id("salt-a"), tenant_id("salt-b")  # by opaque id: /metrics names no tenant
    assert f'kvpool_master_tenant_pool_blocks{{tenant="{a}"}} 8.0' in metrics
    assert f'kvpool_master_tenant_pool_quota_blocks{{tenant="{a}"}} 8.0' in metrics
    assert f'tenant="{b}"' not in metrics  # no quota, no per-tenant series
    assert _value(metrics, "kvpool_master_tenant_quota_evictions_total") >= 12
    assert _value(metrics, "kvpool_master_tenant_quota_refusals_total") == 2
    transport.close()


# ---- pure pieces: the index's namespace-restricted eviction, the tenants file ----------------------


def _index_with_two_tenants() -> tuple[RadixIndex, FakeClock, NamespaceId, NamespaceId]:
    clock = FakeClock(1_000)
    index = RadixIndex(clock=clock, policy="lru")
    a, b = NamespaceId(b"A" * 16), NamespaceId(b"B" * 16)
    for ns in (a, b):
        index.register_namespace(ns)
    for i in range(4):  # interleaved, so the global LRU order alternates tenants
        for ns, node in ((a, "s0"), (b, "s1")):
            clock.advance(10)
            index.insert(
                ns,
                [BlockHash(i.to_bytes(16, "big"))],
                parent=None,
                locations=[[Location(node, i, 1)]],
                size_bytes=1,
            )
    return index, clock, a, b


def test_index_evicts_only_the_given_namespaces_and_never_leased_leaves() -> None:
    index, _, a, b = _index_with_two_tenants()
    assert index.num_blocks_in(a) == index.num_blocks_in(b) == 4
    leased = index.match_prefix(a, [BlockHash((0).to_bytes(16, "big"))], count_hit=False, lease_ttl_ms=60_000)
    assert leased.num_matched == 1
    res = index.evict(10, namespaces=[a])
    assert {bytes(d.ns) for d in res.dropped} == {bytes(a)}
    assert len(res.dropped) == 3 and res.shortfall == 7  # the leased block stays
    assert index.num_blocks_in(a) == 1 and index.num_blocks_in(b) == 4
    index.check_invariants()
    index.invalidate_namespace(b)
    assert index.num_blocks_in(b) == 0  # an invalidated namespace counts nothing
    assert index.evict(1, namespaces=[b]).dropped == []


def test_tenants_file_pool_quotas(tmp_path: Path) -> None:
    f = write_private(tmp_path / "t.toml", TENANTS)
    quotas = Tenants.load(f).with_pool_quota()
    assert {s: t.pool_quota_blocks for s, t in quotas.items()} == {"salt-a": QUOTA_BLOCKS}
    assert tenant_salt("salt-a/0123") == tenant_salt("salt-a") == "salt-a"
    f.write_text('[[tenants]]\nname = "x"\napi_keys = ["k"]\ncache_salt = "a/b"\n')
    with pytest.raises(InvalidArgument, match="must not contain"):
        Tenants.load(f)
    f.write_text('[[tenants]]\nname = "x"\napi_keys = ["k"]\npool_quota_blocks = 0\n')
    with pytest.raises(InvalidArgument, match="pool_quota_blocks"):
        Tenants.load(f)
