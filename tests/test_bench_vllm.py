"""`kvpool bench vllm`: records, summary, verdicts, table, JSON and plot from synthetic engine results
(no vllm, no engines)."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from kvpool.bench.vllm_bench import (
    engine_job,
    make_prompts,
    parse_pulls,
    parse_result,
    run_engine,
    vllm_version,
)
from kvpool.bench.vllm_report import plot_report, prefix_record, print_report, summarize
from kvpool.errors import InvalidArgument
from kvpool.report import write_report

TOKENS = [7, 8, 9]


def _res(
    ttft_s: float, cached: int = 0, tokens: list[int] = TOKENS, report: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "tokens": tokens,
        "num_cached_tokens": cached,
        "ttft_s": ttft_s,
        "e2e_s": ttft_s + 0.1,
        "kvpool": report or {},
    }


def _pool_report(predicted_pull_s: float = 0.02) -> dict[str, Any]:
    return {
        "decision": "load",
        "reason": "pull cheaper",
        "num_pool_blocks": 128,
        "num_loaded_tokens": 8192,
        "loaded_bytes": 128 * 256 * 1024,
        "predicted_pull_s": predicted_pull_s,
        "predicted_recompute_s": 1.2,
        "match_s": 0.003,
        "num_saved_blocks": 129,
        "load_failed": False,
    }


def _records(
    pool_ttft_s: float = 0.05,
    predicted: float = 0.025,
    bad_tokens: int = 0,
    pull_s: float = 0.02,
    unmeasured: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    recs = []
    for i in range(5):
        cold = [_res(1.0 + 0.01 * i), _res(1.0 + 0.01 * i, tokens=[1, 2])]
        local = [
            _res(1.1, report={"decision": "miss", "num_saved_blocks": 129}),
            _res(0.02, cached=8192, tokens=[1, 2], report={"decision": "none", "num_saved_blocks": 129}),
        ]
        toks = [1, 3] if i < bad_tokens else [1, 2]
        pool = _res(pool_ttft_s, cached=8192, tokens=toks, report=_pool_report(predicted))
        pull = None if i in unmeasured else {"pull_s": pull_s}
        recs.append(prefix_record(i, cold, local, pool, pull))
    return recs


def test_prefix_record_takes_the_pool_report_and_compares_tokens() -> None:
    r = _records(bad_tokens=1, unmeasured=(0,))
    assert r[0]["greedy_equal"] is False and r[1]["greedy_equal"] is True
    assert r[0]["local_greedy_equal"] is True
    assert r[0]["pool_over_cold"] == pytest.approx(0.05)
    assert r[0]["pool_minus_local_s"] == pytest.approx(0.03)
    assert (
        r[0]["decision"] == "load" and r[0]["loaded_bytes"] == 32 * 2**20 and r[0]["num_pool_blocks"] == 128
    )
    assert r[0]["local_decision"] == "none" and r[0]["published_blocks"] == 129
    assert r[0]["pull_s"] is None and r[1]["pull_s"] == 0.02
    assert r[0]["pull_plus_match_s"] is None and r[1]["pull_plus_match_s"] == pytest.approx(0.023)
    assert r[0]["pull_over_predicted"] is None and r[1]["pull_over_predicted"] == pytest.approx(0.8)
    assert r[0]["kvpool"]["pool"]["predicted_recompute_s"] == 1.2


def test_summary_medians_and_all_targets_met() -> None:
    s = summarize(_records(), prefix_tokens=8192, question_tokens=50)
    assert s["cold_ttft_s"] == pytest.approx(1.02) and s["local_ttft_s"] == 0.02 and s["pool_ttft_s"] == 0.05
    assert s["pool_over_cold"] == pytest.approx(0.05 / 1.02)
    assert s["pool_minus_local_s"] == pytest.approx(0.03) and s["predicted_pull_s"] == 0.025
    assert s["pull_s"] == 0.02 and s["loaded_bytes_total"] == 5 * 32 * 2**20
    assert s["pull_over_predicted"] == pytest.approx(0.8) and s["num_pulls_measured"] == 5
    assert s["pull_plus_match_s"] == pytest.approx(0.023)
    assert s["targets"][2]["limit"] == pytest.approx(1.5 * 0.023)  # measured pull + match, not predicted
    assert s["decisions"] == {"load": 5} and s["greedy_equal"] == 1.0 and s["greedy_equal_local"] == 1.0
    assert s["pool_over_cold_met"] and s["pool_over_cold_stretch_met"] and s["pool_minus_local_met"]
    assert s["greedy_equal_met"] and s["all_targets_met"] and s["target_met"] is True
    assert s["prefix_tokens"] == 8192


def test_summary_verdicts_when_targets_are_missed() -> None:
    # (c)/(a) 0.08: the target met, the stretch missed; (c)-(b) 0.062 > 1.5 x 0.023; 1 of 5 tokens differ
    s = summarize(_records(pool_ttft_s=0.082, predicted=0.01, bad_tokens=1))
    assert s["pool_over_cold_met"] is True and s["pool_over_cold_stretch_met"] is False
    assert s["pool_minus_local_met"] is False
    assert s["greedy_equal"] == pytest.approx(0.8) and s["greedy_equal_met"] is False
    assert s["all_targets_met"] is False and s["target_met"] is False
    # a stretch target alone does not fail the run: (c)-(b) 0.06 <= 1.5 x (0.04 + 0.003)
    s = summarize(_records(pool_ttft_s=0.08, predicted=0.1, pull_s=0.04))
    assert s["pool_over_cold_stretch_met"] is False and s["all_targets_met"] is True


def test_the_bound_is_the_measured_pull_not_the_predicted_one() -> None:
    # predicted 0.1 s would allow 0.15 s; the worker measured 0.01 s (+ 0.003 s match): (c)-(b) = 0.06 s
    # is not the pull, so the bound is missed
    s = summarize(_records(pool_ttft_s=0.08, predicted=0.1, pull_s=0.01))
    assert s["predicted_pull_s"] == 0.1 and s["pull_s"] == 0.01
    assert s["pull_over_predicted"] == pytest.approx(0.1)
    assert s["targets"][2]["limit"] == pytest.approx(1.5 * 0.013)
    assert s["pool_minus_local_met"] is False and s["target_met"] is False
    # a pull measured slower than predicted (0.04 s vs 0.01 s) that explains (c)-(b) meets it
    s = summarize(_records(pool_ttft_s=0.08, predicted=0.01, pull_s=0.04))
    assert s["pull_over_predicted"] == pytest.approx(4.0)
    assert s["pool_minus_local_met"] is True and s["target_met"] is True
    # measured slower than predicted and (c)-(b) beyond even the measured pull: missed
    s = summarize(_records(pool_ttft_s=0.2, predicted=0.01, pull_s=0.04))
    assert s["pool_minus_local_met"] is False and s["target_met"] is False


def test_an_unmeasured_pull_leaves_the_bound_not_met() -> None:
    # one prefix's pull is missing from the worker's log: its (c) may not have pulled at all
    s = summarize(_records(unmeasured=(3,)))
    assert s["num_pulls_measured"] == 4 and s["pool_minus_local_met"] is False and s["target_met"] is False


def test_a_failed_load_is_a_failure() -> None:
    recs = _records()
    recs[2]["load_failed"] = True  # the pull failed and vLLM recomputed: TTFT alone would not show it
    s = summarize(recs)
    assert s["num_load_failed"] == 1 and s["no_load_failed_met"] is False and s["target_met"] is False


def test_summary_without_a_pool_report_is_not_a_pass() -> None:
    recs = _records()
    for r in recs:
        r["predicted_pull_s"] = None
        r["pull_s"] = r["match_s"] = r["pull_plus_match_s"] = None
    s = summarize(recs)
    assert s["predicted_pull_s"] is None and s["pool_minus_local_met"] is False
    assert s["all_targets_met"] is False and s["target_met"] is False


def test_json_table_and_plot(tmp_path: Path) -> None:
    recs = _records(bad_tokens=1)
    s = summarize(recs, prefix_tokens=8192, question_tokens=50)
    out = tmp_path / "r.json"
    write_report(out, "vllm", recs, s)
    report = json.loads(out.read_text())
    assert report["benchmark"] == "vllm" and set(report) == {"benchmark", "env", "records", "summary"}
    for key in (
        "pool_over_cold",
        "pool_minus_local_s",
        "predicted_pull_s",
        "greedy_equal",
        "cold_ttft_s",
        "local_ttft_s",
        "pool_ttft_s",
        "all_targets_met",
        "target_met",
        "pull_s",
        "pull_over_predicted",
    ):
        assert key in report["summary"]
    assert len(report["records"]) == 5
    buf = io.StringIO()
    print_report(Console(file=buf, width=250, color_system=None), recs, s)
    text = buf.getvalue()
    assert (
        "(c) pool s" in text and "median" in text and "NO" in text and "missed" in text and "load x5" in text
    )
    assert "target NOT met" in text and "measured/predicted" in text
    png = tmp_path / "p.png"
    plot_report(recs, s, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_prompts_are_distinct_bytes_and_seeded() -> None:
    prefixes, q1s, q2s, warmup = make_prompts(5, 256, 10)
    assert len({tuple(p) for p in prefixes}) == 5 and all(len(p) == 256 for p in prefixes)
    assert all(0 <= t < 256 for p in [*prefixes, *q1s, *q2s, warmup] for t in p)
    assert all(a != b for a, b in zip(q1s, q2s, strict=True))
    assert make_prompts(5, 256, 10) == (prefixes, q1s, q2s, warmup)
    with pytest.raises(InvalidArgument):
        make_prompts(300, 1, 1)  # 300 one-token prefixes over 256 byte values cannot be distinct


def test_engine_job_one_request_per_phase() -> None:
    prompts = [[1] * 100, [2] * 130]
    job = engine_job(
        model_dir="/m",
        master="h:1",
        prefix_caching=True,
        prompts=prompts,
        warmup=[3] * 50,
        max_tokens=16,
        settle_s=1.0,
    )
    assert job["phases"] == [[{"prompt_token_ids": p, "max_tokens": 16}] for p in prompts]
    assert job["max_model_len"] == 192 and job["max_model_len"] >= 146 and job["block_size"] == 64
    assert job["dtype"] == "float32" and job["kv_cache_gib"] == 2 and job["settle_s"] == 1.0


def test_parse_result_and_pull_log() -> None:
    out = 'noise\nKVPOOL_RESULT {"phases": [], "startup_s": 3.0}\n'
    assert parse_result(out) == {"phases": [], "startup_s": 3.0}
    with pytest.raises(ValueError):
        parse_result("nothing here\n")
    log = (
        "INFO 12-01 10:00:00 [kvpool.vllm.worker] [0] loaded 7 of 7 blocks from the pool in 0.004s (predicted 0.003s)\n"
        "INFO 12-01 10:00:05 [kvpool.vllm.worker] [2-a1b2] loaded 128 of 128 blocks from the pool in 0.041s "
        "(predicted 0.030s)\n"
    )
    pulls = parse_pulls(log)
    assert pulls[0]["num_loaded_blocks"] == 7
    assert pulls[2] == {
        "num_loaded_blocks": 128,
        "num_blocks": 128,
        "pull_s": 0.041,
        "logged_predicted_pull_s": 0.03,
    }


NO_VLLM = importlib.util.find_spec("vllm") is None


@pytest.mark.skipif(not NO_VLLM, reason="checks the refusal of a python without vllm")
def test_a_python_without_vllm_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="has no vllm"):
        vllm_version(sys.executable)
    with pytest.raises(
        RuntimeError, match="(?s)engine cold failed.*No module named 'vllm'"
    ):  # the log's tail names the cause
        run_engine(sys.executable, {"phases": []}, "cold", tmp_path)
    assert (tmp_path / "cold.json").is_file() and (tmp_path / "cold.log").is_file()


def test_cli_registers_the_benchmark() -> None:
    from typer.testing import CliRunner

    from kvpool.cli.bench import bench_app

    result = CliRunner().invoke(bench_app, ["vllm", "--help"])
    assert result.exit_code == 0
    for opt in (
        "--num-prefixes",
        "--prefix-tokens",
        "--question-tokens",
        "--max-tokens",
        "--python",
        "--json",
        "--plot",
    ):
        assert opt in result.output
