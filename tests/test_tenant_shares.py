"""Quotas that protect (issue #46, item 8): when the pool is full, tenants over their share go first.

A real master (tenants file with pool quotas, one replica, watermarks off so only the publish path
evicts) and one real store of 64 slots. Tenant "a" has quota 60 and "b" quota 20: together more than
the pool, so their shares are scaled to 48 and 16 (`TenantQuotas.shares`). Namespace "c" has no quota
(no share). Tenant b writes its 16 blocks first, c writes 8, then a fills the pool and keeps writing:
c's blocks go first (no share), then a's own oldest ones; b, at its share, keeps every block, although
its blocks are the pool's least recently used. The store's watermark eviction (in the background) goes
by the same shares.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.errors import ResourceExhausted
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, Proc, start
from kvpool.types import BlockHash, KVLayout
from tests.capabilities import require_ucx
from tests.tenant_files import write_private
from tests.test_master_cluster import wait_stores

LAY = KVLayout.from_fingerprint(LAYOUT)
NUM_SLOTS = 64
transfer = pytest.importorskip("transfer")

TENANTS = """
[[tenants]]
name = "a"
api_keys = ["key-a"]
cache_salt = "salt-a"
pool_quota_blocks = 60

[[tenants]]
name = "b"
api_keys = ["key-b"]
cache_salt = "salt-b"
pool_quota_blocks = 20
"""


def _start_pool(directory: Path, tenants: str, **env: str) -> tuple[Proc, Proc]:
    require_ucx()
    tfile = write_private(directory / "tenants.toml", tenants)
    m = start(["master", "--port", "0", "--layout", LAYOUT], env={"KVPOOL_TENANTS": str(tfile)} | env)
    try:
        store = start(
            ["store", "--master", m.grpc_address, "--listen", "127.0.0.1", "--grpc-port", "0",
             "--data-port", "0", "--segment-size", f"{NUM_SLOTS * LAY.block_nbytes}", "--layout", LAYOUT,
             "--node-id", "only", "--pin-memory", "off"]
        )  # fmt: skip
    except BaseException:
        m.kill()
        raise
    try:
        wait_stores(m.grpc_address, 1)
    except BaseException:
        store.kill()
        m.kill()
        raise
    return m, store


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    # watermarks off: only the publish path evicts
    m, store = _start_pool(
        tmp_path_factory.mktemp("shares"), TENANTS, KVPOOL_HIGH_WATERMARK="1.0", KVPOOL_LOW_WATERMARK="1.0"
    )
    try:
        yield m
    finally:
        store.kill()
        m.kill()


def chain(ns: bytes, start_token: int, n: int) -> list[BlockHash]:
    return hash_blocks(ns, list(range(start_token, start_token + n * LAY.block_size)), LAY.block_size)


def data(n: int) -> list[np.ndarray]:
    return [np.full(LAY.block_nbytes, i, dtype=np.uint8) for i in range(n)]


def test_a_tenant_filling_the_pool_evicts_its_own_blocks_and_spares_one_under_its_share(pool: Proc) -> None:
    master = pool.grpc_address
    transport = transfer.UcxTransport()
    try:
        with MasterClient(master) as c, PoolClient(master, transport, block_nbytes=LAY.block_nbytes) as pc:
            ns_a, _ = c.register_namespace("shares", "v1", LAYOUT, cache_salt="salt-a")
            ns_b, _ = c.register_namespace("shares", "v1", LAYOUT, cache_salt="salt-b")
            ns_c, _ = c.register_namespace("shares", "v1", LAYOUT, cache_salt="no-quota")

            def resident(ns: bytes, chains: list[list[BlockHash]]) -> int:
                return sum(c.match(ns, h).num_matched for h in chains)

            b_chains = [chain(ns_b, 1_000 * i, 4) for i in range(4)]  # 16 blocks: b's share
            for h in b_chains:
                assert pc.put_blocks(ns_b, None, h, data(4)).num_committed == 4
            c_chains = [chain(ns_c, 1_000 * i, 4) for i in range(2)]  # 8 blocks, no share
            for h in c_chains:
                assert pc.put_blocks(ns_c, None, h, data(4)).num_committed == 4
            a_chains = [chain(ns_a, 1_000 * i, 4) for i in range(15)]  # 60 blocks: a's quota
            for i, h in enumerate(a_chains):
                assert pc.put_blocks(ns_a, None, h, data(4)).num_committed == 4
                assert resident(ns_b, b_chains) == 16, f"after a's chain {i}"  # b keeps its share
                assert c.match(ns_a, h).num_matched == 4
            assert resident(ns_c, c_chains) == 0  # no share: evicted before a's own blocks
            assert resident(ns_a, a_chains) == NUM_SLOTS - 16  # a's share, 48
            assert [c.match(ns_a, h).num_matched for h in a_chains[:3]] == [0, 0, 0]  # its oldest went
            assert c.stats().num_blocks == NUM_SLOTS

            # with all of a's blocks leased, a's next write is refused rather than take b's
            leases = [c.match(ns_a, h, lease_ttl_ms=60_000) for h in a_chains[3:]]
            with pytest.raises(ResourceExhausted):
                pc.put_blocks(ns_a, None, chain(ns_a, 90_000, 4), data(4))
            assert resident(ns_b, b_chains) == 16
            for lease in leases:
                if lease.lease_id:
                    c.release_lease(lease.lease_id)
    finally:
        transport.close()


def test_watermark_eviction_goes_by_shares(tmp_path: Path) -> None:
    """Quotas 40 and 16 fit the pool (shares = quotas). b writes 16, the quota-less namespace 32, a 8:
    past the 0.75 high watermark, the background eviction (down to 0.5) takes only the quota-less
    namespace's blocks, none of a's or b's, although b's are the least recently used."""
    tenants = TENANTS.replace("= 60", "= 40").replace("= 20", "= 16")
    m, store = _start_pool(tmp_path, tenants, KVPOOL_HIGH_WATERMARK="0.75", KVPOOL_LOW_WATERMARK="0.5")
    transport = transfer.UcxTransport()
    try:
        master = m.grpc_address
        with MasterClient(master) as c, PoolClient(master, transport, block_nbytes=LAY.block_nbytes) as pc:
            ns = {
                salt: c.register_namespace("shares", "v1", LAYOUT, cache_salt=salt)[0]
                for salt in ("salt-a", "salt-b", "no-quota")
            }
            chains = {
                "salt-b": [chain(ns["salt-b"], 1_000 * i, 4) for i in range(4)],
                "no-quota": [chain(ns["no-quota"], 1_000 * i, 4) for i in range(8)],
                "salt-a": [chain(ns["salt-a"], 1_000 * i, 4) for i in range(2)],
            }
            for salt, cs in chains.items():  # b first: the least recently used
                for h in cs:
                    assert pc.put_blocks(ns[salt], None, h, data(4)).num_committed == 4

            def resident(salt: str) -> int:
                return sum(c.match(ns[salt], h).num_matched for h in chains[salt])

            deadline = time.monotonic() + 30  # the maintenance tick evicts in the background
            while c.stats().num_evictions == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            stats = c.stats()
            assert stats.num_evictions > 0 and stats.num_blocks <= NUM_SLOTS * 3 // 4
            assert resident("salt-b") == 16 and resident("salt-a") == 8  # at or under their shares
            assert resident("no-quota") == 32 - stats.num_evictions == stats.num_blocks - 24
    finally:
        transport.close()
        store.kill()
        m.kill()
