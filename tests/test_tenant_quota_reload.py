"""The master re-reads the tenants file when it changes (issue #46): a real master process and store.

A quota lowered, a quota given to a tenant that had none (its existing blocks count against it at once),
a broken edit (the previous quotas stay), and an edit after it (taken again): /metrics and `Reserve`
follow each within seconds, with no restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.master.procs import LAYOUT, Proc, start, start_store
from kvpool.tenants import tenant_id
from kvpool.types import KVLayout
from tests.capabilities import require_ucx
from tests.tenant_files import write_private
from tests.test_master_cluster import wait_stores
from tests.test_tenant_quotas import chain, data

LAY_BLOCK_NBYTES = KVLayout.from_fingerprint(LAYOUT).block_nbytes
transfer = pytest.importorskip("transfer")


def _tenants(quota_a: int, quota_b: int | None) -> str:
    b = f"pool_quota_blocks = {quota_b}\n" if quota_b is not None else ""
    return (
        f'[[tenants]]\nname = "a"\napi_keys = ["key-a"]\ncache_salt = "salt-a"\npool_quota_blocks = {quota_a}\n'
        f'\n[[tenants]]\nname = "b"\napi_keys = ["key-b"]\ncache_salt = "salt-b"\n{b}'
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Proc, Path]]:
    require_ucx()
    tfile = write_private(tmp_path / "tenants.toml", _tenants(8, None))
    m = start(["master", "--port", "0", "--layout", LAYOUT], env={"KVPOOL_TENANTS": str(tfile)})
    store = None
    try:
        store = start_store(m.grpc_address, "r0")
        wait_stores(m.grpc_address, 1)
        yield m, tfile
    finally:
        if store is not None:
            store.kill()
        m.kill()


def _metrics(m: Proc) -> str:
    return httpx.get(f"http://{m.ready['metrics_address']}/metrics", timeout=10).text


def _until(m: Proc, *lines: str, timeout_s: float = 30.0) -> str:
    """/metrics once it holds every one of `lines` (polled; the master looks at the file every 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _metrics(m)
        if all(x in text for x in lines):
            return text
        assert time.monotonic() < deadline, f"/metrics never showed {lines}:\n{text[-3000:]}"
        time.sleep(0.2)


def test_the_master_follows_tenants_file_edits(cluster: tuple[Proc, Path]) -> None:
    m, tfile = cluster
    a, b = tenant_id("salt-a"), tenant_id("salt-b")
    quota = "kvpool_master_tenant_pool_quota_blocks{tenant="
    used = "kvpool_master_tenant_pool_blocks{tenant="
    transport = transfer.UcxTransport()
    try:
        with (
            MasterClient(m.grpc_address) as c,
            PoolClient(m.grpc_address, transport, block_nbytes=LAY_BLOCK_NBYTES) as pc,
        ):
            ns_b, _ = c.register_namespace("reload", "v1", LAYOUT, cache_salt="salt-b")
            b_chains = [chain(ns_b, 10_000 * i, 3) for i in range(2)]
            for hashes in b_chains:  # 6 blocks: b has no quota yet
                assert pc.put_blocks(ns_b, None, hashes, data(3)).num_committed == 3
            text = _until(m, f'{quota}"{a}"}} 8.0')
            assert f'tenant="{b}"' not in text

            write_private(tfile, _tenants(5, 4))  # a lowered, b given a quota below what it holds
            _until(m, f'{quota}"{a}"}} 5.0', f'{quota}"{b}"}} 4.0', f'{used}"{b}"}} 6.0')
            more = chain(ns_b, 90_000, 2)
            assert pc.put_blocks(ns_b, None, more, data(2)).num_committed == 2  # b now makes room in its own
            resident = sum(c.match(ns_b, h).num_matched for h in [*b_chains, more])
            assert resident == 4 and c.match(ns_b, more).num_matched == 2
            _until(m, f'{used}"{b}"}} 4.0')

            write_private(tfile, "[[tenants]\nname = ")  # a broken edit: the previous quotas stay
            for _ in range(10):
                time.sleep(0.3)
                text = _metrics(m)
                assert f'{quota}"{a}"}} 5.0' in text and f'{quota}"{b}"}} 4.0' in text
            write_private(tfile, _tenants(6, None))  # b's quota removed: it is no longer limited
            text = _until(m, f'{quota}"{a}"}} 6.0')
            assert f'tenant="{b}"' not in text
            extra = chain(ns_b, 120_000, 3)
            assert pc.put_blocks(ns_b, None, extra, data(3)).num_committed == 3
            assert sum(c.match(ns_b, h).num_matched for h in [*b_chains, more, extra]) == 7
    finally:
        transport.close()


def test_a_tenant_whose_quota_is_removed_has_no_share_when_the_pool_fills(tmp_path: Path) -> None:
    """Quotas 60 (a) and 16 (b) on a 64-slot pool; b writes its 16, then its quota is removed from the
    file (a's share is now its whole quota): when a fills the pool, b's blocks go first, as those of a
    namespace without a quota, rather than being kept as a share b no longer has."""
    from tests.test_tenant_shares import NUM_SLOTS, TENANTS, _start_pool
    from tests.test_tenant_shares import chain as chain64
    from tests.test_tenant_shares import data as data64

    tenants = TENANTS.replace("= 20", "= 16")  # a: 60 (with b's 16, more than the pool: shares scaled)
    m, store = _start_pool(tmp_path, tenants, KVPOOL_HIGH_WATERMARK="1.0", KVPOOL_LOW_WATERMARK="1.0")
    transport = transfer.UcxTransport()
    block_nbytes = KVLayout.from_fingerprint(LAYOUT).block_nbytes
    try:
        with (
            MasterClient(m.grpc_address) as c,
            PoolClient(m.grpc_address, transport, block_nbytes=block_nbytes) as pc,
        ):
            ns_a, _ = c.register_namespace("gone", "v1", LAYOUT, cache_salt="salt-a")
            ns_b, _ = c.register_namespace("gone", "v1", LAYOUT, cache_salt="salt-b")
            b_chains = [chain64(ns_b, 1_000 * i, 4) for i in range(4)]
            for h in b_chains:
                assert pc.put_blocks(ns_b, None, h, data64(4)).num_committed == 4
            b_id = tenant_id("salt-b")
            _until(m, f'kvpool_master_tenant_pool_quota_blocks{{tenant="{b_id}"}} 16.0')
            write_private(tmp_path / "tenants.toml", tenants.replace("pool_quota_blocks = 16\n", ""))
            deadline = time.monotonic() + 30
            while f'tenant="{b_id}"' in _metrics(m):  # the master took the edit
                assert time.monotonic() < deadline, "the master did not reload the tenants file"
                time.sleep(0.2)
            a_chains = [chain64(ns_a, 1_000 * i, 4) for i in range(14)]  # 56 blocks: past the pool
            for h in a_chains:
                assert pc.put_blocks(ns_a, None, h, data64(4)).num_committed == 4
            b_left = sum(c.match(ns_b, h).num_matched for h in b_chains)
            assert b_left == NUM_SLOTS - 56 and c.stats().num_blocks == NUM_SLOTS
    finally:
        transport.close()
        store.kill()
        m.kill()
