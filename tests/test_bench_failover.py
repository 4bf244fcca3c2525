"""`kvpool bench failover`: the hits-back and window figures on made-up timelines (fast), and a short real
run (slow: etcd, three `kvpool master --etcd`, a store, the command as a subprocess): kill -9 the leader,
0 failed requests, 0 wrong tokens, one failover, the hits come back, the JSON keys and the PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.bench.failover import Traffic, grade_output, greedy_output, hits_back, summarize
from kvpool.bench.failover_report import target_met
from kvpool.sampling import SamplingParams
from tests.capabilities import require_etcd, require_ucx


def rec(t_s: float, hit: float, *, ttft_s: float = 0.01, right: bool = True) -> dict[str, object]:
    return {"t_s": t_s, "hit": hit, "ttft_s": ttft_s, "right": right, "publish": "committed"}


def test_hits_back_is_the_first_run_of_full_hits_after_the_dip() -> None:
    before = [rec(t / 10, 0.9) for t in range(50)]  # 0.0 .. 4.9 s
    after = [rec(5.0, 0.9), rec(5.1, 0.0), rec(5.5, 0.0), rec(6.0, 0.9), rec(6.1, 0.0)]
    after += [rec(7.0 + k / 10, 0.9) for k in range(5)]
    assert hits_back([*before, *after], 5.0, 0.9) == pytest.approx(2.0)  # 7.0 - 5.0: 6.0 was one hit alone
    assert hits_back([*before, *after[:5]], 5.0, 0.9) is None  # never back
    assert hits_back(before + [rec(5.2, 0.9)] * 4, 5.0, 0.9) == 0.0  # never dipped


def test_summary_windows_failures_and_wrong_tokens() -> None:
    records = [rec(t / 10, 0.9, ttft_s=0.01) for t in range(100)]  # 0.0 .. 9.9 s
    records += [rec(10.0 + k / 10, 0.0, ttft_s=0.05) for k in range(30)]  # misses for 3 s after the kill
    records += [{"t_s": 10.05, "error": "Unavailable: boom"}, rec(10.1, 0.0, right=False)]
    records += [rec(13.0 + k / 10, 0.9, ttft_s=0.01) for k in range(20)]
    s = summarize(sorted(records, key=lambda r: float(r["t_s"])), 10.0, 1.5)  # type: ignore[arg-type]
    assert s["failed_requests"] == 1 and s["wrong_tokens"] == 1
    assert s["hit_rate_before"] == pytest.approx(0.9)
    assert s["hits_back_s"] == pytest.approx(3.0)
    assert s["ttft_p99_before_s"] == pytest.approx(0.01)
    assert s["ttft_p99_during_s"] > 0.04  # the misses' TTFT, not the hits' before
    soak = summarize(records[:100], None, None)
    assert "hits_back_s" not in soak and soak["failed_requests"] == 0


def test_every_generated_token_is_compared() -> None:
    assert grade_output([5, 7, 9], [5, 7, 9]) == {"right": True, "wrong_tokens": 0, "first_wrong": None}
    assert grade_output([5, 8, 9], [5, 7, 9]) == {"right": False, "wrong_tokens": 1, "first_wrong": 1}
    assert grade_output([5, 7, 9, 1], [5, 7, 9])["right"] is False  # an extra token
    assert grade_output([5, 7], [5, 7, 9]) == {"right": False, "wrong_tokens": 1, "first_wrong": 2}


class _Stats:
    num_reused_tokens, num_pool_blocks, decision, reason = 0, 0, "recompute", "test"


class _Loaded:
    stats, forward_id, flush_epoch = _Stats(), None, 0
    blocks: list[bytes] = []


class _Runtime:
    """The part of a `NodeRuntime` a traffic request uses, over a real embedded model runner and no pool
    (a cold load): the fault, a wrong output, is planted in the reference instead."""

    def __init__(self) -> None:
        import threading

        from kvpool.model import ModelRunner

        self.runner = ModelRunner.load(None, device="cpu", block_size=64)
        self.model_lock = threading.Lock()
        self.connector = self

    def namespace(self, salt: str) -> bytes:
        return b"n" * 16

    def load_prefix(self, *args: object, **kwargs: object) -> _Loaded:
        return _Loaded()

    def compute_prompt(self, tokens: list[int], loaded: object) -> object:
        return self.runner.prefill_prompt(tokens)

    def publish(self, *args: object, **kwargs: object) -> None:
        return None


def test_a_request_whose_second_token_differs_is_a_wrong_output() -> None:
    rt = _Runtime()
    prompt = list(range(3, 70))
    logits, full = rt.runner.prefill_prompt(prompt)
    cold = greedy_output(rt.runner, logits, full, 4)
    assert (
        cold == rt.runner.generate(prompt, params=_greedy(4))[: len(cold)]
    )  # the decode path is the model's
    wrong_second = [cold[0], (cold[1] + 1) % 256, *cold[2:]]
    traffic = Traffic.__new__(Traffic)  # no thread: one request through the traffic's own path
    traffic.rt, traffic.prompts, traffic.t0 = rt, [prompt, prompt], 0.0
    traffic.cold = [cold, wrong_second]
    good, bad = traffic._one("r0", 0), traffic._one("r1", 1)
    assert good["right"] is True and good["wrong_tokens"] == 0
    assert bad["right"] is False and bad["first_wrong"] == 1 and bad["wrong_tokens"] == 1
    s = summarize([good | {"t_s": 0.0}, bad | {"t_s": 0.1}], None, None)
    assert s["wrong_outputs"] == 1 and s["wrong_tokens"] == 1
    soak = s | {"spurious_failovers": 0, "max_tokens": 4}
    assert target_met(soak) is False and target_met(soak | {"wrong_outputs": 0}) is True


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n)


def test_target_met_is_every_target_of_a_kill() -> None:
    base = {"failed_requests": 0, "wrong_outputs": 0, "wrong_tokens": 0, "lease_ttl_s": 5}
    assert target_met(base | {"failover_s": 3.8, "hits_back_s": 4.6}) is True
    assert target_met(base | {"failover_s": 6.5, "hits_back_s": 7.0}) is False  # > TTL + 1 s
    assert target_met(base | {"failover_s": 3.8, "hits_back_s": None}) is False  # hits never back
    assert target_met(base | {"failed_requests": 1, "failover_s": 3.8, "hits_back_s": 4.6}) is False


def test_without_etcd_the_command_says_make_etcd_and_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from kvpool.cli.main import app
    from kvpool.cluster import etcd

    monkeypatch.setattr(etcd, "etcd_binary", lambda: None)  # no etcd installed
    got = CliRunner().invoke(app, ["bench", "failover", "--warmup-s", "1", "--after-s", "1"])
    assert got.exit_code == 1
    assert (
        got.output.startswith("kvpool bench failover: no etcd binary found") and "`make etcd`" in got.output
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_killing_the_leader_under_traffic_fails_no_request(tmp_path: Path) -> None:
    require_etcd()
    require_ucx()
    pytest.importorskip("matplotlib")
    out, png, ttl_s = tmp_path / "failover.json", tmp_path / "failover.png", 3
    args = ["bench", "failover", "--lease-ttl-s", str(ttl_s), "--warmup-s", "8", "--after-s", "10"]
    done = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", *args, "--json", str(out), "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=220,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    for key in (
        "failed_requests",
        "wrong_tokens",
        "failover_s",
        "hits_back_s",
        "masters",
        "lease_ttl_s",
        "ttft_p99_before_s",
        "ttft_p99_during_s",
    ):
        assert key in s, key
    assert s["masters"] == 3 and s["lease_ttl_s"] == ttl_s
    assert s["failed_requests"] == 0 and s["wrong_tokens"] == 0
    assert s["failovers"] == 1 and len(s["epochs"]) == 2 and s["epochs"][1] > s["epochs"][0]
    assert s["hit_rate_before"] > 0.9  # 256 of 272 tokens reused
    # a loaded 2-core box gets a margin over the targets (TTL + 1 s; failover + 3 s)
    assert s["failover_s"] is not None and s["failover_s"] <= ttl_s + 2.5
    assert s["hits_back_s"] is not None and s["hits_back_s"] <= s["failover_s"] + 5
    assert png.stat().st_size > 10_000
    assert "failover_s" in done.stdout and "hits_back_s" in done.stdout
