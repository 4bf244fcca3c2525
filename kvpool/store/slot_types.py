"""The slot table's value types: slot states, per-slot flag bits, a reservation, a free's result."""

from __future__ import annotations

import enum
from dataclasses import dataclass

FIRST_GENERATION = 1


class SlotState(enum.IntEnum):
    FREE = 0
    RESERVED = 1
    WRITTEN = 2
    COMMITTED = 3


# Plain ints for the hot paths: comparing a numpy scalar with an IntEnum member costs ~6 us, with an int
# ~0.2 us (a 64 KiB read of 256 blocks spent most of its store-side time there).
_FREE, _RESERVED, _WRITTEN, _COMMITTED = (int(x) for x in SlotState)

# Bits of a slot's flags column (`SlotTable._flags`, uint8).
_WRITING = 1
"""A write transfer is in flight (at most one per slot)."""
_FREEING = 2
"""A free waits for the slot's transfers to end (a deferred free, or an expired lease while in flight)."""
_HAS_PARENT = 4
"""The slot's block names a parent (its parent-hash row holds it; zeros otherwise)."""


@dataclass(frozen=True, slots=True)
class Reservation:
    slot: int
    generation: int
    namespace: bytes
    block_hash: bytes
    parent_hash: bytes = b""


@dataclass(frozen=True, slots=True)
class FreeResult:
    slot: int
    new_generation: int
    deferred: bool
