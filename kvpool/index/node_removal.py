"""Removing a dead node's replicas from `RadixIndex` in bounded steps (the master releases its lock between them).

Rules:
1. `begin` is O(1): the node is marked dying in the index's node table. From then on no match offers a
   location on it and stops before a block whose every replica is there (so before every block that is
   about to be dropped: they all hang below one), `lookup` hides such blocks, and inserts refuse a location
   on a dying node, a parent being dropped, or extending a block being dropped (`NotFound` /
   `FailedPrecondition`: the caller's commit fails instead of hanging a child below an orphan).
2. Each `step` does a bounded amount of work (`max_rows` rows, or one window of the replica columns); between
   steps every invariant of the index holds (`check_invariants`). Phases:
   a. scan: windows of the first-replica column find the rows with a replica on the node. A row with another
      replica loses this one (a survivor, to re-replicate: returned as columns); a row left with none is an
      orphan, marked doomed.
   b. closure: a breadth-first frontier over `first_child` / `next_sibling` from the orphans marks every
      descendant doomed. A child inserted before its parent was marked is found when the parent is expanded;
      one under a marked row is refused (rule 1).
   c. order: once every doomed row is known, a second frontier from the tops (doomed rows whose parent is
      not doomed) lists them parents before children, each row's siblings together.
   d. drop: rows are dropped from the end of that list, about `max_rows` at a time (never splitting a sibling
      group), so each drop is closed under descendants and the tree stays prefix-closed.
   Rows dropped meanwhile by other paths (eviction, reclamation) are skipped by generation.
3. Removals run one at a time (a second dying node waits for the first; its replicas are hidden meanwhile).
Cost: O(rows on the node + their descendants) numpy work overall, O(max_rows) per step, plus Python work per
multi-replica row of the node, per top whose parent stays (one unlink) and per sibling step of the frontier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpool.index.columns import NO_ROW, Columns
from kvpool.index.results import DroppedRows, Survivors

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex

STEP_ROWS = 1 << 14
"""Rows handled per step (frontier expansion, ordering, drop)."""
SCAN_ROWS = 1 << 17
"""Rows of the replica columns scanned per step."""
MAX_MULTI_ROWS = 1 << 13
"""Multi-replica rows (Python work each) handled per scan step."""

_EMPTY = np.empty(0, np.int64)


class NodeRemoval:
    """The state of one dying node's removal (see the module docstring). Built by `RadixIndex.begin_remove_node`."""

    def __init__(self, index: RadixIndex, node_id: str) -> None:
        self.index = index
        self.node_id = node_id
        self.k = index._c.node_index(node_id)
        self.phase = "scan"
        self._cursor = 0
        self._frontier: list[tuple[np.ndarray, np.ndarray]] = []  # closure: (rows, gens) to expand
        self._doomed: list[tuple[np.ndarray, np.ndarray]] = []  # every doomed row found, (rows, gens)
        self._tops: list[tuple[np.ndarray, np.ndarray]] = []
        self._level: list[tuple[np.ndarray, np.ndarray]] = []  # order: the frontier being listed
        self._order: list[tuple[np.ndarray, np.ndarray]] = []  # parents before children, groups whole
        self.num_dropped = 0

    @property
    def done(self) -> bool:
        return self.phase == "done"

    # ---- doomed marks: `tag[row] == gen[row] + 1` (uint32; a freed or reused row is not doomed) ------------------------
    def _mark(self, rows: np.ndarray) -> None:
        ix = self.index
        c = ix._c
        if rows.size:
            need = int(rows.max()) + 1
            if need > len(ix._doomed_tag):
                grown = np.zeros(max(need, c.capacity), np.uint32)
                grown[: len(ix._doomed_tag)] = ix._doomed_tag
                ix._doomed_tag = grown
            ix._doomed_tag[rows] = c.gen[rows] + np.uint32(
                1
            )  # (wraps to 0, "not doomed", after 2**32 - 1 frees)

    def is_doomed(self, rows: np.ndarray) -> np.ndarray:
        return is_doomed(self.index, rows)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, max_rows: int = STEP_ROWS) -> tuple[DroppedRows | None, Survivors | None]:
        """Do one bounded piece of work; returns what was dropped (or None) and the blocks that lost a
        replica but keep another (or None)."""
        if self.phase == "scan":
            return None, self._scan()
        if self.phase == "closure":
            self._expand(max_rows)
        elif self.phase == "tops":
            self._find_tops(max_rows)
        elif self.phase == "order":
            self._list(max_rows)
        elif self.phase == "drop":
            return self._drop(max_rows), None
        return None, None

    def _scan(self) -> Survivors | None:
        ix = self.index
        c = ix._c
        lo, hi = self._cursor, min(self._cursor + SCAN_ROWS, c.high_water)
        window = slice(lo, hi)
        multi = np.flatnonzero(c.has_extra[window] & c.alive[window]) + lo
        if len(multi) > MAX_MULTI_ROWS:  # cut the window: Python work per multi-replica row
            hi = int(multi[MAX_MULTI_ROWS])
            multi = multi[:MAX_MULTI_ROWS]
            window = slice(lo, hi)
        single = np.flatnonzero((c.rep_node[window] == self.k) & ~c.has_extra[window] & c.alive[window]) + lo
        orphans = [single[~self.is_doomed(single)]]
        kept: list[int] = []
        for row in multi.tolist():
            locs = c.replicas(row)
            if all(x.node_id != self.node_id for x in locs):
                continue
            rest = tuple(x for x in locs if x.node_id != self.node_id)
            if rest:
                c.set_replicas(row, rest)  # (the node's space was forgotten when it began dying)
                kept.append(row)
            elif not self.is_doomed(np.array([row]))[0]:
                orphans.append(np.array([row], np.int64))
        found = np.concatenate(orphans)
        if found.size:
            self._mark(found)
            pair = (found, c.gen[found].copy())
            self._frontier.append(pair)
            self._doomed.append(pair)
        self._cursor = hi
        if hi >= c.high_water:
            self.phase = "closure"
        if not kept:
            return None
        rows = np.array(kept, np.int64)
        return Survivors(tuple(ix._ns_ids), c.ns_slot[rows].copy(), c.h64[rows].copy())

    def _take(self, stack: list[tuple[np.ndarray, np.ndarray]], max_rows: int) -> np.ndarray:
        """Up to `max_rows` rows from the end of `stack` that are still alive at their generation."""
        c = self.index._c
        rows, gens = stack.pop()
        if len(rows) > max_rows:
            stack.append((rows[:-max_rows], gens[:-max_rows]))
            rows, gens = rows[-max_rows:], gens[-max_rows:]
        ok = c.alive[rows] & (c.gen[rows] == gens)
        return rows[ok]

    def _expand(self, max_rows: int) -> None:
        """Closure: mark the children of a frontier chunk doomed; they join the frontier."""
        c = self.index._c
        if not self._frontier:
            self.phase = "tops"
            return
        rows = self._take(self._frontier, max_rows)
        kids = children_of(c, rows)
        kids = kids[~self.is_doomed(kids)]
        if kids.size:
            self._mark(kids)
            pair = (kids, c.gen[kids].copy())
            self._frontier.append(pair)
            self._doomed.append(pair)

    def _find_tops(self, max_rows: int) -> None:
        c = self.index._c
        if not self._doomed:
            self._level = self._tops
            self._tops = []
            self.phase = "order"
            return
        rows = self._take(self._doomed, max_rows)
        parents = c.parent[rows].astype(np.int64)
        top = parents == NO_ROW
        top[~top] = ~self.is_doomed(parents[~top])
        rows = rows[top]
        if rows.size:
            rows = rows[np.argsort(c.parent[rows], kind="stable")]  # siblings together
            self._tops.append((rows, c.gen[rows].copy()))

    def _list(self, max_rows: int) -> None:
        """Order: append a chunk of the current frontier to the list, queue its children (grouped)."""
        c = self.index._c
        if not self._level:
            self.phase = "drop"
            return
        rows, gens = self._level.pop(0)
        if len(rows) > max_rows:
            cut = _group_end(c, rows, max_rows)
            self._level.insert(0, (rows[cut:], gens[cut:]))
            rows, gens = rows[:cut], gens[:cut]
        ok = c.alive[rows] & (c.gen[rows] == gens)
        rows, gens = rows[ok], gens[ok]
        if not rows.size:
            return
        self._order.append((rows, gens))
        kids = children_of(c, rows)
        if kids.size:
            kids = kids[np.argsort(c.parent[kids], kind="stable")]
            self._level.append((kids, c.gen[kids].copy()))

    def _drop(self, max_rows: int) -> DroppedRows | None:
        ix = self.index
        c = ix._c
        if not self._order:
            self.phase = "done"
            return None
        rows, gens = self._order.pop()
        if len(rows) > max_rows:  # the end of the chunk, from a sibling-group boundary
            cut = _group_start(c, rows, len(rows) - max_rows)
            if cut:
                self._order.append((rows[:cut], gens[:cut]))
                rows, gens = rows[cut:], gens[cut:]
        rows = rows[c.alive[rows] & (c.gen[rows] == gens)]
        if not rows.size:
            return None
        from kvpool.index.bulk_drop import drop_rows

        self.num_dropped += len(rows)
        return drop_rows(ix, rows, "orphan", doomed_parents=self.is_doomed)


