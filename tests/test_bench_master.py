"""`kvpool bench master --blocks N` end to end on a tiny setting: the bundled trace's tree filled past one
namespace (so the last one is cut short), every phase reported, matches exactly the hits resident."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.bench.master_bench import run_master_bench
from kvpool.bench.master_scale_work import TreePuts, parse_count
from kvpool.bench.routing import BUNDLED_TRACE
from kvpool.errors import InvalidArgument
from tests.capabilities import require_ucx

transfer = pytest.importorskip("transfer")


def test_parse_count() -> None:
    assert [parse_count(t) for t in ("4096", "500K", "1M", "2.5M", "20m")] == [
        4096,
        500_000,
        1_000_000,
        2_500_000,
        20_000_000,
    ]
    for bad in ("", "1T", "M", "-1", "0", "1.5.2M"):
        with pytest.raises(InvalidArgument):
            parse_count(bad)


def test_the_trace_tree_has_each_block_once_below_one_parent() -> None:
    tree = TreePuts.from_trace(BUNDLED_TRACE)
    assert tree.num_blocks == len(set(tree.ids.tolist()))  # every block published once
    seen: set[int] = set()
    for s, e, p in zip(tree.starts, tree.ends, tree.parents, strict=True):
        assert p == -1 or int(p) in seen  # a put's parent was published before it
        seen.update(int(h) for h in tree.ids[s:e])


@pytest.mark.slow  # a fill, a master restart, a node death (its heartbeat timeout): about a minute
@pytest.mark.parametrize(("client", "unary", "depth"), [("lean", False, 2), ("api", False, 1)])
def test_bench_master_reports_every_phase(tmp_path: Path, client: str, unary: bool, depth: int) -> None:
    require_ucx()
    out = tmp_path / "master.json"
    n = 12_000  # the bundled tree holds 9,821 blocks: a second namespace, cut short
    run_master_bench(
        blocks=n,
        prompt_blocks=16,
        clients=2,
        prompts=64,
        duration_s=0.6,
        unary=unary,
        depth=depth,
        client=client,
        stores=2,
        writers=2,
        publish_chains=4,
        trace=BUNDLED_TRACE,
        json_out=out,
        progress=False,
    )
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["blocks"] == n and s["namespaces"] == 2 and s["client"] == client
    assert s["bytes_per_block"] > 0 and s["peak_bytes_per_block"] >= s["bytes_per_block"]
    assert s["match_per_s"] > 0 and 0 < s["match_p50_ms"] <= s["match_p99_ms"]
    assert s["short_matches"] == 0 and s["no_short_matches_met"] is True
    assert 1 <= s["hit_blocks_per_match"] <= 16
    assert s["publish_blocks_per_s"] > 0 and s["publish_e2e_blocks_per_s"] > 0
    assert s["store_mode"] == "metadata-only" and s["fill_calls"] > 0
    assert isinstance(s["bytes_per_extra_replica"], float) and s["publish_two_replicas_blocks_per_s"] > 0
    published = 2 * 2 * 4 * 16  # two passes (one replica, two) x 2 clients x 4 chains x 16 blocks
    assert (
        s["rebuild_target_blocks"] == n + published
        and s["rebuild_blocks_reached"] >= s["rebuild_target_blocks"]
    )
    assert s["rebuild_blocks_per_s"] > 0 and s["first_hit_s"] is not None
    assert s["evict_blocks"] > 0 and s["node_death_blocks"] > 0
    assert s["node_death_lock_ms"] > 0 and s["watermark_tick_ms"] > 0
    assert isinstance(s["target_met"], bool)  # graded from its own figures (they vary with the host)
    for r in report["records"]:
        assert r["matches"] > 0 and r["short_matches"] == 0
        assert r["mode"].endswith(client)


def test_a_run_that_would_not_fit_in_memory_is_refused_before_it_starts() -> None:
    from kvpool.bench.master_bench import check_memory
    from kvpool.bench.master_scale import memory_estimate_bytes

    need, have = check_memory(1000, 0)
    assert 0 < need < have
    assert memory_estimate_bytes(20_000_000) > 20_000_000 * 240  # the master alone at the target peak
    with pytest.raises(InvalidArgument, match="GiB of RAM"):
        check_memory(10**12, 0)
