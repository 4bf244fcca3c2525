"""The node-local host-memory tier (L2): recently used blocks, bounded in bytes, chains kept whole.

Keys are (namespace, block hash), so a block is only ever found under the namespace it was computed in
(no cross-tenant or cross-version reuse). Each block records its parent (the previous block of its
chain; None: the namespace root), and the tier obeys the index's rule (docs/design.md "Eviction"): a block
never leaves while a resident block depends on it. Eviction takes the least recently used block among
the leaves (a heap of (last use, key) with lazy deletion, as SGLang's radix cache); a block whose parent
is not resident is refused, as the index refuses it. Lookups can only use a leading run, and with
prefix-closed contents the tier never holds bytes that no lookup could reach.

Stored/removed events are queued for the master, which records them as `local` locations (visible to
the router's peek, never readable by other nodes).
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence

import numpy as np

_Key = tuple[bytes, bytes]


class _Entry:
    __slots__ = ("children", "data", "parent", "path_bytes", "tick")

    def __init__(self, data: np.ndarray, parent: _Key | None, path_bytes: int, tick: int) -> None:
        self.data = data
        self.parent = parent
        self.path_bytes = path_bytes  # this block's bytes plus its ancestors': the least it needs to stay
        self.tick = tick  # last use (a counter: no two uses tie)
        self.children: set[_Key] = set()


class LocalTier:
    """Block bytes by (namespace, hash), prefix-closed. Thread-safe. `capacity_bytes` 0 disables it.

    Values are read-only uint8 arrays of `block_nbytes`; callers never get a view they could mutate.
    Every operation is O(1) or O(log n) amortised, but `discard` and `clear` (O(blocks they drop)).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._blocks: dict[_Key, _Entry] = {}
        self._leaves: list[tuple[int, _Key]] = []  # (tick, key) of leaves; stale entries skipped on pop
        self._tick = 0
        self._used_bytes = 0
        self._lock = threading.Lock()
        self._events: dict[bytes, dict[bytes, bool]] = {}  # ns -> hash -> held (the last event wins)
        self.num_hits = 0
        self.num_lookups = 0

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def parent_of(self, ns: bytes, block_hash: bytes) -> bytes | None:
        """The resident block's parent hash (None: the namespace root). `KeyError` when not resident."""
        with self._lock:
            parent = self._blocks[(ns, block_hash)].parent
            return None if parent is None else parent[1]

    def leading_run(self, ns: bytes, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` are resident as one chain (does not touch recency)."""
        with self._lock:
            n, parent = 0, None
            for h in hashes:
                entry = self._blocks.get((ns, h))
                if entry is None or entry.parent != parent:
                    break
                n, parent = n + 1, (ns, h)
            return n

    def get(self, ns: bytes, block_hash: bytes) -> np.ndarray | None:
        with self._lock:
            self.num_lookups += 1
            entry = self._blocks.get((ns, block_hash))
            if entry is None:
                return None
            self._touch((ns, block_hash), entry)
            self.num_hits += 1
            return entry.data

    def put(
        self, ns: bytes, block_hash: bytes, data: np.ndarray, *, parent: bytes | None, report: bool = True
    ) -> bool:
        """Store a copy of `data` (uint8, block_nbytes) below `parent` (the previous block of its chain;
        None: block 0, below the namespace root); evicts least recently used leaves to fit, never the
        block's own ancestors. Returns whether the block is resident now: False when `parent` is not
        resident or the chain down to it leaves no room (refused, as the index refuses an orphan).

        `report=False`: queue no stored event now; the caller calls `report_stored` once the master can
        attach it (the master records a node's local copy only of a block its index holds, so a report
        that reached it before the block's commit was dropped for good)."""
        if self.capacity_bytes == 0 or data.nbytes > self.capacity_bytes:
            return False
        ns = bytes(ns)
        key = (ns, bytes(block_hash))
        with self._lock:
            entry = self._blocks.get(key)
            if entry is not None:
                self._touch(key, entry)
                return True
            pkey = None if parent is None else (ns, bytes(parent))
            above = 0
            if pkey is not None:
                pentry = self._blocks.get(pkey)
                if pentry is None:
                    return False
                above = pentry.path_bytes
            if above + data.nbytes > self.capacity_bytes:
                return False
            copy = np.array(data, dtype=np.uint8, copy=True).reshape(-1)
            copy.setflags(write=False)
            if pkey is not None:
                self._blocks[pkey].children.add(key)  # pinned: eviction below never takes an ancestor
            while self._used_bytes + copy.nbytes > self.capacity_bytes:
                self._evict_one()  # room exists: every block off the chain to `pkey` is evictable
            self._tick += 1
            self._blocks[key] = _Entry(copy, pkey, above + copy.nbytes, self._tick)
            heapq.heappush(self._leaves, (self._tick, key))
            self._used_bytes += copy.nbytes
            if report:
                self._events.setdefault(ns, {})[key[1]] = True
            return True

    def put_chain(
        self,
        ns: bytes,
        parent: bytes | None,
        block_hashes: Sequence[bytes],
        blocks: Sequence[np.ndarray],
        *,
        report: bool = True,
    ) -> int:
        """`put` each block below the one before (the first below `parent`), stopping at the first one
        refused. Returns how many leading blocks are resident now."""
        n = 0
        for h, data in zip(block_hashes, blocks, strict=True):
            if not self.put(ns, h, data, parent=parent, report=report):
                break
            n, parent = n + 1, h
        return n

    def report_stored(self, ns: bytes, block_hashes: Sequence[bytes]) -> None:
        """Queue stored events for those of `block_hashes` still resident (see `put(report=False)`)."""
        with self._lock:
            for h in block_hashes:
                if (ns, h) in self._blocks:
                    self._events.setdefault(bytes(ns), {})[bytes(h)] = True

    def discard(self, ns: bytes, block_hashes: Sequence[bytes]) -> int:
        """Drop the resident ones of `block_hashes` and every block below them (e.g. KV the master
        refused: a fenced namespace, or computed before a flush). Returns the number of blocks dropped."""
        with self._lock:
            dropped = 0
            for h in block_hashes:
                if (ns, h) in self._blocks:
                    dropped += self._drop_subtree((bytes(ns), bytes(h)))
            return dropped

    def clear(self) -> None:
        with self._lock:
            for ns, h in self._blocks:
                self._events.setdefault(ns, {})[h] = False
            self._blocks.clear()
            self._leaves.clear()
            self._used_bytes = 0

    def drain_events(self) -> list[tuple[bytes, list[bytes], list[bytes]]]:
        """Take the queued (namespace, stored, removed) events to report to the master: each block's last
        event only (a block stored then evicted before a report is only removed, never both)."""
        with self._lock:
            events, self._events = self._events, {}
        return [
            (ns, [h for h, held in d.items() if held], [h for h, held in d.items() if not held])
            for ns, d in events.items()
        ]

    # ---- under the lock -----------------------------------------------------------------------------
    def _touch(self, key: _Key, entry: _Entry) -> None:
        self._tick += 1
        entry.tick = self._tick
        if not entry.children:
            heapq.heappush(self._leaves, (self._tick, key))
            if len(self._leaves) > 2 * len(self._blocks) + 64:  # bound the stale entries
                self._leaves = [(e.tick, k) for k, e in self._blocks.items() if not e.children]
                heapq.heapify(self._leaves)

    def _evict_one(self) -> None:
        """Drop the least recently used leaf (callers guarantee one exists)."""
        while True:
            tick, key = heapq.heappop(self._leaves)
            entry = self._blocks.get(key)
            if entry is not None and entry.tick == tick and not entry.children:
                self._remove(key, entry)
                return

    def _remove(self, key: _Key, entry: _Entry) -> None:
        """Drop one childless block; its parent may become a leaf."""
        del self._blocks[key]
        self._used_bytes -= entry.data.nbytes
        self._events.setdefault(key[0], {})[key[1]] = False
        if entry.parent is not None:
            parent = self._blocks[entry.parent]
            parent.children.discard(key)
            if not parent.children:
                heapq.heappush(self._leaves, (parent.tick, entry.parent))

    def _drop_subtree(self, root: _Key) -> int:
        order, stack = [], [root]
        while stack:
            key = stack.pop()
            order.append(key)
            stack.extend(self._blocks[key].children)
        for key in reversed(order):  # children before their parents
            self._remove(key, self._blocks[key])
        return len(order)