def is_doomed(index: RadixIndex, rows: np.ndarray) -> np.ndarray:
    """(n,) bool: which of `rows` the running node removal will drop."""
    tag = index._doomed_tag
    rows = np.asarray(rows, np.int64)
    inside = rows < len(tag)
    out = np.zeros(len(rows), np.bool_)
    r = rows[inside]
    out[inside] = tag[r] == index._c.gen[r] + np.uint32(1)
    return out


def children_of(c: Columns, rows: np.ndarray) -> np.ndarray:
    """Every child of `rows` ((m,) int64), one numpy step per sibling position."""
    out: list[np.ndarray] = []
    cur = c.first_child[rows].astype(np.int64)
    cur = cur[cur != NO_ROW]
    while cur.size:
        out.append(cur)
        cur = c.next_sibling[cur].astype(np.int64)
        cur = cur[cur != NO_ROW]
    return np.concatenate(out) if out else _EMPTY


def _group_start(c: Columns, rows: np.ndarray, at: int) -> int:
    """The last index <= `at` where `rows` (grouped by parent) starts a new parent (0 if none)."""
    parents = c.parent[rows[: at + 1]]
    change = np.flatnonzero(parents[1:] != parents[:-1])
    return int(change[-1]) + 1 if change.size else 0


def _group_end(c: Columns, rows: np.ndarray, at: int) -> int:
    """The first index >= `at` where `rows` (grouped by parent) starts a new parent (len(rows) if none)."""
    parents = c.parent[rows]
    if at <= 0:
        return 0
    change = np.flatnonzero(parents[at:] != parents[at - 1])
    return at + int(change[0]) if change.size else len(rows)
