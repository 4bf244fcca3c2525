"""Batched publish (`ReserveBatch` / `CommitBatch`) through a real master service and real
`--metadata-only` store processes (tiny layout): a chain's error is its own answer, a batch commit does
what the single commits do (index and store inventories), the caps refuse a whole call, and each store
gets one reserve order and one commit order per batch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from kvpool.client import MasterClient
from kvpool.client.types import ChainReserve, CommitBlock, CommitResult, Reservation
from kvpool.errors import InvalidArgument, KVPoolError, NotFound
from kvpool.master import MasterSettings, serve
from kvpool.master.procs import Proc, start_store
from kvpool.master.server import MasterServer
from tests.capabilities import require_ucx
from tests.test_master_cluster import wait_stores

TINY = "kv1:float16:b1:l1:h1:d1"
CHAIN = 64
pytest.importorskip("transfer")
pytestmark = pytest.mark.timeout(120)


@dataclass
class Pool:
    server: MasterServer
    stores: list[Proc]

    @property
    def address(self) -> str:
        return self.server.address


def _pool(num_stores: int, **settings: int) -> Iterator[Pool]:
    require_ucx()
    server = serve(MasterSettings(port=0, layout=TINY, metrics=False, **settings))
    stores = []
    try:
        for i in range(num_stores):
            stores.append(
                start_store(server.address, f"s{i}", segment="1MiB", layout=TINY, extra=("--metadata-only",))
            )
        wait_stores(server.address, num_stores)
        yield Pool(server, stores)
    finally:
        for s in stores:
            s.kill()
        server.stop()


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    yield from _pool(4, max_batch_chains=8, max_batch_total_blocks=8 * CHAIN)


def _chain(seed: int, n: int = CHAIN) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(n)]


def _written(r: Reservation) -> list[CommitBlock]:
    """Every reserved replica as written (a metadata-only store commits without bytes)."""
    return [CommitBlock(b.block_hash, 0, b.locations) for b in r.blocks if not b.already_present]


def _publish_single(c: MasterClient, ns: bytes, parent: bytes | None, hashes: list[bytes]) -> int:
    r = c.reserve(ns, parent, hashes)
    return c.commit(r.reservation_id, _written(r)).num_committed


def _inventory(p: Pool) -> dict[str, set[tuple[bytes, bytes, int]]]:
    """Per store node id: its committed (namespace, block hash, slot)."""
    m = p.server.master
    with m.lock:
        nodes = {n.node_id: n.grpc_address for n in m.st.nodes.values() if n.is_store}
    out: dict[str, set[tuple[bytes, bytes, int]]] = {}
    for node_id, address in nodes.items():
        got = out.setdefault(node_id, set())
        for b in m.stores.inventory(address):
            for i, slot in enumerate(b.slots.tolist()):
                got.add((b.namespaces[int(b.ns_index[i])], b.block_hashes[i].tobytes(), slot))
    return out


def test_a_bad_chain_answers_its_error_and_the_others_reserve(pool: Pool) -> None:
    with MasterClient(pool.address) as c:
        ns, _ = c.register_namespace("batch-bad", "v1", TINY)
        a, b = _chain(1), _chain(2)
        dup = _chain(3, 4)
        chains = [
            ChainReserve(ns, a),
            ChainReserve(ns, _chain(4), parent=b"\x07" * 16),  # parent not in the pool
            ChainReserve(ns, b),
            ChainReserve(ns, [*dup, dup[0]]),  # repeats a hash
            ChainReserve(b"\x09" * 16, _chain(5)),  # unknown namespace
        ]
        got = c.reserve_batch(chains)
        assert isinstance(got[1], NotFound) and "parent" in str(got[1])
        assert isinstance(got[3], InvalidArgument) and "repeats" in str(got[3])
        assert isinstance(got[4], NotFound) and "namespace" in str(got[4])
        ra, rb = got[0], got[2]
        assert isinstance(ra, Reservation) and isinstance(rb, Reservation)
        assert ra.reservation_id != rb.reservation_id
        assert [x.block_hash for x in ra.blocks] == a and all(x.locations for x in ra.blocks)
        done = c.commit_batch(
            [(ra.reservation_id, _written(ra)), (rb.reservation_id, _written(rb)), (999_999, [])]
        )
        assert done[:2] == [CommitResult(CHAIN, 0), CommitResult(CHAIN, 0)]
        assert isinstance(done[2], NotFound)
        assert c.match(ns, a).num_matched == CHAIN and c.match(ns, b).num_matched == CHAIN


def test_a_batch_commit_equals_the_single_commits(pool: Pool) -> None:
    with MasterClient(pool.address) as c:
        one, _ = c.register_namespace("batch-one", "v1", TINY)
        many, _ = c.register_namespace("batch-many", "v1", TINY)
        roots = [_chain(10 + k) for k in range(3)]
        children = [_chain(20 + k, 16) for k in range(3)]
        blocks_before = c.stats().num_blocks
        for root, child in zip(roots, children, strict=True):  # single calls
            assert _publish_single(c, one, None, root) == CHAIN
            assert _publish_single(c, one, root[-1], child) == 16
        for level in (  # the same chains in two batches (a child after its parent committed)
            [ChainReserve(many, r) for r in roots],
            [ChainReserve(many, ch, parent=r[-1]) for r, ch in zip(roots, children, strict=True)],
        ):
            rs = c.reserve_batch(level)
            assert all(isinstance(r, Reservation) for r in rs), rs
            done = c.commit_batch([(r.reservation_id, _written(r)) for r in rs if isinstance(r, Reservation)])
            assert done == [CommitResult(len(ch.block_hashes), 0) for ch in level]
        assert c.stats().num_blocks == blocks_before + 2 * 3 * (CHAIN + 16)
        m = pool.server.master
        inv = _inventory(pool)
        for ns in (one, many):
            for root, child in zip(roots, children, strict=True):
                assert c.match(ns, [*root, *child]).num_matched == CHAIN + 16
                with m.lock:  # each block indexed at one replica, which its store holds committed
                    for h in [*root, *child]:
                        info = m.index.lookup(ns, h)  # type: ignore[arg-type]
                        assert info is not None and len(info.locations) == 1
                        loc = info.locations[0]
                        assert (ns, h, loc.slot) in inv[loc.node_id]
        stored = {ns: sorted(h for s in inv.values() for (n, h, _) in s if n == ns) for ns in (one, many)}
        assert stored[one] == stored[many] and len(stored[one]) == 3 * (CHAIN + 16)


def test_the_caps_refuse_the_whole_call(pool: Pool) -> None:
    with MasterClient(pool.address) as c:
        ns, _ = c.register_namespace("batch-caps", "v1", TINY)
        m = pool.server.master
        blocks, open_before = c.stats().num_blocks, len(m.publisher.reservations)
        with pytest.raises(InvalidArgument, match="max_batch_chains"):
            c.reserve_batch([ChainReserve(ns, _chain(40 + k, 1)) for k in range(9)])
        over = [ChainReserve(ns, _chain(50 + k)) for k in range(7)] + [
            ChainReserve(ns, _chain(58, CHAIN + 1))
        ]
        with pytest.raises(InvalidArgument, match="max_batch_total_blocks"):
            c.reserve_batch(over)  # 8 chains (at that cap) of 513 blocks in all: one past the other
        with pytest.raises(InvalidArgument, match="max_batch_chains"):
            c.commit_batch([(k + 1, []) for k in range(9)])
        assert c.stats().num_blocks == blocks and len(m.publisher.reservations) == open_before
        ok = c.reserve_batch([ChainReserve(ns, _chain(60 + k)) for k in range(7)])
        assert all(isinstance(r, Reservation) for r in ok)
        done = c.commit_batch([(r.reservation_id, _written(r)) for r in ok if isinstance(r, Reservation)])
        assert all(not isinstance(d, KVPoolError) for d in done)


def test_one_store_order_per_store_per_batch(pool: Pool) -> None:
    m = pool.server.master
    with MasterClient(pool.address) as c:
        ns, _ = c.register_namespace("batch-orders", "v1", TINY)
        chains = [ChainReserve(ns, _chain(70 + k)) for k in range(8)]
        calls_before = m.stores.coalesced_calls[0]
        rs = c.reserve_batch(chains)
        reserved = [r for r in rs if isinstance(r, Reservation)]
        assert len(reserved) == 8
        stores_used = {loc.node_id for r in reserved for b in r.blocks for loc in b.locations}
        assert len(stores_used) == 4  # runs of 16 blocks: every chain spreads over the 4 stores
        assert m.stores.coalesced_calls[0] - calls_before == len(stores_used)  # one ReserveSlots each
        done = c.commit_batch([(r.reservation_id, _written(r)) for r in reserved])
        assert done == [CommitResult(CHAIN, 0)] * 8
        assert m.stores.coalesced_calls[0] - calls_before == 2 * len(stores_used)  # and one CommitSlots each


def test_present_many_answers_as_lookup(pool: Pool) -> None:
    m = pool.server.master
    with MasterClient(pool.address) as c:
        ns, _ = c.register_namespace("batch-present", "v1", TINY)
        a = _chain(90)
        assert _publish_single(c, ns, None, a) == CHAIN
    asked = [*a[::3], *_chain(91, 8), b"short"]
    with m.lock:
        want = [m.index.lookup(ns, h) is not None for h in asked]  # type: ignore[arg-type]
        assert m.index.present_many(ns, asked) == want  # type: ignore[arg-type]
        assert m.index.present_many(ns, asked[:-1]) == want[:-1]  # one batch probe (no odd hash)
        assert m.index.present_many(b"\x01" * 16, a) == [False] * CHAIN  # type: ignore[arg-type]
    assert sum(want) == len(a[::3])
