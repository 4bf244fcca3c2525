"""Per store node accounting for the radix index: which rows hold a replica there, slots and bytes."""

from __future__ import annotations


class NodeSpace:
    """`rows_on(node)`: rows with at least one replica on the node; slots and bytes count replicas."""

    def __init__(self) -> None:
        self._rows: dict[str, set[int]] = {}
        self._slots: dict[str, int] = {}
        self._bytes: dict[str, int] = {}

    def add(self, node_id: str, row: int, size_bytes: int) -> None:
        self._rows.setdefault(node_id, set()).add(row)
        self._slots[node_id] = self._slots.get(node_id, 0) + 1
        self._bytes[node_id] = self._bytes.get(node_id, 0) + size_bytes

    def remove(self, node_id: str, row: int, size_bytes: int, still_there: bool) -> None:
        """One replica of `row` left `node_id`; `still_there`: another replica of it stays on the node."""
        rows = self._rows.get(node_id)
        if rows is None:
            return
        if not still_there:
            rows.discard(row)
        self._slots[node_id] -= 1
        self._bytes[node_id] -= size_bytes

    def rows_on(self, node_id: str) -> set[int]:
        return set(self._rows.get(node_id, ()))

    def forget(self, node_id: str) -> None:
        self._rows.pop(node_id, None)
        self._slots.pop(node_id, None)
        self._bytes.pop(node_id, None)

    def num_slots(self, node_id: str) -> int:
        return self._slots.get(node_id, 0)

    def num_bytes(self, node_id: str) -> int:
        return self._bytes.get(node_id, 0)

    def nodes(self) -> list[str]:
        return list(self._rows)
