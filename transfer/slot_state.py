"""Optimistic same-host reads: the store's per-slot read state in a second sealed memfd readers map.

A `mread` (request, pins, reply, `mdone`; transfer/ucx_mapped.py) costs ~0.8-1 ms here, about as long as
copying a 16 MiB batch of 64 KiB blocks. A reader that also maps the store's slot state copies first and
asks after, as a seqlock reader does:

1. it checks each block's slot: readable (committed, no free pending) at the generation the read names,
   and that the store still lives (the mapping outlives a killed store; a dead one's reads go to UCX,
   which fails them and drops the mappings);
2. it copies the block and compares the xxh3 of the copy with the checksum the slot state holds (the C
   loop of transfer/xxh3.py; it ends with an acquire fence, so step 3's loads follow the copy's);
3. it checks the slot again: still readable at that generation.

A slot's bytes change only after the slot is released, and a release bumps its generation (generations
never go back; kvpool/store/slots.py), so a block that passes step 3 was copied whole from the bytes
committed at that generation. Every other block takes the pinned `mread` path, which says why it fails.
Nothing is pinned, so a slow reader holds no free back; an eviction during the copy fails step 3 and
never returns bytes (field case B17). Only where the C kernels are built, and only from a store that
checks no capabilities: one that does keeps its slot state private, so every read shows its capability
to it (`mread`), as over the network.

Layout (native byte order, n = `num_slots`): generation uint64[n] | checksum uint64[n] | readable uint8[n].
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np

from transfer.shared_segment import SegmentDescriptor, SegmentMapping, SharedSegment


def _nbytes(num_slots: int) -> int:
    return 17 * num_slots


def _split(raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return raw[: 8 * n].view(np.uint64), raw[8 * n : 16 * n].view(np.uint64), raw[16 * n : 17 * n]


class SharedSlotState:
    """The store's side: `generation`, `checksum` (uint64) and `readable` (uint8, 1 = committed and no
    free pending) of `num_slots` slots, writable, in a `SharedSegment`; the slot table keeps them.
    Raises `OSError` where memfd is unavailable."""

    def __init__(self, num_slots: int, block_nbytes: int) -> None:
        if num_slots <= 0 or block_nbytes <= 0:
            raise ValueError("a slot state needs slots of a positive size")
        self.num_slots = num_slots
        self.block_nbytes = block_nbytes
        self._segment = SharedSegment(_nbytes(num_slots), name="kvpool-slot-state")
        self.generation, self.checksum, self.readable = _split(self._segment.array, num_slots)

    def to_wire(self) -> dict[str, Any]:
        return {"seg": self._segment.descriptor.to_wire(), "n": self.num_slots, "nb": self.block_nbytes}


class SlotStateMapping:
    """The reader's side: a read-only mapping of a store's `SharedSlotState`. Its arrays may be read only
    inside `with hold() as live` when `live` (they point into the mapping)."""

    def __init__(self, mapping: SegmentMapping, num_slots: int, block_nbytes: int) -> None:
        self._mapping = mapping
        self.num_slots = num_slots
        self.block_nbytes = block_nbytes
        raw = np.ctypeslib.as_array((ctypes.c_uint8 * _nbytes(num_slots)).from_address(mapping.address))
        raw.flags.writeable = False
        self.generation, self.checksum, self.readable = _split(raw, num_slots)

    @classmethod
    def attach(cls, wire: Any) -> SlotStateMapping:
        """Map what `SharedSlotState.to_wire` describes. Raises `ValueError` (malformed) or `OSError`
        (see `SegmentMapping.attach`)."""
        if not isinstance(wire, dict) or set(wire) != {"seg", "n", "nb"}:
            raise ValueError("malformed slot state descriptor")
        n, nb = wire["n"], wire["nb"]
        desc = SegmentDescriptor.from_wire(wire["seg"])
        if not (
            isinstance(n, int) and isinstance(nb, int) and n > 0 and nb > 0 and desc.nbytes >= _nbytes(n)
        ):
            raise ValueError("malformed slot state descriptor")
        return cls(SegmentMapping.attach(desc), n, nb)

    @property
    def descriptor(self) -> SegmentDescriptor:
        return self._mapping.descriptor

    @contextlib.contextmanager
    def hold(self) -> Iterator[bool]:
        """See `SegmentMapping.hold`."""
        with self._mapping.hold() as live:
            yield live

    def owner_alive(self) -> bool:
        """See `SegmentMapping.owner_alive`."""
        return self._mapping.owner_alive()

    def readable_at(self, slots: np.ndarray, generations: np.ndarray) -> np.ndarray:
        """bool per (slot, generation): readable at that generation now. `slots` in range; held."""
        return (self.generation[slots] == generations) & (self.readable[slots] == 1)

    def close(self) -> None:
        self._mapping.close()
