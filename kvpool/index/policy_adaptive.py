"""`tail` and `adaptive`: the eviction research issue's policies (see README, "Eviction policy research").

Both rank evictable leaves by a key (smallest first), like every `EvictionPolicy`; the index keeps the
tree prefix-closed and only ever offers leaves.

- `tail` (tail-first LRU, the default): a block smaller than the largest block seen so far is the partial
  last block of some prompt. Any longer prompt through the same tokens extends that block, so its hash
  changes: only an exact repeat of the prompt can hit it again (0.7 % of such blocks are reused in
  Mooncake's conversation trace, 5 % in the synthetic one). Tail blocks go first, least recent first; the
  rest is LRU.
- `adaptive`: `tail`, plus an ARC-style adaptive split between recency and frequency.
  Blocks never hit since insertion ("new", ARC's T1) are keyed by last access; blocks hit at least once
  ("reused", ARC's T2) get `alpha * T` added, where `T` is the cache's current eviction age (the age of
  the eviction frontier, as GDSF's inflation value `L` tracks it: Cherkasova 1998) so the bonus scales with
  the capacity and the load. `alpha` is learnt from ghost hits as in ARC (Megiddo & Modha, FAST'03,
  "ARC: A Self-Tuning, Low Overhead Replacement Cache"): evicted blocks are remembered with their class
  for `3 T`; a block that comes back within `2 T` of its eviction counts as a ghost hit of its class: a new
  block coming back lowers `alpha` by `delta` (recency deserved more room), a reused one raises it. This
  is also LeCaR's regret signal (Vietri et al., HotStorage'18, "Driving Cache Replacement with ML-based
  LeCaR") with two experts, LRU and "frequency first", mixed through one weight.

The index only tells a policy a block's statistics when it (re)keys an evictable leaf and the key of each
block it evicts, so the policy maps keys back to blocks itself (`_by_key`) and notices a ghost hit when
the returning block is keyed as a leaf again (at the latest just before it is evicted again); with
`hit_count == 0` its `last_access_ms` is its re-insertion time. Blocks the index drops for other reasons
(node loss, namespace invalidation) are never reported: the tracking maps are bounded by `max_tracked`
(oldest first). Every operation is O(1) amortised (dicts and one FIFO), O(log n) with the index's heap.
Because `alpha` and `T` move, an access can (rarely) lower a block's key although
`keys_rise_on_access` is declared: the index then evicts that leaf a little later than its current key
says, never an interior block.
"""

from __future__ import annotations

import contextlib
from collections import deque

from kvpool.errors import InvalidArgument
from kvpool.index.policies import BlockStats
from kvpool.types import BlockHash

TAIL_OFFSET_MS = float(2**40)
"""Subtracted from a tail block's key: it goes before any full block (≈ 35 years of recency)."""


class TailFirstLRUPolicy:
    """LRU, except that partial tail blocks (smaller than the largest block seen) go first."""

    name = "tail"
    half_life_ms: float | None = None
    keys_rise_on_access = True

    def __init__(self) -> None:
        self.max_size_bytes = 0

    def is_tail(self, stats: BlockStats) -> bool:
        if stats.size_bytes > self.max_size_bytes:
            self.max_size_bytes = stats.size_bytes
        return stats.size_bytes < self.max_size_bytes

    def key(self, stats: BlockStats) -> float:
        key = float(stats.last_access_ms)
        return key - TAIL_OFFSET_MS if self.is_tail(stats) else key

    def on_evict(self, key: float) -> None:
        return None


_NEW, _REUSED, _TAIL = 0, 1, 2


class AdaptiveTailARCPolicy(TailFirstLRUPolicy):
    """Tail-first, then `last_access_ms + alpha * T * [hit_count > 0 or ghost hit]`, `alpha` learnt
    ARC-style from ghost hits (module docstring). Defaults: `alpha` starts at 0.5, moves by 0.05 per
    ghost hit within [0, 4]."""

    name = "adaptive"

    def __init__(
        self,
        *,
        alpha: float = 0.5,
        delta: float = 0.05,
        alpha_max: float = 4.0,
        max_tracked: int = 1 << 22,
    ) -> None:
        if not 0.0 <= alpha <= alpha_max or delta < 0 or max_tracked < 1:
            raise InvalidArgument(
                "adaptive needs 0 <= alpha <= alpha_max, delta >= 0 and max_tracked >= 1, got "
                f"{alpha}, {alpha_max}, {delta}, {max_tracked}"
            )
        super().__init__()
        self.alpha, self.delta, self.alpha_max, self.max_tracked = alpha, delta, alpha_max, max_tracked
        self.now_ms = 0.0  # the latest access time seen
        self.frontier = 0.0  # the largest key of a full block evicted so far (GDSF's L)
        self.ghost_hits = [0, 0]  # per class: new, reused
        self._live: dict[BlockHash, tuple[float, int]] = {}  # block -> (its current key, class)
        self._by_key: dict[float, deque[BlockHash]] = {}  # key -> blocks keyed so, in push order
        self._ghosts: dict[BlockHash, tuple[int, float]] = {}  # evicted block -> (class, when), FIFO

    @property
    def eviction_age_ms(self) -> float:
        """`T`: how long ago the eviction frontier was last accessed (at least 1 ms)."""
        return max(self.now_ms - self.frontier, 1.0)

    def key(self, stats: BlockStats) -> float:
        block, last = stats.block_hash, float(stats.last_access_ms)
        self.now_ms = max(self.now_ms, last)
        ghost = self._ghosts.pop(block, None)
        if ghost is not None and last - ghost[1] <= 2.0 * self.eviction_age_ms:
            self._ghost_hit(ghost[0])
        self._forget(block)
        if self.is_tail(stats):
            cls, key = _TAIL, last - TAIL_OFFSET_MS
        elif stats.hit_count > 0 or ghost is not None:
            cls, key = _REUSED, last + self.alpha * self.eviction_age_ms
        else:
            cls, key = _NEW, last
        self._live[block] = (key, cls)
        self._by_key.setdefault(key, deque()).append(block)
        if len(self._live) > self.max_tracked:
            self._forget(next(iter(self._live)))
        return key

    def on_evict(self, key: float) -> None:
        blocks = self._by_key.get(key)
        if not blocks:
            return
        block = blocks.popleft()
        if not blocks:
            del self._by_key[key]
        _, cls = self._live.pop(block)
        if cls == _TAIL:
            return
        self.frontier = max(self.frontier, key)
        self._ghosts[block] = (cls, self.now_ms)
        horizon = self.now_ms - 3.0 * self.eviction_age_ms
        while self._ghosts:
            oldest = next(iter(self._ghosts))
            if self._ghosts[oldest][1] >= horizon and len(self._ghosts) <= self.max_tracked:
                break
            del self._ghosts[oldest]

    def _ghost_hit(self, cls: int) -> None:
        self.ghost_hits[cls] += 1
        if cls == _NEW:
            self.alpha = max(0.0, self.alpha - self.delta)
        else:
            self.alpha = min(self.alpha_max, self.alpha + self.delta)

    def _forget(self, block: BlockHash) -> None:
        old = self._live.pop(block, None)
        if old is None:
            return
        blocks = self._by_key.get(old[0])
        if blocks is not None:
            with contextlib.suppress(ValueError):
                blocks.remove(block)
            if not blocks:
                del self._by_key[old[0]]
