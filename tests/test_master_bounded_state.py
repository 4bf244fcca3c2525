"""Bounded master state (issue 24 part 3): every cap answers RESOURCE_EXHAUSTED naming its setting, idle
namespaces expire (an injected clock), and repeating an operation leaves O(1) state.

Caps over real gRPC (an in-process master server on 127.0.0.1:0); expiry and the flush/version cycles on
a real `Master` with its real maintenance tick (plus a smaller gRPC run of the flush cycles); a stub
stands in for the store nodes' control calls where a reservation needs one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvpool.client import MasterClient
from kvpool.errors import FailedPrecondition, ResourceExhausted, Unavailable
from kvpool.hashing import hash_blocks
from kvpool.master.core import Master
from kvpool.master.maintenance import Maintenance
from kvpool.master.placement import ReserveOutcome
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings
from kvpool.rpc import PROTOCOL_VERSION
from kvpool.types import (
    DEFAULT_LAYOUT,
    BlockHash,
    FakeClock,
    InventoryBatch,
    KVLayout,
    Location,
    NamespaceId,
)

LAY = KVLayout.from_fingerprint(DEFAULT_LAYOUT)
FP = LAY.fingerprint()
EXPIRY_MS = 600_000


def settings(**kw: object) -> MasterSettings:
    base: dict[str, object] = {"port": 0, "bind_host": "127.0.0.1", "metrics": False}
    return MasterSettings(**(base | kw))  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_000_000)


def served(s: MasterSettings, clock: FakeClock) -> Iterator[MasterServer]:
    server = serve(s, clock=clock)
    try:
        yield server
    finally:
        server.stop()


def chain(ns: bytes, start: int, n: int) -> list[BlockHash]:
    return hash_blocks(ns, list(range(start, start + n * LAY.block_size)), LAY.block_size)


def put(m: Master, ns: bytes, hashes: Sequence[BlockHash], slot0: int = 0) -> None:
    """Blocks straight into the index (as a commit would leave them), on a store "s1"."""
    with m.lock:
        m.index.insert(
            NamespaceId(ns),
            list(hashes),
            parent=None,
            locations=[[Location("s1", slot0 + i, 1)] for i in range(len(hashes))],
            size_bytes=LAY.block_nbytes,
        )


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- caps over gRPC -------------------------------------------------------------------------------
def test_namespace_caps_answer_resource_exhausted_naming_the_setting(clock: FakeClock) -> None:
    for server in served(settings(max_namespaces=5, max_namespaces_per_tenant=3), clock):
        with MasterClient(server.address) as c:
            for salt in ("t1", "t1/a", "t1/b"):
                c.register_namespace("m", "v1", FP, cache_salt=salt)
            with pytest.raises(ResourceExhausted, match="max_namespaces_per_tenant"):
                c.register_namespace("m", "v1", FP, cache_salt="t1/c")
            c.register_namespace("m", "v1", FP, cache_salt="t1/a")  # a known one: no new state
            c.register_namespace("m", "v1", FP, cache_salt="t2/x")
            c.register_namespace("m", "v1", FP, cache_salt="t2/y")
            with pytest.raises(ResourceExhausted, match="max_namespaces "):
                c.register_namespace("m", "v1", FP, cache_salt="t3")
            assert len(server.master.namespaces) == 5


def test_model_ids_are_capped_but_an_idle_implicit_one_makes_room(clock: FakeClock) -> None:
    for server in served(settings(max_models=2), clock):
        m = server.master
        with MasterClient(server.address) as c:
            c.register_namespace("a", "v1", FP)
            c.set_model_version("b", "v9", force=True)  # explicit: never dropped
            with pytest.raises(ResourceExhausted, match="max_models"):
                c.register_namespace("c", "v1", FP)
            clock.advance(EXPIRY_MS + 1)
            with m.lock:
                Maintenance(m).tick()  # "a"'s only namespace expires: its model record may go
            c.register_namespace("c", "v1", FP)
            assert m.namespaces.active_version("b") == "v9"
            assert m.namespaces.num_models == 2


def test_leases_are_capped_and_expired_ones_reaped(clock: FakeClock) -> None:
    for server in served(settings(max_leases=3), clock):
        m = server.master
        with MasterClient(server.address) as c:
            ns, _ = c.register_namespace("m", "v1", FP)
            hashes = chain(ns, 0, 2)
            put(m, ns, hashes)
            for _ in range(3):
                assert c.match(ns, hashes, lease_ttl_ms=1000).lease_id
            with pytest.raises(ResourceExhausted, match="max_leases"):
                c.match(ns, hashes, lease_ttl_ms=1000)
            assert c.match(ns, hashes).num_matched == 2  # a peek takes no lease: never refused
            clock.advance(1001)  # all three expire: reaped, so the count cannot grow
            for _ in range(3):
                lease = c.match(ns, hashes, lease_ttl_ms=1000).lease_id
            c.release_lease(lease)
            assert c.match(ns, hashes, lease_ttl_ms=1000).lease_id
            with m.lock:
                assert m.index.num_live_leases == 3


class StubStores:
    """The store control calls a master makes, answered in process (no store nodes needed)."""

    num_withheld = 0  # as `StoreCalls`: orders a master not surely leading did not send

    def identity(self, address: str, timeout_s: float, *, role: str = "store") -> None:
        return None

    def inventory(self, address: str, *, after_slot: int = 0) -> Iterator[InventoryBatch]:
        """An empty store: one batch of nothing, the last."""
        u64 = np.zeros(0, dtype=np.uint64)
        hashes = np.zeros((0, 16), dtype=np.uint8)
        none = np.zeros(0, dtype=bool)
        return iter([InventoryBatch([], np.zeros(0, np.int32), hashes, hashes, none, u64, u64, u64, u64, -1)])

    def reserve(self, address: str, orders: object, write_lease_ms: int) -> None:
        return None

    def commit(self, address: str, slots: object) -> dict[tuple[int, int], str]:
        return {}

    def copy(self, address: str, src_data_address: str, blocks: object) -> dict[tuple[int, int], str]:
        return {}

    def free(self, address: str, slots: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        return [(s, g + 1, False) for s, g in slots]

    def close(self) -> None:
        return None


def master_with_store(clock: FakeClock, **kw: object) -> Master:
    m = Master(settings(**kw), clock=clock, stores=StubStores())  # type: ignore[arg-type]
    m.register_node(
        node_id="s1",
        role="store",
        grpc_address="127.0.0.1:1",
        data_address="127.0.0.1:2",
        epoch=1,
        protocol_version=PROTOCOL_VERSION,
        layout_fingerprint=FP,
        num_slots=256,
        block_nbytes=LAY.block_nbytes,
    )
    Maintenance(m).tick()  # adopts its (empty) inventory: placeable
    return m


def test_open_reservations_are_capped_per_writer(clock: FakeClock) -> None:
    m = master_with_store(clock, max_leases_per_client=2)
    ns, _ = m.register_namespace(
        model_id="m", weights_version="v1", layout_fingerprint=FP, cache_salt="", adapter_digest="", extra={}
    )
    hashes = chain(ns, 0, 4)

    def reserve(i: int, writer: str) -> int:
        return m.publisher.reserve(
            ns, b"", [hashes[i]], num_replicas=1, block_nbytes=0, costs=[], write_lease_ms=0, writer=writer
        ).rid

    first = reserve(0, "w1")
    reserve(1, "w1")
    with pytest.raises(ResourceExhausted, match="max_leases_per_client"):
        reserve(2, "w1")
    reserve(2, "w2")  # another writer is not affected
    m.publisher.abort(first)
    reserve(3, "w1")
    assert m.publisher.num_open("w1") == 2
    clock.advance(m.settings.default_write_lease_ms + 1)
    Maintenance(m).tick()  # write leases past their expiry are dropped
    assert m.publisher.num_open("w1") == m.publisher.num_open("w2") == 0
    assert not m.publisher.reservations


class RefusingStores(StubStores):
    """A store that refuses the next reservation (a slot an earlier master reserved before it died)."""

    def __init__(self) -> None:
        self.refuse = 1

    def reserve(self, address: str, orders: object, write_lease_ms: int) -> None:
        if self.refuse:
            self.refuse -= 1
            raise FailedPrecondition("slot 3 is not free")


def test_a_store_that_refuses_a_reservation_keeps_taking_blocks(clock: FakeClock) -> None:
    """Found in CI: after a master restart a store refused one slot the dead master had reserved, and the
    master then placed nothing on it for `unreachable_backoff_ms` (5 s of lost hits). A refusal is about
    those slots; only a store that does not answer is backed off."""
    m = master_with_store(clock)
    m.stores = RefusingStores()  # type: ignore[assignment]
    ns, _ = m.register_namespace(
        model_id="m", weights_version="v1", layout_fingerprint=FP, cache_salt="", adapter_digest="", extra={}
    )
    hashes = chain(ns, 0, 2)

    def reserve(i: int) -> ReserveOutcome:
        return m.publisher.reserve(
            ns, b"", [hashes[i]], num_replicas=1, block_nbytes=0, costs=[], write_lease_ms=0, writer="w"
        )

    with pytest.raises(Unavailable, match="refused the reservation"):
        reserve(0)
    assert [loc.node_id for locs in reserve(1).locations for loc in locs] == ["s1"]  # at once, no back-off
