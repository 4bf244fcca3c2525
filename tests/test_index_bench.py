"""`kvpool bench trace` and `kvpool bench index`: replay semantics, bad input, tiny CLI runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvpool.bench.trace import parse_fractions, parse_policies, replay
from kvpool.cli.main import app
from kvpool.errors import InvalidArgument
from kvpool.trace import Trace, TraceRequest, load_trace

FIXTURE = Path(__file__).parent / "fixtures" / "conversation_200.jsonl"


def tiny_trace() -> Trace:
    reqs = (
        TraceRequest(0, 1024, (1, 2)),
        TraceRequest(1, 1500, (1, 2, 3)),  # hits 1024 of 1500
        TraceRequest(2, 700, (1, 4)),  # hits 512 of 700
        TraceRequest(3, 100, (1,)),  # hits 100 (capped at input_length)
    )
    return Trace("tiny", reqs, 4)


def test_replay_token_hit_rate_exact() -> None:
    trace = tiny_trace()
    expected = (0 + 1024 + 512 + 100) / (1024 + 1500 + 700 + 100)
    for policy in ("lru", "lfu", "fwlru", "cost", "opt", "default"):
        assert replay(trace, policy, 10) == pytest.approx(expected)


def test_replay_capacity_bounds_and_opt_beats_lru() -> None:
    trace = load_trace(FIXTURE)
    cap = max(1, trace.num_unique_blocks // 10)
    lru, opt = replay(trace, "lru", cap), replay(trace, "opt", cap)
    full = replay(trace, "lru", trace.num_unique_blocks)
    assert 0.0 <= lru <= opt <= full <= 1.0
    assert replay(trace, "lru", 0) == 0.0


def test_malformed_trace_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n{"timestamp": 1}\n'
    )
    with pytest.raises(InvalidArgument, match=r"bad.jsonl:2: missing 'input_length'"):
        load_trace(bad)
    bad.write_text('{"timestamp": 0, "input_length": 600, "hash_ids": [1]}\n')
    with pytest.raises(InvalidArgument, match=r":1: 1 hash_ids for input_length 600"):
        load_trace(bad)
    bad.write_text("not json\n")
    with pytest.raises(InvalidArgument, match=r":1: not JSON"):
        load_trace(bad)


def test_parse_arguments() -> None:
    assert parse_fractions("0.02, 0.5") == [0.02, 0.5]
    assert parse_policies("lru,default") == ["lru", "default"]
    for bad in ("-0.1", "0", "x", "1.5", ""):
        with pytest.raises(InvalidArgument, match="--capacity-frac"):
            parse_fractions(bad)
    with pytest.raises(InvalidArgument, match="unknown policy 'mru'"):
        parse_policies("lru,mru")


def test_cli_trace(tmp_path: Path) -> None:
    out, png = tmp_path / "trace.json", tmp_path / "trace.png"
    args = [
        "bench",
        "trace",
        "--trace",
        str(FIXTURE),
        "--capacity-frac",
        "0.05,0.2",
        "--policies",
        "lru,opt,default",
    ]
    res = CliRunner().invoke(app, [*args, "--json", str(out), "--plot", str(png), "--no-progress"])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["benchmark"] == "trace" and len(report["records"]) == 6
    rec = report["records"][0]
    assert set(rec) == {"trace", "policy", "capacity_frac", "capacity_blocks", "token_hit_rate"}
    assert png.stat().st_size > 1000
    res = CliRunner().invoke(app, ["bench", "trace", "--trace", str(FIXTURE), "--capacity-frac", "-1"])
    assert res.exit_code != 0 and "capacity-frac" in res.output


def test_cli_index(tmp_path: Path) -> None:
    out = tmp_path / "index.json"
    args = ["bench", "index", "--num-blocks", "3000", "--chain-len", "16", "--num-matches", "300"]
    res = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert res.exit_code == 0, res.output
    summary = json.loads(out.read_text())["summary"]
    for key in ("match_blocks_per_s", "insert_blocks_per_s", "bytes_per_block"):
        assert summary[key] > 0
    # lock-held work (issue #37): a quarter of the blocks die with store-0; store-1's tick frees slots
    assert 0 < summary["node_death_blocks"] < 3000 and 0 < summary["watermark_tick_slots"] <= 1024
    for key in ("protected_count_ms", "watermark_tick_ms", "node_death_lock_ms"):
        assert summary[key] >= 0
