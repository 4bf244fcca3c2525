"""The master's orders to a secured store are bound to that store, their body and a moment, and spent once
(`kvpool.membership.master_call_credential`): a captured credential replayed to another store, with another
body, twice, or after the ±5 s skew is refused, UNAUTHENTICATED; and a store takes a higher leader epoch only
with the leader's proof of it (`kvpool.membership.leader_proof`, `kvpool.store.fence`). Real store
processes of a secured `LocalCluster`; the test holds the cluster secret, as a master would."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvpool.capability import Capabilities, CapabilityKey
from kvpool.membership import (
    LEADER_PROOF_METADATA,
    MASTER_CALL_METADATA,
    MASTER_CALL_SKEW_MS,
    leader_proof,
    master_call_credential,
)
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.capabilities import require_ucx
from tests.test_ha_fencing import store_metrics

pytestmark = pytest.mark.timeout(120)
transfer = pytest.importorskip("transfer")
LAYOUT = "kv1:float32:b16:l2:h2:d16"
INVENTORY = "/kvpool.v1.Store/Inventory"
FREE = "/kvpool.v1.Store/FreeSlots"
RESERVE = "/kvpool.v1.Store/ReserveSlots"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    require_ucx()
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec

    spec = LocalClusterSpec(layout=LAYOUT, num_stores=2, num_prefill=0, num_decode=0, segment_size="8MiB")
    with LocalCluster(spec) as c:
        yield c


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _call(store: str, method: str, request: Any, metadata: tuple[tuple[str, str], ...]) -> Any:
    """Call `method` on the store at `store` with `metadata`; its answer (an inventory's list)."""
    name = method.rsplit("/", 1)[1]
    with grpc.insecure_channel(store) as ch:
        answer = getattr(pb_grpc.StoreStub(ch), name)(request, timeout=10, metadata=metadata)
        return list(answer) if name == "Inventory" else answer


def _refused(store: str, method: str, request: Any, metadata: tuple[tuple[str, str], ...]) -> str:
    with pytest.raises(grpc.RpcError) as err:
        _call(store, method, request, metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    return str(err.value.details())


def _cred(caps: Capabilities, store: str, method: str, request: Any, now_ms: int | None = None) -> str:
    body = request.SerializeToString()
    return master_call_credential(caps, store, method, body, _now_ms() if now_ms is None else now_ms)


def test_a_store_credential_opens_one_call_on_one_store_with_one_body(cluster: Any) -> None:
    caps = cluster.capabilities()
    assert caps is not None
    a, b = (s.info["grpc_address"] for s in cluster.stores[:2])
    inventory = pb.InventoryRequest()
    captured = _cred(caps, a, INVENTORY, inventory)  # what an observer of the master's call to `a` saw
    meta = ((MASTER_CALL_METADATA, captured),)
    assert "only the master" in _refused(b, INVENTORY, inventory, meta)  # another store: refused
    _call(a, INVENTORY, inventory, meta)  # the store it was made for takes it, once
    assert "replayed" in _refused(a, INVENTORY, inventory, meta)  # twice: refused
    # another body: a credential for freeing slot 0 does not free slot 1
    free0 = pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=0, generation=999)])
    free1 = pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=1, generation=999)])
    meta = ((MASTER_CALL_METADATA, _cred(caps, a, FREE, free0)),)
    assert "bad credential" in _refused(a, FREE, free1, meta)
    _call(a, FREE, free0, meta)  # the body it was made for: taken (the refusal spent nothing)
    # another method with the same body bytes (both empty): refused
    meta = ((MASTER_CALL_METADATA, _cred(caps, a, "/kvpool.v1.Store/CommitSlots", inventory)),)
    assert "bad credential" in _refused(a, INVENTORY, inventory, meta)


def test_a_store_credential_older_than_the_skew_is_refused(cluster: Any) -> None:
    caps = cluster.capabilities()
    assert caps is not None
    store = cluster.stores[0].info["grpc_address"]
    inventory = pb.InventoryRequest()
    for age_ms in (MASTER_CALL_SKEW_MS + 1_000, -(MASTER_CALL_SKEW_MS + 1_000), 60_000):
        old = _cred(caps, store, INVENTORY, inventory, _now_ms() - age_ms)
        assert "stale" in _refused(store, INVENTORY, inventory, ((MASTER_CALL_METADATA, old),)), age_ms
    # well within the skew (a clock 2 s behind): taken
    _call(store, INVENTORY, inventory, ((MASTER_CALL_METADATA, _cred(caps, store, INVENTORY, inventory,
                                                                     _now_ms() - 2_000)),))  # fmt: skip


