"""The global radix index: a tree of blocks per namespace, with leases, locks and leaf-only eviction.

Keys follow SGLang's `radix_cache.py` idea (a path from the root is a token sequence at block
granularity) with kvpool's chained 16-byte block hashes: a block hash names its whole prefix, so the tree
is one hash table from (namespace, hash) to row plus parent links (struct-of-arrays, see `columns.py`
and `hashtable.py`). A pure data
structure: no I/O, time only from the injected `Clock`. Not thread-safe: the master serialises calls.

Complexities: `match_prefix` O(log asked + runs) Python steps plus O(matched) vectorised work (see
`matching.py`); `insert` O(blocks); `evict` O(log n) per block; `invalidate_namespace` O(1)
(reclamation happens in `reclaim_invalidated` steps, see `reclaim.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpool.errors import InvalidArgument, NotFound
from kvpool.index import validate as v
from kvpool.index.columns import DEFAULT_CAPACITY, NO_ROW, Columns, seq_tag
from kvpool.index.dying import NodeRemovalMixin
from kvpool.index.hashtable import HashTable
from kvpool.index.leases import LeaseLockMixin, LeaseTable
from kvpool.index.matching import match_prefix as _match_prefix
from kvpool.index.meta import BlockMetaMixin
from kvpool.index.ns_slots import NamespaceSlotsMixin
from kvpool.index.policies import DEFAULT_POLICY, BlockStats, EvictionPolicy, make_policy
from kvpool.index.results import (
    BlockInfo,
    DroppedBlock,
    EvictResult,
    InsertResult,
    MatchResult,
)
from kvpool.index.space import NodeSpace
from kvpool.types import BlockHash, Clock, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.index.node_removal import NodeRemoval

_REBASE_EXPONENT = 512.0
"""Decayed-hit weights are 2**((t - epoch)/half_life); past this exponent the epoch moves to now."""


class RadixIndex(NamespaceSlotsMixin, LeaseLockMixin, BlockMetaMixin, NodeRemovalMixin):
    """See the module docstring and docs/design.md "The radix index"; leases and locks are in
    `leases.py` (`LeaseLockMixin`), namespace slots in `ns_slots.py` (`NamespaceSlotsMixin`), block
    metadata, bulk insert and memory accounting in `meta.py` (`BlockMetaMixin`).

    `max_blocks`: the most resident blocks the index is sized for (default `DEFAULT_CAPACITY`, 2**20);
    its row arrays are reserved for that many up front and committed by the OS as rows are first used
    (see `columns.py`), so an index that never fills costs only what it holds. More blocks still fit:
    the arrays are then reallocated at twice the size (a transient copy)."""

    def __init__(
        self, *, clock: Clock, policy: str | EvictionPolicy = DEFAULT_POLICY, max_blocks: int | None = None
    ) -> None:
        if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks <= 0):
            raise InvalidArgument(f"max_blocks must be a positive int, got {max_blocks!r}")
        self._clock = clock
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self._c = c = Columns(max_blocks or DEFAULT_CAPACITY)
        self._table = HashTable(c.h64, c.ns_slot)
        c.on_grow.append(self._rebind_table)
        self._leases = LeaseTable()
        self._space = NodeSpace(self._c)
        self._init_slots()
        self._heap: list[tuple[float, int, int, int]] = []
        self.node_removals: list[NodeRemoval] = []
        """Dying nodes whose replicas are being removed, one at a time, first first (`node_removal.py`)."""
        self._dying: dict[int, NodeRemoval] = {}  # node index -> its removal
        self._dying_mask = np.zeros(0, np.bool_)
        self._doomed_tag = np.zeros(0, np.uint32)  # while a removal runs: gen + 1 of the rows it will drop
        self._seq = 0
        self._decay_epoch_ms = clock.now_ms()
        self.num_evictions = 0
        self.num_lookup_blocks = 0
        """Blocks asked for by counted matches (`count_hit=True`)."""
        self.num_hit_blocks = 0
        """Blocks matched by counted matches."""

    def _rebind_table(self) -> None:
        self._table.bind(self._c.h64, self._c.ns_slot)

    # ---- namespaces: register / invalidate / forget in `ns_slots.py` ---------------------------------
    def reclaim_invalidated(self, max_blocks: int = 1024) -> list[DroppedBlock]:
        """Drop up to `max_blocks` blocks of invalidated namespaces, leaves first (the tree stays
        prefix-closed); leased or locked blocks wait until they are released. Returns what was dropped,
        with the slots to free. See `reclaim.py`."""
        from kvpool.index.reclaim import reclaim_invalidated

        return reclaim_invalidated(self, max_blocks)

    @property
    def num_invalidated_blocks(self) -> int:
        """Blocks of invalidated namespaces still resident (awaiting reclamation)."""
        return sum(self._ns_count[slot] for slot in self._pending)

    # ---- match / insert ---------------------------------------------------------------------------
    def match_prefix(
        self, ns: NamespaceId, block_hashes: Sequence[BlockHash], *, count_hit: bool, lease_ttl_ms: int
    ) -> MatchResult:
        """The longest run of leading `block_hashes` present under `ns`, with each block's replicas.

        `count_hit=True` bumps hit counters and recency; `count_hit=False` with `lease_ttl_ms > 0` bumps
        recency only; `count_hit=False, lease_ttl_ms=0` is a peek (changes nothing). With
        `lease_ttl_ms > 0` and a non-empty match, a lease pins the matched blocks. Unknown or invalidated
        namespaces match nothing. Raises `InvalidArgument` on a negative `lease_ttl_ms`.
        """
        return _match_prefix(self, ns, block_hashes, count_hit, lease_ttl_ms)

    def insert(
        self,
        ns: NamespaceId,
        block_hashes: Sequence[BlockHash],
        *,
        parent: BlockHash | None,
        locations: Sequence[Sequence[Location]],
        size_bytes: Sequence[int] | int,
        recompute_cost_s: Sequence[float] | float = 0.0,
    ) -> InsertResult:
        """Insert the chain `block_hashes` below `parent` (None: the namespace root). Idempotent: blocks
        already present keep their statistics and gain any new `locations` as replicas.

        Raises (before changing anything): `InvalidArgument` for an unregistered namespace, a hash that
        is not 16 bytes, a repeated hash, mismatched lengths, a non-positive size, a new block without a
        location, or a block already present under a different parent; `NotFound` when `parent` is absent.
        """
        slot = self._ns_active.get(ns)
        if slot is None:
            raise InvalidArgument(f"namespace {bytes(ns).hex()} is not registered (or was invalidated)")
        n = len(block_hashes)
        hashes = v.check_hashes(block_hashes)
        sizes = v.per_block_sizes(size_bytes, n)
        costs = v.per_block_costs(recompute_cost_s, n)
        locs = v.per_block_locations(locations, n)
        c, find = self._c, self._table.find
        prev = NO_ROW
        if parent is not None:
            got = find(slot, v.check_hash(parent, "parent"))
            if got < 0:
                raise NotFound(f"parent block {parent.hex()} is not in the index")
            prev = got
        num_existing, expected = 0, prev
        found: list[int] = []
        for h in hashes:  # the present leading blocks, then one batch lookup of the rest
            found.append(find(slot, h))
            if found[-1] < 0:
                break
        if len(found) < n:
            rest = np.frombuffer(b"".join(hashes[len(found) :]), "<u8").reshape(-1, 2)
            found.extend(self._table.find_many(slot, rest).tolist())
        for row in found:
            if row < 0:
                break
            if c.parent[row] != expected:
                raise InvalidArgument(f"block_hashes[{num_existing}] is already present under another parent")
            expected, num_existing = row, num_existing + 1
        if self._dying:  # a node removal runs: nothing joins or extends what it drops (node_removal.py)
            if prev != NO_ROW and self._hidden(prev):
                raise NotFound(f"parent block {bytes(parent or b'').hex()} is being dropped (its store died)")
            if any(self._hidden(found[i]) for i in range(num_existing)):
                raise NotFound("a block of the chain is being dropped (its store died)")
            for i in range(n):
                self._check_not_dying(locs[i], f"locations[{i}]")
        for i in range(num_existing, n):
            if found[i] >= 0:
                raise InvalidArgument(f"block_hashes[{i}] is already present under another parent")
            if not locs[i]:
                raise InvalidArgument(f"locations[{i}] is empty: a new block needs a replica")
        for i in range(num_existing):
            row = found[i]
            for loc in locs[i]:
                self._add_location_row(row, loc)
        if n > num_existing:
            self._insert_new(
                slot,
                expected,
                hashes[num_existing:],
                locs[num_existing:],
                sizes[num_existing:],
                costs[num_existing:],
            )
        return InsertResult(num_existing, n - num_existing)

    def _insert_new(
        self,
        slot: int,
        parent: int,
        hashes: list[BlockHash],
        locs: list[tuple[Location, ...]],
        sizes: list[int],
        costs: list[float],
    ) -> None:
        """Append the validated new chain `hashes` below row `parent`: O(blocks), vectorised per column."""
        c = self._c
        rows = c.alloc_chain(parent, len(hashes))
        c.ns_slot[rows] = slot
        c.last_access_ms[rows] = self._clock.now_ms()
        c.size_bytes[rows] = sizes
        c.recompute_cost_s[rows] = costs
        row_list = rows.tolist()
        c.h64[rows] = np.frombuffer(b"".join(hashes), "<u8").reshape(-1, 2)
        self._table.insert_many(rows)
        self._ns_count[slot] += len(row_list)
        self._group_add(slot, len(row_list))
        firsts = [x[0] for x in locs]
        c.rep_node[rows] = [c.node_index(x.node_id) for x in firsts]
        c.rep_slot[rows] = [x.slot for x in firsts]
        c.rep_gen[rows] = [x.generation for x in firsts]
        c.rep_local[rows] = [x.local for x in firsts]
        c.has_extra[rows] = False
        for x, size in zip(firsts, sizes, strict=True):
            self._space.add(x.node_id, size)
        for row, row_locs in zip(row_list, locs, strict=True):
            for loc in row_locs[1:]:
                self._add_location_row(row, loc)
        self._push(row_list[-1])

    def lookup(self, ns: NamespaceId, block_hash: BlockHash) -> BlockInfo | None:
        """A snapshot of one block of an active namespace, or None."""
        slot = self._ns_active.get(ns)
        row = -1 if slot is None or not _is_hash(block_hash) else self._table.find(slot, block_hash)
        if row < 0 or self._hidden(row):
            return None
        c = self._c
        parent = int(c.parent[row])
        return BlockInfo(
            ns=ns,
            block_hash=block_hash,
            parent=None if parent == NO_ROW else c.hash_of(parent),
            locations=self._live_locations(row),
            size_bytes=int(c.size_bytes[row]),
            recompute_cost_s=float(c.recompute_cost_s[row]),
            hit_count=int(c.hit_count[row]),
            last_access_ms=int(c.last_access_ms[row]),
            num_leases=int(c.num_leases[row]),
            lock_ref=int(c.lock_ref[row]),
            num_children=int(c.num_children[row]),
        )

    # ---- replicas ---------------------------------------------------------------------------------
    def add_location(self, ns: NamespaceId, block_hash: BlockHash, location: Location) -> None:
        """Record one more replica (idempotent). Raises `NotFound` for an absent block."""
        row, loc = self._row(ns, block_hash), v.check_location(location, "location")
        if self._hidden(row):
            raise NotFound(f"block {bytes(block_hash).hex()} is being dropped (its store died)")
        self._check_not_dying([loc], "location")
        self._add_location_row(row, loc)

    def remove_location(
        self, ns: NamespaceId, block_hash: BlockHash, location: Location
    ) -> list[DroppedBlock]:
        """Forget one replica (its slot is gone). A block left without replicas is dropped with its
        descendants ("orphan", even under a lease: the bytes are gone). Raises `NotFound` for an absent
        block or location. Blocks of invalidated namespaces awaiting reclamation are included."""
        row = self._row(ns, block_hash, include_invalidated=True)
        if location not in self._c.locations[row]:
            raise NotFound(f"block {block_hash.hex()} has no replica at {location}")
        self._remove_location_row(row, location)
        if self._c.locations[row]:
            return []
        return self._drop_subtree(row, "orphan")

    def num_blocks_on_node(self, node_id: str) -> int:
        """Slots (replicas) the index places on `node_id`."""
        return self._space.num_slots(node_id)

    def bytes_on_node(self, node_id: str) -> int:
        return self._space.num_bytes(node_id)

    # ---- eviction ---------------------------------------------------------------------------------
    def evict(
        self,
        num_blocks: int,
        *,
        node_id: str | None = None,
        namespaces: Collection[NamespaceId] = (),
        group: str | None = None,
        group_budgets: dict[str | None, int] | None = None,
    ) -> EvictResult:
        """Free up to `num_blocks` blocks (or, with `node_id`, slots on that node); with `namespaces`,
        only leaves of those; with `group`, only leaves of that group's namespaces (a tenant's quota);
        with `group_budgets` and `node_id`, at most so many leaves per group (pool-full eviction by
        tenants' shares); see `eviction.py`."""
        from kvpool.index.eviction import evict

        return evict(self, num_blocks, node_id, namespaces, group, group_budgets)

    @property
    def num_blocks(self) -> int:
        """Resident blocks, including those of invalidated namespaces not yet reclaimed."""
        return self._c.num_alive

    @property
    def num_protected_blocks(self) -> int:
        """Blocks under a live lease or a lock (never evicted, nor their ancestors). O(1) past the
        expiry of due leases: a counter kept on every lock, unlock, lease grant and end, and drop."""
        self.expire_leases()
        return self._c.num_protected

    @property
    def num_unprotected_blocks(self) -> int:
        """`num_blocks - num_protected_blocks` (evictable once their descendants go)."""
        return self.num_blocks - self.num_protected_blocks

    def check_invariants(self) -> None:
        """Raise `RuntimeError` on any broken invariant (tests call this after every mutation)."""
        from kvpool.index.invariants import check_invariants

        check_invariants(self)

    # ---- internals --------------------------------------------------------------------------------
    def _row(self, ns: NamespaceId, block_hash: BlockHash, *, include_invalidated: bool = False) -> int:
        slot = self._ns_active.get(ns)
        ok = _is_hash(block_hash)
        row = -1 if slot is None or not ok else self._table.find(slot, block_hash)
        if row < 0 and include_invalidated and ok:
            for pending in self._pending:
                if self._ns_ids[pending] == ns:
                    row = self._table.find(pending, block_hash)
                    if row >= 0:
                        break
        if row < 0:
            raise NotFound(f"block {bytes(block_hash).hex()} is not in namespace {bytes(ns).hex()}")
        return row

    def _hit_weight(self, now: int) -> float:
        half_life_ms = self.policy.half_life_ms
        assert half_life_ms is not None
        exponent = (now - self._decay_epoch_ms) / half_life_ms
        if exponent > _REBASE_EXPONENT:
            self._c.decayed *= 2.0**-exponent
            self._decay_epoch_ms, exponent = now, 0.0
        return float(2.0**exponent)

    def _stats(self, row: int) -> BlockStats:
        c = self._c
        last_ms = int(c.last_access_ms[row])
        decayed = 0.0
        half_life_ms = self.policy.half_life_ms
        if half_life_ms is not None:
            decayed = float(c.decayed[row]) * 2.0 ** (-(last_ms - self._decay_epoch_ms) / half_life_ms)
        hit_count = int(c.hit_count[row])
        block_hash = c.hash_of(row)
        return BlockStats(
            block_hash=block_hash,
            hit_count=hit_count,
            last_access_ms=last_ms,
            decayed_hits=decayed,
            size_bytes=int(c.size_bytes[row]),
            recompute_cost_s=float(c.recompute_cost_s[row]),
        )

    def _evictable(self, row: int) -> bool:
        c = self._c
        return bool(
            c.alive[row]
            and c.num_children[row] == 0
            and c.lock_ref[row] == 0
            and c.num_leases[row] == 0
            and self._ns_valid[c.ns_slot[row]]
        )

    def _push(self, row: int) -> None:
        """(Re)enter an evictable leaf into the eviction heap: `(key, last_access_ms, seq, row)`, so equal
        keys go least recently used first, then in push order."""
        if not self._evictable(row):
            return
        self._seq += 1
        self._c.heap_seq[row] = seq_tag(self._seq)
        self._c.stale_key[row] = False
        stats = self._stats(row)
        heapq.heappush(self._heap, (self.policy.key(stats), stats.last_access_ms, self._seq, row))
        if len(self._heap) > 2 * self._c.num_alive + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = self._heap
        self._heap = [
            entry
            for entry in heap
            if self._c.heap_seq[entry[3]] == seq_tag(entry[2]) and self._evictable(entry[3])
        ]
        heapq.heapify(self._heap)

    def _add_location_row(self, row: int, loc: Location) -> None:
        if self._c.add_replica(row, loc):
            self._space.add(loc.node_id, int(self._c.size_bytes[row]))

    def _remove_location_row(self, row: int, loc: Location) -> None:
        c = self._c
        c.set_replicas(row, tuple(x for x in c.replicas(row) if x != loc))
        self._space.remove(loc.node_id, int(c.size_bytes[row]))

    def _drop_row(self, row: int, reason: str) -> DroppedBlock:
        """Remove a childless row from every structure; its parent may become an evictable leaf."""
        c = self._c
        slot, block_hash, locs = int(c.ns_slot[row]), c.hash_of(row), c.locations[row]
        for loc in locs:
            self._remove_location_row(row, loc)
        self._table.delete_many(np.array([row], dtype=np.int64))
        self._ns_count[slot] -= 1
        if self._ns_valid[slot]:
            self._group_add(slot, -1)
        parent = int(c.parent[row])
        c.unlink_child(row)
        c.free(row)
        if parent != NO_ROW:
            self._push(parent)
        return DroppedBlock(self._ns_ids[slot], block_hash, locs, reason)

    def _drop_subtree(self, row: int, reason: str) -> list[DroppedBlock]:
        return [self._drop_row(r, reason) for r in self._c.subtree_postorder(row)]


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes) and len(value) == 16
