"""`kvpool bench master-churn` on a tiny setting: the report's fields, full matches, bounded state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.bench.master_churn import run_master_churn
from tests.capabilities import require_ucx

transfer = pytest.importorskip("transfer")


def test_master_churn_reports_bounded_state(tmp_path: Path) -> None:
    require_ucx()
    out = tmp_path / "churn.json"
    run_master_churn(
        cycles=20, salts=200, matches=100, reps=2, blocks=8, prompts=4, churn_blocks=1, json_out=out
    )
    report = json.loads(out.read_text())
    s = report["summary"]
    assert report["benchmark"] == "master-churn" and s["cycles"] == 20 and s["salts"] == 200
    for key in ("match_p50_before_ms", "match_p99_before_ms", "match_p50_after_ms", "match_p99_after_ms"):
        assert s[key] > 0
    assert s["rss_before_mib"] > 0 and s["rss_after_mib"] > 0 and "match_p99_slower_beyond_noise" in s
    # 20 flushes of one namespace add nothing; 200 salts add one namespace each (plus the flushed one)
    assert s["num_namespaces_before"] == 1 and s["num_namespaces_after_cycles"] == 2
    assert s["num_namespaces_after"] == s["num_namespaces_before"] + 1 + 200
    assert s["num_blocks_before"] == 4 * 8 and s["short_matches"] == 0
    assert s["namespaces_met"] is True and s["no_short_matches_met"] is True and s["rss_growth_met"] is True
    assert isinstance(s["target_met"], bool)  # p99 within the noise varies with the host
    assert [r["phase"] for r in report["records"]] == ["before", "before", "after", "after"]
    assert all(r["matches"] == 100 and r["short_matches"] == 0 for r in report["records"])
