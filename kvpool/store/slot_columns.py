"""The slot table's per-slot columns that are not on the data plane's hot path: which block a slot holds
(namespace, hash, parent), its write lease, and the committed blocks read out as columns.

No Python object per slot: a slot's namespace is a small integer into a table of the distinct namespaces
the store has held (1 byte a slot while there are under 256 of them; the column widens to 2, then 4 bytes
as more arrive), block and parent hashes are rows of (n, 16) uint8 arrays, and a write lease's expiry is
a uint32 count of milliseconds after a base the table moves forward (all leases shifted at once) before
it would overflow, about once every 24 days. With the data plane's columns (kvpool/store/slots.py) a slot
costs about 60 bytes.
"""

from __future__ import annotations

import numpy as np

from kvpool.store.slot_types import _HAS_PARENT
from kvpool.types import HASH_NBYTES, InventoryBatch

MAX_WRITE_LEASE_MS = 1 << 30
"""The longest write lease a store takes (about 12 days; a master grants minutes at most)."""
_REBASE_AT_MS = 1 << 31
"""A lease this far past the base moves the base forward (leases then fit uint32 with room to spare)."""
_U32_MAX = int(np.iinfo(np.uint32).max)
_ZERO_HASH = bytes(HASH_NBYTES)
_WIDER = {np.dtype(np.uint8): np.uint16, np.dtype(np.uint16): np.uint32}
_SCAN_MIN = 1 << 16
"""The fewest slots an inventory batch scans at a time (the window doubles until the batch is full)."""


class SlotColumns:
    """Namespaces, hashes and write leases of `num_slots` slots. Not thread-safe: the slot table calls it
    under its lock. Namespace index 0 is "no block" (a slot that never held one)."""

    def __init__(self, num_slots: int, now_ms: int) -> None:
        n = num_slots
        self.ns = np.zeros(n, dtype=np.uint8)  # widened as namespaces arrive (`ns_id`)
        self.block_hash = np.zeros((n, HASH_NBYTES), dtype=np.uint8)
        self.parent_hash = np.zeros((n, HASH_NBYTES), dtype=np.uint8)
        self.lease = np.zeros(n, dtype=np.uint32)  # expiry in ms after `lease_base_ms`
        self.lease_base_ms = now_ms
        self.namespaces: list[bytes] = [b""]
        self._ns_ids: dict[bytes, int] = {}

    def ns_id(self, namespace: bytes) -> int:
        """The index of `namespace` in `namespaces`, added when new (the column widens when it must)."""
        if (k := self._ns_ids.get(namespace)) is None:
            k = self._ns_ids[namespace] = len(self.namespaces)
            self.namespaces.append(namespace)
            if k > np.iinfo(self.ns.dtype).max:
                self.ns = self.ns.astype(_WIDER[self.ns.dtype])
        return k

    def block_of(self, slot: int) -> tuple[bytes, bytes]:
        """(namespace, block hash) the slot holds or last held; (b"", b"") when it never held a block."""
        k = int(self.ns[slot])
        return (self.namespaces[k], self.block_hash[slot].tobytes()) if k else (b"", b"")

    def set_blocks(
        self,
        slots: np.ndarray,
        namespaces: list[bytes],
        hashes: list[bytes],
        parents: list[bytes],
        flags: np.ndarray,
    ) -> None:
        """Record each slot's block (`parents[i]` b"" for none; hashes checked by the caller); sets or
        clears the `_HAS_PARENT` bit of `flags` (the table's flag column) for each slot."""
        ids = [self.ns_id(ns) for ns in namespaces]
        self.ns[slots] = ids
        self.block_hash[slots] = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, HASH_NBYTES)
        raw = b"".join(p if p else _ZERO_HASH for p in parents)
        self.parent_hash[slots] = np.frombuffer(raw, dtype=np.uint8).reshape(-1, HASH_NBYTES)
        f = flags[slots] & np.uint8(0xFF ^ _HAS_PARENT)
        f[np.array([len(p) == HASH_NBYTES for p in parents], dtype=np.bool_)] |= np.uint8(_HAS_PARENT)
        flags[slots] = f

    # ---------------------------------------------------------------- write leases

    def lease_until(self, now_ms: int, write_lease_ms: int) -> int:
        """The stored form of an expiry `write_lease_ms` (at most `MAX_WRITE_LEASE_MS`, the caller checked)
        after `now_ms`; moves the base forward first when it must."""
        if now_ms + write_lease_ms - self.lease_base_ms >= _REBASE_AT_MS:
            shift = now_ms - self.lease_base_ms
            if shift >= _U32_MAX:
                self.lease[:] = 0  # every lease ended long ago
            else:
                np.subtract(self.lease, np.minimum(self.lease, np.uint32(shift)), out=self.lease)
            self.lease_base_ms = now_ms
        return max(now_ms + write_lease_ms - self.lease_base_ms, 0)

    def lease_expiry_ms(self, slot: int) -> int:
        return self.lease_base_ms + int(self.lease[slot])

    def expired(self, slots: np.ndarray, now_ms: int) -> np.ndarray:
        """(len(slots),) bool: each slot's write lease ended at or before `now_ms`."""
        return self.lease[slots] <= min(max(now_ms - self.lease_base_ms, 0), _U32_MAX)

    # ---------------------------------------------------------------- inventory

    @staticmethod
    def find(mask: np.ndarray, after_slot: int, limit: int) -> tuple[np.ndarray, int]:
        """The first `limit` slots ≥ `after_slot` where `mask` (n,) is set, as int64, and the cursor after
        the last of them, -1 when no set slot follows it. Scans windows that double from `limit` + 1 (or
        `_SCAN_MIN`): a dense table is read once, a sparse one in a few passes."""
        n, pos = len(mask), after_slot
        window, total, found = max(limit + 1, _SCAN_MIN), 0, []
        while pos < n and total <= limit:
            end = min(pos + window, n)
            idx = np.flatnonzero(mask[pos:end])
            if len(idx):
                found.append(idx + pos)
                total += len(idx)
            pos, window = end, 2 * window
        idx = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        if len(idx) > limit:
            return idx[:limit], int(idx[limit - 1]) + 1
        return idx, -1

    def batch(
        self,
        idx: np.ndarray,
        next_slot: int,
        generations: np.ndarray,
        checksums: np.ndarray,
        flags: np.ndarray,
        block_nbytes: int,
    ) -> InventoryBatch:
        """The blocks of slots `idx` as an `InventoryBatch` (copies; generations, checksums and flags are the
        table's columns)."""
        ids = self.ns[idx]
        present = np.zeros(len(self.namespaces), dtype=np.bool_)
        present[ids] = True
        used = np.flatnonzero(present)  # this batch's namespaces, in table order
        renumber = np.zeros(len(self.namespaces), dtype=np.int32)
        renumber[used] = np.arange(len(used), dtype=np.int32)
        return InventoryBatch(
            namespaces=[self.namespaces[k] for k in used.tolist()],
            ns_index=renumber[ids],
            block_hashes=self.block_hash[idx],
            parent_hashes=self.parent_hash[idx],
            has_parent=(flags[idx] & _HAS_PARENT) != 0,
            slots=idx.astype(np.uint64),
            generations=generations[idx].astype(np.uint64),
            checksums=checksums[idx].astype(np.uint64),
            size_bytes=np.full(len(idx), block_nbytes, dtype=np.uint64),
            next_slot=next_slot,
        )
