"""`RadixIndex.check_invariants`: a full, slow consistency check (tests run it after every mutation)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from kvpool.index.columns import NO_ROW, seq_tag
from kvpool.index.node_removal import is_doomed

if TYPE_CHECKING:
    from kvpool.index.radix import RadixIndex


def _fail(message: str) -> None:
    raise RuntimeError(f"radix index invariant broken: {message}")


def check_invariants(index: RadixIndex) -> None:
    c = index._c
    alive = [int(r) for r in c.alive_rows()]
    if len(alive) != c.num_alive:
        _fail(f"num_alive {c.num_alive} != {len(alive)} alive rows")
    _check_table(index, alive)
    counts = (
        np.bincount(c.ns_slot[alive], minlength=len(index._ns_ids)).tolist()
        if alive
        else [0] * len(index._ns_ids)
    )
    free = set(index._ns_free)
    if len(free) != len(index._ns_free):
        _fail("a namespace slot is on the free list twice")
    groups: Counter[str] = Counter()
    for slot, ns in enumerate(index._ns_ids):
        if slot in free:
            if counts[slot] or index._ns_valid[slot] or slot in index._pending:
                _fail(f"free namespace slot {slot} is in use")
            continue
        group = index._ns_group[slot]
        if group is not None and index._ns_valid[slot]:
            groups[group] += counts[slot]
        active = index._ns_active.get(ns) == slot
        if active != index._ns_valid[slot]:
            _fail(f"namespace slot {slot} validity disagrees with the active map")
        if counts[slot] != index._ns_count[slot]:
            _fail(f"namespace slot {slot} counts {index._ns_count[slot]} blocks, holds {counts[slot]}")
        if not active and counts[slot] and slot not in index._pending:
            _fail(f"invalidated namespace slot {slot} holds blocks but is not pending reclamation")
    if any(index.num_blocks_in_group(g) != n for g, n in groups.items()) or any(
        n != groups[g] for g, n in index._group_blocks.items()
    ):
        _fail(f"group block counts {index._group_blocks} != {dict(groups)}")
    pins: Counter[int] = Counter()
    for lease in index._leases.live.values():
        for row, gen in zip(lease.rows.tolist(), lease.gens.tolist(), strict=True):
            if c.alive[row] and c.gen[row] == gen:
                pins[row] += 1
    slots: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    heap_seqs = {seq_tag(entry[2]) for entry in index._heap}
    doomed = dict(zip(alive, is_doomed(index, np.array(alive, np.int64)).tolist(), strict=True))
    # (a doomed row, dropped by a later step of the running node removal, may be a leaf without an entry)
    for row in alive:
        if not 0 <= int(c.ns_slot[row]) < len(index._ns_ids):
            _fail(f"row {row} names no namespace slot")
        parent = int(c.parent[row])
        if parent != NO_ROW and (not c.alive[parent] or c.ns_slot[parent] != c.ns_slot[row]):
            _fail(f"row {row}: parent {parent} is not resident in the same namespace (not prefix-closed)")
        children = c.children(row)
        if len(children) != c.num_children[row] or any(int(c.parent[ch]) != row for ch in children):
            _fail(f"row {row}: child links disagree with num_children {c.num_children[row]}")
        head = int(c.run_head[row])
        if head > row or (head < row and (parent != row - 1 or int(c.run_head[row - 1]) != head)):
            _fail(f"row {row}: run head {head} is not the start of a run of parent links")
        if c.lock_ref[row] < 0:
            _fail(f"row {row}: negative lock_ref")
        if c.num_leases[row] != pins[row]:
            _fail(f"row {row}: num_leases {c.num_leases[row]} but {pins[row]} live leases pin it")
        if not c.locations[row]:
            _fail(f"row {row} has no replica")
        for loc in c.locations[row]:
            if index.is_dying(loc.node_id):
                continue  # a node removal runs: its space was forgotten, its rows leave step by step
            slots[loc.node_id] += 1
            nbytes[loc.node_id] += int(c.size_bytes[row])
            if row not in index._space.rows_on(loc.node_id):
                _fail(f"row {row} missing from node {loc.node_id}'s rows")
        if index._evictable(row) and int(c.heap_seq[row]) not in heap_seqs and not doomed[row]:
            _fail(f"evictable leaf row {row} has no heap entry")
    _check_depth(index, alive)
    protected = sum(1 for row in alive if c.lock_ref[row] > 0 or c.num_leases[row] > 0)
    if c.num_protected != protected:
        _fail(f"protected-block counter {c.num_protected} but {protected} rows are locked or leased")
    for node in index._space.nodes():
        if index.num_blocks_on_node(node) != slots[node] or index.bytes_on_node(node) != nbytes[node]:
            _fail(
                f"node {node}: accounting {index.num_blocks_on_node(node)} slots / "
                f"{index.bytes_on_node(node)} B, actual {slots[node]} / {nbytes[node]}"
            )
        for row in index._space.rows_on(node):
            if not c.alive[row] or all(loc.node_id != node for loc in c.locations[row]):
                _fail(f"node {node} lists row {row} without a replica there")


def _check_depth(index: RadixIndex, alive: list[int]) -> None:
    c, limit = index._c, len(alive) + 1
    for row in alive:
        steps, up = 0, row
        while up != NO_ROW:
            up = int(c.parent[up])
            steps += 1
            if steps > limit:
                _fail(f"row {row}: parent links form a cycle")


def _check_table(index: RadixIndex, alive: list[int]) -> None:
    """Every alive row is found under its own (slot, hash) and the table holds nothing else."""
    c, table = index._c, index._table
    rows = np.array(alive, dtype=np.int64)
    entries = table.rows()
    if table.count != len(entries) or len(entries) != len(rows):
        _fail(f"hash table holds {len(entries)} entries (counts {table.count}) for {len(rows)} rows")
    if table.tombs != int(np.count_nonzero(table.table == -2)):
        _fail("hash table tombstone count is off")
    if not len(rows):
        return
    found = table.find_many(c.ns_slot[rows], c.h64[rows])
    bad = np.flatnonzero(found != rows)
    if bad.size:
        row = int(rows[bad[0]])
        _fail(f"hash table maps row {row}'s key ({c.hash_of(row).hex()}) to {int(found[bad[0]])}")
