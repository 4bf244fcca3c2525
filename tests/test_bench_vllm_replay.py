"""`kvpool bench vllm-replay` without vLLM: the trace subset, the block tokens, the summary keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.bench.vllm_replay import engine_command, parse_decisions
from kvpool.bench.vllm_replay_client import split_events
from kvpool.bench.vllm_replay_report import SETUPS, summarize
from kvpool.bench.vllm_replay_trace import (
    TRACE_BLOCK_TOKENS,
    BlockTokens,
    default_trace,
    load_trace,
    select_subset,
    sessions,
)
from kvpool.errors import InvalidArgument


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_trace(default_trace())


def test_subset_is_whole_sessions_capped_and_seeded(records: list[dict]) -> None:
    subset = select_subset(records, max_requests=120, max_prompt_tokens=8192, speedup=20.0, seed=7)
    assert 0 < len(subset) <= 120
    assert [r.index for r in subset] == list(range(len(subset)))
    chosen = {r.trace_index for r in subset}
    for group in sessions(records):  # a session is in whole or not at all
        assert len(chosen & set(group)) in (0, len(group))
    keys = {}
    for r in subset:
        rec = records[r.trace_index]
        keys.setdefault(r.session, tuple(rec["hash_ids"][:2]))
        assert keys[r.session] == tuple(rec["hash_ids"][:2])
        assert r.num_prompt_tokens == min(rec["input_length"], 8192) <= 8192
        assert len(r.hash_ids) == -(-r.num_prompt_tokens // TRACE_BLOCK_TOKENS)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(subset, subset[1:], strict=False))
    assert subset[0].arrival_s == 0.0
    for s in keys:  # turns in trace order
        turns = [r for r in subset if r.session == s]
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert [r.trace_index for r in turns] == sorted(r.trace_index for r in turns)
    again = select_subset(records, max_requests=120, max_prompt_tokens=8192, speedup=20.0, seed=7)
    assert again == subset
    other = select_subset(records, max_requests=120, max_prompt_tokens=8192, speedup=20.0, seed=8)
    assert {r.trace_index for r in other} != chosen
    slower = select_subset(records, max_requests=120, max_prompt_tokens=8192, speedup=10.0, seed=7)
    assert slower[-1].arrival_s == pytest.approx(2 * subset[-1].arrival_s)
    with pytest.raises(InvalidArgument):
        select_subset(records, max_requests=0)


def test_block_tokens_shared_exactly_where_hash_ids_are_equal(records: list[dict]) -> None:
    subset = select_subset(records, max_requests=30, seed=3)
    tokens = BlockTokens(seed=3)
    prompts = {r.index: tokens.prompt(r) for r in subset}
    for r in subset:
        assert len(prompts[r.index]) == r.num_prompt_tokens
        assert all(0 <= t < 256 for t in prompts[r.index])
    pairs = [(a, b) for a in subset[:15] for b in subset[:15] if a.index < b.index]
    for a, b in pairs:
        common = 0
        while common < min(len(a.hash_ids), len(b.hash_ids)) and a.hash_ids[common] == b.hash_ids[common]:
            common += 1
        pa, pb = prompts[a.index], prompts[b.index]
        n = min(len(pa), len(pb), common * TRACE_BLOCK_TOKENS)
        assert pa[:n] == pb[:n]
        end = (common + 1) * TRACE_BLOCK_TOKENS  # the first differing block differs in its tokens
        if common < min(len(a.hash_ids), len(b.hash_ids)):
            lo = common * TRACE_BLOCK_TOKENS
            assert pa[lo:end][:32] != pb[lo:end][:32]
    assert BlockTokens(seed=3).block(5) == tokens.block(5) != BlockTokens(seed=4).block(5)
    warm = tokens.warmup()
    assert all(warm[:64] != p[:64] for p in prompts.values())


def _rec(setup: str, i: int, prompt: int, cached: int, ttft: float, decision: str | None = None) -> dict:
    return {"setup": setup, "index": i, "prompt_tokens": prompt, "cached_tokens": cached, "ttft_s": ttft,
            "start_delay_s": 0.0, "decision": decision, "error": None}  # fmt: skip


def test_summary_keys_from_fake_records(tmp_path: Path) -> None:
    recs = [
        _rec("one_engine", 0, 1000, 0, 1.0),
        _rec("one_engine", 1, 1000, 800, 0.2),
        _rec("two_engines_no_pool", 0, 1000, 0, 0.5),
        _rec("two_engines_no_pool", 1, 1000, 200, 0.4),
        _rec("two_engines_pool", 0, 1000, 0, 0.5, "recompute"),
        _rec("two_engines_pool", 1, 1000, 768, 0.1, "pull"),
        _rec("two_engines_pool", 2, 1000, 0, 0.0) | {"error": "boom", "ttft_s": None},
    ]
    s = summarize(recs, date="2026-12-02", machine="test")
    for setup in SETUPS:
        for key in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "num_requests", "decisions"):
            assert f"{key}_{setup}" in s
    assert s["hit_rate_one_engine"] == pytest.approx(0.4)
    assert s["hit_rate_two_engines_no_pool"] == pytest.approx(0.1)
    assert s["hit_rate_two_engines_pool"] == pytest.approx(0.384)
    assert s["ttft_p50_s_one_engine"] == pytest.approx(0.6)
    assert s["num_requests_two_engines_pool"] == 3 and s["num_failed_two_engines_pool"] == 1
    assert s["decisions_two_engines_pool"] == {"pull": 1, "recompute": 1}
    assert s["decisions_one_engine"] == {"no line": 2}
    # the pool setup failed a request: its ratio is not graded over the served ones, the target is missed
    assert s["num_failed"] == 1
    assert s["pool_over_one_engine_hit_rate"] is None and s["target_met"] is False
    assert s["no_pool_over_one_engine_hit_rate"] == pytest.approx(0.25)
    assert s["date"] == "2026-12-02"
    json.dumps(s)  # the report is JSON
    clean = summarize(recs[:-1])
    assert clean["num_failed"] == 0 and clean["pool_over_one_engine_hit_rate"] == pytest.approx(0.96)
    assert clean["target_met"] is True
    # a failed request in the one-engine baseline fails the run too
    failed_base = summarize([*recs[:-1], _rec("one_engine", 2, 1000, 0, 0.0) | {"error": "boom"}])
    assert failed_base["pool_over_one_engine_hit_rate"] is None and failed_base["target_met"] is False
    # a setup that did not run leaves the target not met (a boolean, never None)
    assert summarize(recs[:2])["target_met"] is False


def test_table_shows_failures_and_the_verdict() -> None:
    import io

    from rich.console import Console

    from kvpool.bench.vllm_replay_report import print_report

    recs = [
        _rec("one_engine", 0, 1000, 400, 1.0),
        _rec("two_engines_pool", 0, 1000, 400, 0.5),
        _rec("two_engines_pool", 1, 1000, 0, 0.0) | {"error": "boom", "ttft_s": None},
    ]
    buf = io.StringIO()
    print_report(Console(file=buf, width=200, color_system=None), summarize(recs))
    assert "target NOT met" in buf.getvalue() and "1 failed" in buf.getvalue()


def test_engine_command_and_decision_lines() -> None:
    argv, env = engine_command(python="py", model_dir="m", port=9, core=1, master="h:1", max_model_len=8320,
                               kv_cache_gib=1.0)  # fmt: skip
    assert argv[:4] == ["taskset", "-c", "1", "py"]
    assert (
        json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["master"]
        == "h:1"
    )
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    argv, _ = engine_command(python="py", model_dir="m", port=9, core=0, master="", max_model_len=8320,
                             kv_cache_gib=1.0)  # fmt: skip
    assert "--kv-transfer-config" not in argv
    log = (
        "(EngineCore pid=1) INFO [kvpool.vllm.scheduler] [cmpl-r12-0-ab12cd] pool: 7 of 9 blocks matched, "
        "local 1, decision pull (cheaper (x)): load 7, predicted pull 0.010s, recompute 0.200s, match 0.001s\n"
    )
    assert parse_decisions(log) == {
        12: {"decision": "pull", "reason": "cheaper (x)", "num_pool_blocks": 7, "num_local_blocks": 1,
             "num_load_blocks": 7},
    }  # fmt: skip


def test_split_events_only_on_newlines() -> None:
    text = "a\u2028b\x85c\rd"  # line breaks to str.splitlines, not to the event stream
    a = b'data: {"choices": [{"text": ' + json.dumps(text, ensure_ascii=False).encode() + b"}]}\n\n"
    b = b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n'
    events, rest = split_events(a + b[:20])
    assert events == [{"choices": [{"text": text}]}] and rest == b[:20]
    events, rest = split_events(rest + b[20:])
    assert events == [{"choices": [], "usage": {"prompt_tokens": 3}}] and rest == b""