def _reserve(slot: int, epoch: int) -> pb.ReserveSlotsRequest:
    return pb.ReserveSlotsRequest(
        slots=[pb.SlotReservation(slot=slot, generation=1, namespace=b"\x11" * 16, block_hash=b"\x22" * 16)],
        write_lease_ms=30_000,
        leader_epoch=epoch,
    )


def test_a_store_takes_a_higher_epoch_only_with_the_leader_s_proof(cluster: Any) -> None:
    """Even with a valid call credential (a holder of the secret: the proof check stands alone), an order
    at a higher epoch without its leader proof fences no one; with it, the store takes the epoch."""
    caps = cluster.capabilities()
    assert caps is not None
    store = cluster.stores[1].info["grpc_address"]
    huge = 2**62
    other = Capabilities(CapabilityKey(b"o" * 32))
    for proof in ("", leader_proof(caps, "127.0.0.1:9", huge - 1), leader_proof(other, "127.0.0.1:9", huge),
                  leader_proof(caps, "127.0.0.1:9", huge)[2:]):  # fmt: skip
        req = _reserve(7, huge)
        meta = [(MASTER_CALL_METADATA, _cred(caps, store, RESERVE, req))]
        if proof:
            meta.append((LEADER_PROOF_METADATA, proof))
        assert "leader proof" in _refused(store, RESERVE, req, tuple(meta)), proof
    seen = store_metrics(str(cluster.stores[1].info["metrics_address"]))
    assert seen["kvpool_store_unproven_epochs_total"] == 4 and seen["kvpool_store_leader_epoch"] == 0
    # the single master (epoch 0) still orders this store, and a proven epoch is taken
    inventory = pb.InventoryRequest()
    assert _call(
        store, INVENTORY, inventory, ((MASTER_CALL_METADATA, _cred(caps, store, INVENTORY, inventory)),)
    )
    req = _reserve(7, 5)
    _call(store, RESERVE, req, ((MASTER_CALL_METADATA, _cred(caps, store, RESERVE, req)),
                                (LEADER_PROOF_METADATA, leader_proof(caps, "127.0.0.1:9", 5))))  # fmt: skip
    req = _reserve(8, 4)  # older than the proven 5: fenced
    with pytest.raises(grpc.RpcError) as err:
        _call(store, RESERVE, req, ((MASTER_CALL_METADATA, _cred(caps, store, RESERVE, req)),))
    assert (
        err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        and "fenced: epoch 4 < 5" in err.value.details()
    )


def test_the_nonce_cache_forgets_after_two_skews_and_is_bounded() -> None:
    """The store's nonce cache (`kvpool.membership.CallNonces`): a nonce is refused again until two skew
    windows passed (by then a replay is refused for its age), and past `max_entries` live nonces a call is
    refused rather than a nonce forgotten early."""
    from kvpool.membership import CallNonces

    nonces = CallNonces(keep_ms=2 * MASTER_CALL_SKEW_MS, max_entries=3)
    assert nonces.spend(b"a", 0) is None and nonces.spend(b"a", 1) == "credential replayed (nonce seen)"
    assert nonces.spend(b"a", 2 * MASTER_CALL_SKEW_MS - 1) is not None  # still remembered
    assert nonces.spend(b"b", 1) is None and nonces.spend(b"c", 2) is None
    full = nonces.spend(b"d", 3)
    assert full is not None and "nonce cache full" in full and len(nonces) == 3
    assert nonces.spend(b"a", 2 * MASTER_CALL_SKEW_MS) is None  # forgotten (and "b" still held)
    assert len(nonces) == 3 and nonces.spend(b"b", 2 * MASTER_CALL_SKEW_MS) is not None
    assert nonces.spend(b"d", 2 * MASTER_CALL_SKEW_MS + 2) is None and len(nonces) == 2  # "b", "c" gone
