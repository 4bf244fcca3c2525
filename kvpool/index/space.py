"""Per store node accounting for the radix index: slots and bytes per node (replicas live in columns)."""

from __future__ import annotations

from kvpool.index.columns import Columns


class NodeSpace:
    """Slots and bytes count replicas per node; `rows_on(node)` (rows with at least one replica on the
    node) scans the replica columns, so no per-node row set is kept (it cost ~50 B per block)."""

    def __init__(self, columns: Columns) -> None:
        self._c = columns
        self._slots: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def add(self, node_id: str, size_bytes: int) -> None:
        self._slots[node_id] = self._slots.get(node_id, 0) + 1
        self._bytes[node_id] = self._bytes.get(node_id, 0) + size_bytes

    def add_many(self, node_id: str, num_slots: int, size_bytes: int) -> None:
        """`num_slots` replicas of `size_bytes` in all joined `node_id`."""
        self._slots[node_id] = self._slots.get(node_id, 0) + num_slots
        self._bytes[node_id] = self._bytes.get(node_id, 0) + size_bytes

    def remove(self, node_id: str, size_bytes: int) -> None:
        """One replica left `node_id`."""
        if node_id not in self._slots:
            return
        self._slots[node_id] -= 1
        self._bytes[node_id] -= size_bytes

    def remove_many(self, node_id: str, num_slots: int, size_bytes: int) -> None:
        """`num_slots` replicas of `size_bytes` in all left `node_id`."""
        if node_id not in self._slots:
            return
        self._slots[node_id] -= num_slots
        self._bytes[node_id] -= size_bytes

    def has(self, node_id: str) -> bool:
        """Whether any replica was ever counted on `node_id` since it was last forgotten."""
        return node_id in self._slots

    def rows_on(self, node_id: str) -> set[int]:
        return self._c.rows_with_node(node_id) if node_id in self._slots else set()

    def forget(self, node_id: str) -> None:
        self._slots.pop(node_id, None)
        self._bytes.pop(node_id, None)

    def num_slots(self, node_id: str) -> int:
        return self._slots.get(node_id, 0)

    def num_bytes(self, node_id: str) -> int:
        return self._bytes.get(node_id, 0)

    def nodes(self) -> list[str]:
        return list(self._slots)
