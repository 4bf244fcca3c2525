"""`kvpool bench burst` (pull convoys, B39) end to end on a small burst, and the transport's rule that only a
transfer that ran alone measures its link."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.capabilities import require_ucx
from transfer.base import Overlap


def test_only_a_transfer_that_ran_alone_is_solo() -> None:
    ov = Overlap()
    alone = ov.begin()
    assert ov.end(alone)
    first = ov.begin()
    second = ov.begin()  # started while the first runs: both shared the link
    assert not ov.end(second)
    assert not ov.end(first)
    late = ov.begin()
    assert ov.end(late)


def test_overlap_counts_under_threads() -> None:
    ov = Overlap()

    def work() -> None:
        for _ in range(1000):
            ov.end(ov.begin())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ov.end(ov.begin())  # nothing left counted as in flight


@pytest.mark.slow
def test_a_small_burst_runs_both_arms_and_reports_the_summary_keys(tmp_path: Path) -> None:
    require_ucx()
    from kvpool.bench.burst import run_burst

    out = tmp_path / "burst.json"
    summary = run_burst(
        burst=6, prefix_tokens=128, question_tokens=8, warmup_bursts=1, rounds=2, json_out=out
    )
    keys = ("pull_ttft_p50_s", "recompute_ttft_p50_s", "pull_over_recompute", "contended_bytes_per_s")
    for key in (*keys, "pull_load_p50_s", "pull_compute_mean_s", "pull_shared_matches"):
        assert key in summary
    assert summary["recompute_ttft_p50_s"] > 0 and summary["pull_ttft_p50_s"] > 0
    assert summary["pull_num_errors"] == summary["recompute_num_errors"] == 0
    assert summary["max_compute_wait_seen_s"] > 0  # decisions saw the forwards queued on the model
    assert summary["forwards_left"] == 0  # and every forward left the queue when it ran
    assert (
        summary["recompute_decisions"] == {"recompute": 12} and sum(summary["pull_decisions"].values()) == 12
    )
    # the pull arm pulled: most of its requests decided to pull, each of those reused the prefix it pulled
    num_pulls = summary["pull_decisions"].get("pull", 0)
    assert num_pulls > summary["pull_num_requests"] / 2, summary["pull_decisions"]
    assert summary["pulled_bytes_total"] >= num_pulls * summary["block_nbytes"]
    # the measured claim (B39): pulling in a burst is not slower than recomputing. 1.25, not the
    # benchmark's target of 1: a margin for a loaded 2-core CI host
    assert summary["pull_over_recompute"] is not None and summary["pull_over_recompute"] <= 1.25, summary
    report = json.loads(out.read_text())
    pulled = [r for r in report["records"] if r["arm"] == "pull" and r.get("decision") == "pull"]
    assert len(pulled) == num_pulls and all(
        r["reused_tokens"] >= 64 and r["pulled_bytes"] > 0 for r in pulled
    )
    arms = {r["arm"] for r in report["records"]}
    assert arms == {"recompute", "pull", "warmup0"} and report["summary"]["warmup_bursts"] == 1
    assert {r["round"] for r in report["records"] if r["arm"] == "pull"} == {0, 1}
