"""The eviction research policies (`tail`, `adaptive`): exact behaviour, the default, the workloads."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from kvpool.bench.trace import replay
from kvpool.errors import InvalidArgument
from kvpool.index import DEFAULT_POLICY, POLICY_NAMES, BlockStats, RadixIndex, make_policy
from kvpool.index.policy_adaptive import TAIL_OFFSET_MS, AdaptiveTailARCPolicy, TailFirstLRUPolicy
from kvpool.trace import load_trace
from kvpool.types import BlockHash, FakeClock, Location, NamespaceId

ROOT = Path(__file__).resolve().parent.parent
NS = NamespaceId(b"P" * 16)
FULL, PART = 512, 100


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "big"))


def stats(i: int, last: int, *, hits: int = 0, size: int = FULL) -> BlockStats:
    return BlockStats(
        block_hash=h(i),
        hit_count=hits,
        last_access_ms=last,
        decayed_hits=0.0,
        size_bytes=size,
        recompute_cost_s=0.0,
    )


def make(policy: object) -> tuple[RadixIndex, FakeClock]:
    clock = FakeClock(1_000)
    index = RadixIndex(clock=clock, policy=policy)  # type: ignore[arg-type]
    index.register_namespace(NS)
    return index, clock


def put(index: RadixIndex, ids: list[int], sizes: list[int], parent: int | None = None) -> None:
    index.insert(
        NS,
        [h(i) for i in ids],
        parent=None if parent is None else h(parent),
        locations=[[Location("s0", i, 1)] for i in ids],
        size_bytes=sizes,
    )
    index.check_invariants()


def hit(index: RadixIndex, ids: list[int]) -> None:
    index.match_prefix(NS, [h(i) for i in ids], count_hit=True, lease_ttl_ms=0)


def evicted(index: RadixIndex, n: int) -> list[int]:
    res = index.evict(n)
    index.check_invariants()
    return [int.from_bytes(d.block_hash, "big") for d in res.dropped]


# ---- tail ----------------------------------------------------------------------------------------
def test_tail_goes_first_then_lru() -> None:
    index, clock = make("tail")
    put(index, [1, 2], [FULL, FULL])  # t=1000, full blocks
    clock.advance(10)
    put(index, [3, 4], [FULL, PART])  # t=1010, 4 is a partial tail
    # LRU would take 2 (older); the tail 4 goes first although newer, then LRU order resumes
    assert evicted(index, 1) == [4]
    assert evicted(index, 3) == [2, 1, 3]


def test_tail_keys() -> None:
    policy = TailFirstLRUPolicy()
    assert policy.key(stats(1, 50, size=PART)) == 50.0  # nothing larger seen yet: not a tail
    assert policy.key(stats(2, 60)) == 60.0
    assert policy.key(stats(3, 70, size=PART)) == 70.0 - TAIL_OFFSET_MS


# ---- adaptive ------------------------------------------------------------------------------------
def test_adaptive_keys_and_frontier() -> None:
    p = AdaptiveTailARCPolicy(alpha=0.5, delta=0.25)
    assert p.key(stats(1, 1_000)) == 1_000.0  # new block: last access
    assert p.eviction_age_ms == 1_000.0  # now 1000, frontier 0
    assert p.key(stats(2, 1_000, hits=1)) == 1_000.0 + 0.5 * 1_000.0  # reused: + alpha * T
    assert p.key(stats(3, 1_000, size=PART)) == 1_000.0 - TAIL_OFFSET_MS
    p.on_evict(1_000.0 - TAIL_OFFSET_MS)  # a tail: no ghost, frontier unchanged
    assert p.frontier == 0.0
    p.on_evict(1_000.0)  # block 1 goes: frontier 1000, ghost of class "new"
    assert p.frontier == 1_000.0
    assert p.eviction_age_ms == 1.0
    assert p.key(stats(4, 1_400)) == 1_400.0
    assert p.eviction_age_ms == 400.0
    # block 1 comes back (re-inserted, never hit) 400 ms after its eviction, within 2 T: a ghost hit of a
    # new block lowers alpha, and the block is keyed as reused
    assert p.key(stats(1, 1_400)) == 1_400.0 + 0.25 * 400.0
    assert p.alpha == 0.25
    assert p.ghost_hits == [1, 0]


def test_adaptive_reused_ghost_raises_alpha_and_old_ghosts_do_not_count() -> None:
    p = AdaptiveTailARCPolicy(alpha=1.0, delta=0.5, alpha_max=1.25)
    k = p.key(stats(1, 100, hits=2))
    assert k == 100.0 + 1.0 * 100.0
    p.on_evict(k)  # frontier 200 > now 100: T is floored at 1 ms
    assert p.eviction_age_ms == 1.0
    p.key(stats(1, 101))  # back within 2 T of the eviction: reused ghost -> alpha up, capped
    assert p.alpha == 1.25
    assert p.ghost_hits == [0, 1]
    k2 = p.key(stats(2, 150))
    p.on_evict(k2)  # frontier stays 200; ghost at now=150
    assert list(p._ghosts) == [h(2)]
    p.on_evict(p.key(stats(9, 10_000)))  # frontier 10000, T = 1: ghosts older than 3 T are dropped
    assert list(p._ghosts) == [h(9)]
    p.key(stats(2, 10_001))  # 2 comes back, but its ghost is gone: no ghost hit
    assert p.ghost_hits == [0, 1]


def test_adaptive_protects_reused_blocks_in_the_index() -> None:
    index, clock = make(AdaptiveTailARCPolicy(alpha=1.0, delta=0.0))
    put(index, [1], [FULL])
    put(index, [2], [FULL])
    put(index, [3], [FULL])
    clock.advance(1_000)
    hit(index, [1])  # t=2000: 1 is reused
    clock.advance(10)
    put(index, [4], [FULL])  # t=2010: new
    assert evicted(index, 1) == [2]  # frontier 1000 (block 2's key); now 2010, T = 1010
    clock.advance(500)
    put(index, [5], [FULL])  # t=2510: new
    # keys: 1 -> 2000 + 1.0 * T (re-keyed when popped), 3 -> 1000, 4 -> 2010, 5 -> 2510
    assert evicted(index, 3) == [3, 4, 5]
    assert evicted(index, 1) == [1]


def test_adaptive_bounds_its_tracking() -> None:
    p = AdaptiveTailARCPolicy(max_tracked=3)
    for i in range(10):
        p.key(stats(i, i))
    assert len(p._live) == 3
    assert sum(len(v) for v in p._by_key.values()) == 3


def test_adaptive_rejects_bad_parameters() -> None:
    with pytest.raises(InvalidArgument):
        AdaptiveTailARCPolicy(alpha=5.0)
    with pytest.raises(InvalidArgument):
        AdaptiveTailARCPolicy(delta=-1.0)


def test_new_policies_are_registered() -> None:
    assert {"tail", "adaptive"} <= set(POLICY_NAMES)
    assert isinstance(make_policy("adaptive"), AdaptiveTailARCPolicy)
    assert make_policy("adaptive") is not make_policy("adaptive")  # fresh state per index


def test_default_is_what_the_docs_say() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    section = design.split("\n## Eviction\n", 1)[1]
    match = re.search(r"\*\*Default: `([a-z]+)`\*\*", section)
    assert match is not None
    assert match.group(1) == DEFAULT_POLICY == make_policy("default").name


# ---- the generated workloads -------------------------------------------------------------------
def _gen_workloads() -> object:
    spec = importlib.util.spec_from_file_location("gen_workloads", ROOT / "scripts" / "gen_workloads.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_workloads"] = module
    spec.loader.exec_module(module)
    return module


def test_workloads_are_deterministic_valid_traces(tmp_path: Path) -> None:
    gen = _gen_workloads()
    first = gen.write(tmp_path / "a", seed=3, scale=0.02)  # type: ignore[attr-defined]
    second = gen.write(tmp_path / "b", seed=3, scale=0.02)  # type: ignore[attr-defined]
    assert [p.name for p in first] == ["rag.jsonl", "agent.jsonl", "scan.jsonl"]
    for a, b in zip(first, second, strict=True):
        assert a.read_bytes() == b.read_bytes()
        trace = load_trace(a)  # validates ids per input_length, no repeats
        assert len(trace.requests) == 80
        for policy in ("lru", "adaptive"):
            assert 0.0 <= replay(trace, policy, max(1, trace.num_unique_blocks // 10)) <= 1.0
