"""Namespace slots of the radix index (`NamespaceSlotsMixin`): register, invalidate, forget, and count.

Each registered namespace owns a *slot*: a block count, a validity flag and its id; rows name their
slot (`ns_slot` column) and the index's one hash table maps (slot, block hash) to a row. Invalidating a namespace parks its slot for background
reclamation (`reclaim.py`); registering it again opens a fresh, empty slot. A slot that holds no rows
(emptied by reclamation, or forgotten while empty) goes back to a free list and is reused, so N
flush/re-register cycles, or N namespaces that come and go, leave O(live namespaces) slots, not O(N).

Groups: a slot may carry a *group* (the master's tenant, for pool quotas); the index keeps the number
of resident blocks of active namespaces per group, so a tenant's usage is O(1) to read. Blocks of an
invalidated slot leave their group's count at once (they are unreachable), not when reclaimed.
"""

from __future__ import annotations

from kvpool.index import validate as v
from kvpool.types import NamespaceId

_FREE = NamespaceId(b"")
"""The id of a free slot (never a valid namespace: ids are 16 bytes)."""


class NamespaceSlotsMixin:
    """The namespace half of `RadixIndex` (which calls `_init_slots` in its constructor)."""

    _ns_active: dict[NamespaceId, int]
    _ns_ids: list[NamespaceId]
    _ns_count: list[int]
    """Resident blocks per slot (rows naming it)."""
    _ns_valid: list[bool]
    _ns_group: list[str | None]
    _ns_free: list[int]
    _group_blocks: dict[str, int]
    _pending: list[int]
    _reclaim_work: dict[int, list[tuple[int, int]]]
    _reclaim_cursor: dict[int, int]

    def _init_slots(self) -> None:
        self._ns_active = {}
        self._ns_ids = []
        self._ns_count = []
        self._ns_valid = []
        self._ns_group = []
        self._ns_free = []
        self._group_blocks = {}
        self._pending = []
        self._reclaim_work = {}
        self._reclaim_cursor = {}

    def register_namespace(self, ns: NamespaceId, group: str | None = None) -> None:
        """Make `ns` accept inserts (idempotent; a later call may set its `group`). After an
        invalidation this starts a fresh, empty tree in a free (reused) slot when there is one."""
        v.check_hash(ns, "ns")
        slot = self._ns_active.get(ns)
        if slot is not None:
            self._set_group(slot, group)
            return
        if self._ns_free:
            slot = self._ns_free.pop()
            self._ns_ids[slot], self._ns_count[slot], self._ns_valid[slot] = ns, 0, True
            self._ns_group[slot] = None
        else:
            slot = len(self._ns_ids)
            self._ns_ids.append(ns)
            self._ns_count.append(0)
            self._ns_valid.append(True)
            self._ns_group.append(None)
        self._ns_active[ns] = slot
        self._set_group(slot, group)

    def invalidate_namespace(self, ns: NamespaceId) -> None:
        """O(1): every lookup under `ns` misses from now on; its blocks wait for `reclaim_invalidated`
        (an empty namespace's slot is freed at once). Unknown namespaces are ignored (idempotent)."""
        slot = self._ns_active.pop(ns, None)
        if slot is None:
            return
        self._ns_valid[slot] = False
        self._group_add(slot, -self._ns_count[slot])
        if self._ns_count[slot]:
            self._pending.append(slot)
        else:
            self._free_slot(slot)

    def forget_namespace(self, ns: NamespaceId) -> bool:
        """Drop an active namespace that holds no blocks (its slot is reused); True when dropped.
        A namespace with blocks, or an unknown one, is left as it is (False)."""
        slot = self._ns_active.get(ns)
        if slot is None or self._ns_count[slot]:
            return False
        del self._ns_active[ns]
        self._free_slot(slot)
        return True

    def num_blocks_in(self, ns: NamespaceId) -> int:
        """Resident blocks of an active namespace (0 when unknown or invalidated)."""
        slot = self._ns_active.get(ns)
        return 0 if slot is None else self._ns_count[slot]

    def num_blocks_in_group(self, group: str) -> int:
        """Resident blocks of the active namespaces registered with `group` (O(1))."""
        return self._group_blocks.get(group, 0)

    @property
    def num_namespaces(self) -> int:
        """Active namespaces."""
        return len(self._ns_active)

    @property
    def num_namespace_slots(self) -> int:
        """Slots allocated so far (active, awaiting reclamation, or free for reuse)."""
        return len(self._ns_ids)

    @property
    def num_free_namespace_slots(self) -> int:
        return len(self._ns_free)

    def _set_group(self, slot: int, group: str | None) -> None:
        if group is None or self._ns_group[slot] == group:
            return
        n = self._ns_count[slot]
        self._group_add(slot, -n)
        self._ns_group[slot] = group
        self._group_add(slot, n)

    def _group_add(self, slot: int, n: int) -> None:
        group = self._ns_group[slot]
        if group is not None and n:
            self._group_blocks[group] = self._group_blocks.get(group, 0) + n

    def _free_slot(self, slot: int) -> None:
        """Return an empty slot (no rows name it) to the free list."""
        self._ns_ids[slot], self._ns_count[slot], self._ns_valid[slot] = _FREE, 0, False
        self._ns_group[slot] = None
        self._reclaim_work.pop(slot, None)
        self._reclaim_cursor.pop(slot, None)
        self._ns_free.append(slot)
