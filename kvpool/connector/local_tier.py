"""The node-local host-memory tier (L2): an LRU of recently used blocks, bounded in bytes.

Keys are (namespace, block hash), so a block is only ever found under the namespace it was computed in
(no cross-tenant or cross-version reuse). Stored/removed events are queued for the master, which records
them as `local` locations (visible to the router's peek, never readable by other nodes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

_Key = tuple[bytes, bytes]


class LocalTier:
    """An LRU of block bytes. Thread-safe. `capacity_bytes` 0 disables it.

    Values are read-only uint8 arrays of `block_nbytes`; callers never get a view they could mutate.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[_Key, np.ndarray] = OrderedDict()
        self._used_bytes = 0
        self._lock = threading.Lock()
        self._stored: dict[bytes, list[bytes]] = {}
        self._removed: dict[bytes, list[bytes]] = {}
        self.num_hits = 0
        self.num_lookups = 0

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def leading_run(self, ns: bytes, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` are resident (does not touch recency)."""
        with self._lock:
            n = 0
            for h in hashes:
                if (ns, h) not in self._blocks:
                    break
                n += 1
            return n

    def get(self, ns: bytes, block_hash: bytes) -> np.ndarray | None:
        with self._lock:
            self.num_lookups += 1
            value = self._blocks.get((ns, block_hash))
            if value is not None:
                self._blocks.move_to_end((ns, block_hash))
                self.num_hits += 1
            return value

    def put(self, ns: bytes, block_hash: bytes, data: np.ndarray) -> None:
        """Store a copy of `data` (uint8, block_nbytes); evicts least recently used blocks to fit."""
        if self.capacity_bytes == 0 or data.nbytes > self.capacity_bytes:
            return
        key = (bytes(ns), bytes(block_hash))
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            copy = np.array(data, dtype=np.uint8, copy=True).reshape(-1)
            copy.setflags(write=False)
            while self._used_bytes + copy.nbytes > self.capacity_bytes and self._blocks:
                (old_ns, old_hash), old = self._blocks.popitem(last=False)
                self._used_bytes -= old.nbytes
                self._removed.setdefault(old_ns, []).append(old_hash)
            self._blocks[key] = copy
            self._used_bytes += copy.nbytes
            self._stored.setdefault(key[0], []).append(key[1])

    def clear(self) -> None:
        with self._lock:
            for ns, h in self._blocks:
                self._removed.setdefault(ns, []).append(h)
            self._blocks.clear()
            self._used_bytes = 0

    def drain_events(self) -> list[tuple[bytes, list[bytes], list[bytes]]]:
        """Take the queued (namespace, stored, removed) events to report to the master."""
        with self._lock:
            namespaces = set(self._stored) | set(self._removed)
            events = [(ns, self._stored.pop(ns, []), self._removed.pop(ns, [])) for ns in namespaces]
            return events
