"""After a leader's kill -9, the new leader rebuilds the index from the store's re-registration and
inventory (real processes: etcd, three `kvpool master --etcd`, a store given the three, the leader first):
the blocks published through the old leader are matched and read back bit-exact through the new one. The
store's link tries the dead leader and a standby that still names it until the election ends, then finds
the new leader (it does not stay stuck on the dead one)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.cluster.etcd import ThrowawayEtcd
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT, Proc, start_store
from kvpool.types import KVLayout
from tests.capabilities import require_ucx
from tests.etcd_server import etcd  # noqa: F401 - the fixture
from tests.test_ha_election import wait_until
from tests.test_ha_processes import TTL_S, ha_procs, role

LAY = KVLayout.from_fingerprint(LAYOUT)
transfer = pytest.importorskip("transfer")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def transport() -> Iterator[object]:
    require_ucx()
    t = transfer.UcxTransport()
    yield t
    t.close()


def store_alive(address: str) -> bool:
    with MasterClient(address, timeout_s=1.0) as c:
        try:
            return any(n.alive and n.node.node_id == "s0" for n in c.list_nodes())
        except Exception:  # noqa: BLE001 - not the leader yet
            return False


def test_new_leader_rebuilds_the_index_from_the_store(etcd: ThrowawayEtcd, transport: object) -> None:  # noqa: F811
    procs: list[Proc] = ha_procs(etcd.endpoint, 3)
    try:
        wait_until(
            lambda: sorted(role(p.grpc_address) for p in procs) == ["leader", "standby", "standby"],
            15,
            "a leader",
        )
        old = next(p for p in procs if role(p.grpc_address) == "leader")
        standbys = [p for p in procs if p is not old]
        masters = ",".join(p.grpc_address for p in [old, *standbys])
        procs.append(start_store(masters, "s0"))
        wait_until(lambda: store_alive(old.grpc_address), 15, "the store registers with the leader")
        with MasterClient(masters) as c:
            ns, _ = c.register_namespace("ha", "v1", LAYOUT)
        hashes = hash_blocks(ns, list(range(64 * 4)), LAY.block_size)
        rng = np.random.default_rng(7)
        data = [rng.integers(0, 256, LAY.block_nbytes, dtype=np.uint8) for _ in range(4)]
        with PoolClient(masters, transport, block_nbytes=LAY.block_nbytes) as writer:
            assert writer.put_blocks(ns, None, hashes, data).num_committed == 4
        old.kill()  # SIGKILL
        t0 = time.monotonic()
        wait_until(lambda: "leader" in [role(p.grpc_address) for p in standbys], TTL_S + 3, "a standby leads")
        new = next(p for p in standbys if role(p.grpc_address) == "leader")
        wait_until(lambda: store_alive(new.grpc_address), 10, "the store re-registers with the new leader")
        with MasterClient(masters) as c:
            assert c.register_namespace("ha", "v1", LAYOUT)[0] == ns  # serving nodes re-register theirs
            wait_until(lambda: c.match(ns, hashes).num_matched == 4, 10, "the inventory adopted")
        with PoolClient(masters, transport, block_nbytes=LAY.block_nbytes) as reader:
            got = reader.get_blocks(ns, hashes, num_prompt_tokens=64 * 4)
            assert got.num_matched == 4 and got.num_ok == 4
            assert all(b.data == d.tobytes() for b, d in zip(got.blocks, data, strict=True))
        assert time.monotonic() - t0 < 20
    finally:
        for p in procs:
            p.kill()
