"""Data-plane capabilities bound to the master leader's epoch (kvpool.master.ha): 16 bytes as before for a
single master (epoch 0), the MAC plus the epoch for a leader; a real slot table refuses a capability minted
at an epoch older than the newest order it has taken (a deposed leader's), as it refuses its orders."""

from __future__ import annotations

import pytest

from kvpool.capability import CAPABILITY_NBYTES, EPOCH_NBYTES, READ, WRITE, Capabilities, CapabilityKey
from kvpool.errors import FailedPrecondition, PermissionDenied
from kvpool.membership import leader_proof
from kvpool.store import Segment, SlotTable
from kvpool.store.slots import Reservation
from kvpool.types import FakeClock
from transfer import checksum

SECRET = b"s" * 32
NB = 4096
NS = b"n" * 16
NODE = "store-a"
NOW = 1_700_000_000_000
H = b"h" * 16


def caps() -> Capabilities:
    return Capabilities(CapabilityKey(SECRET), clock=FakeClock(NOW), skew_ms=1000)


def test_epoch_zero_keeps_the_single_master_form() -> None:
    c = caps()
    plain = c.sign(READ, NS, H, NODE, 3, 7, NOW + 1000)
    assert len(plain) == CAPABILITY_NBYTES and c.sign(READ, NS, H, NODE, 3, 7, NOW + 1000, 0) == plain
    assert c.signer(READ, NS, NOW + 1000)(NODE, H, 3, 7) == plain
    c.check(READ, NS, H, NODE, 3, 7, NOW + 1000, plain)
    c.check(READ, NS, H, NODE, 3, 7, NOW + 1000, plain, min_epoch=4)  # a single master's: never fenced


def test_a_leader_s_capability_carries_its_epoch_under_the_mac() -> None:
    c = caps()
    cap = c.sign(WRITE, NS, H, NODE, 3, 7, NOW + 1000, epoch=9)
    assert len(cap) == CAPABILITY_NBYTES + EPOCH_NBYTES and cap[CAPABILITY_NBYTES:] == (9).to_bytes(8, "big")
    assert c.signer(WRITE, NS, NOW + 1000, 9)(NODE, H, 3, 7) == cap
    assert cap[:CAPABILITY_NBYTES] != c.sign(WRITE, NS, H, NODE, 3, 7, NOW + 1000)  # the epoch is signed
    c.check(WRITE, NS, H, NODE, 3, 7, NOW + 1000, cap, min_epoch=9)
    c.check(WRITE, NS, H, NODE, 3, 7, NOW + 1000, cap, min_epoch=2)
    with pytest.raises(PermissionDenied, match="fenced: epoch 9 < 10"):
        c.check(WRITE, NS, H, NODE, 3, 7, NOW + 1000, cap, min_epoch=10)
    forged = cap[:CAPABILITY_NBYTES] + (10).to_bytes(8, "big")  # raising the epoch breaks the MAC
    with pytest.raises(PermissionDenied, match="invalid"):
        c.check(WRITE, NS, H, NODE, 3, 7, NOW + 1000, forged, min_epoch=10)
    with pytest.raises(PermissionDenied, match="invalid"):
        c.check(READ, NS, H, NODE, 3, 7, NOW + 1000, cap)  # still bound to its operation


def test_a_slot_table_refuses_the_capabilities_of_a_deposed_leader() -> None:
    c = caps()
    table = SlotTable(Segment(16 * NB, NB, pin_memory="off"), capabilities=c, node_id=NODE)
    table.fence.check(4, leader_proof(c, "m:1", 4))  # the leader at epoch 4 ordered this store (its proof)
    table.reserve([Reservation(1, 1, NS, H)], 60_000)
    old = c.sign(WRITE, NS, H, NODE, 1, 1, NOW + 60_000, epoch=3)
    with pytest.raises(PermissionDenied, match="fenced: epoch 3 < 4"):
        table.begin_write(1, 1, NB, old, NOW + 60_000)
    data = bytes(range(256)) * (NB // 256)
    table.begin_write(1, 1, NB, c.sign(WRITE, NS, H, NODE, 1, 1, NOW + 60_000, epoch=4), NOW + 60_000)[:] = (
        data
    )
    table.end_write(1, 1, checksum(data), True)
    assert table.commit([(1, 1)]) == [(1, 1, "")]
    read4 = c.sign(READ, NS, H, NODE, 1, 1, NOW + 60_000, epoch=4)
    table.begin_read(1, 1, NB, read4, NOW + 60_000)
    table.end_read(1)
    table.fence.check(
        5, leader_proof(c, "m:2", 5)
    )  # a newer leader ordered it: epoch 4's capabilities are dead
    with pytest.raises(PermissionDenied, match="fenced: epoch 4 < 5"):
        table.begin_read(1, 1, NB, read4, NOW + 60_000)
    with pytest.raises(FailedPrecondition, match="fenced: epoch 4 < 5"):
        table.fence.check(4)


def test_a_single_masters_orders_are_never_fenced() -> None:
    """A stray (or fuzzed) order with a huge epoch must not lock a single master (epoch 0) out of a store."""
    from kvpool.store.fence import EpochFence

    fence = EpochFence()
    fence.check(2**63)
    fence.check(0)
    with pytest.raises(FailedPrecondition, match="fenced"):
        fence.check(5)
