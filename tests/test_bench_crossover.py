"""The crossover benchmark's parts on tiny inputs: scoring, the auto-choice reconstruction, interpolation,
tc arguments, the forced decision in the connector, the plot; namespaces (root only); a live quick run (slow)."""

from __future__ import annotations

import math
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvpool.bench.crossover import (
    breakeven_bits_per_s,
    crossover_prefix,
    measured_breakeven_bits_per_s,
    plot_crossover,
    predict_cell,
    score_cell,
    summarize,
)
from kvpool.bench.netns import MIN_BURST_BYTES, ThrottledPair, netns_unavailable_reason, tbf_args
from kvpool.connector.connector import FORCE_DECISION_ENV, KVConnector, forced_decision
from kvpool.connector.local_tier import LocalTier
from kvpool.cost import LinkEstimate, RecomputeModel, decide_reuse, t_transfer_s
from tests.capabilities import mark


def test_score_cell_right_wrong_and_tolerance() -> None:
    assert score_cell(1.0, 2.0, "pull") == {
        "faster": "pull",
        "within_tolerance": False,
        "right": True,
        "regret": 0.0,
    }
    wrong = score_cell(1.0, 2.0, "recompute")
    assert not wrong["right"] and wrong["regret"] == pytest.approx(1.0)
    close = score_cell(1.05, 1.0, "pull")  # within 10 %: right either way, regret still counted
    assert close["right"] and close["within_tolerance"] and close["regret"] == pytest.approx(0.05)


def test_summarize_accuracy_and_regret() -> None:
    recs = [
        {"ok": True, **score_cell(1.0, 2.0, "pull")},
        {"ok": True, **score_cell(1.0, 2.0, "recompute")},
        {"ok": True, **score_cell(3.0, 1.0, "recompute")},
        {"ok": True, **score_cell(1.0, 1.08, "recompute")},
        {"ok": False},
    ]
    s = summarize(recs)
    assert s["num_cells"] == 4 and s["num_failed_cells"] == 1
    assert s["decision_accuracy"] == pytest.approx(0.75)
    assert s["mean_regret"] == pytest.approx((0 + 1.0 + 0 + 0.08) / 4)
    assert s["share_pull_faster"] == pytest.approx(0.75)
    assert s["target_met"] is False  # 0.75 < 0.95, and a failed cell fails the run


def test_target_met_needs_accuracy_regret_and_no_failed_cell() -> None:
    good = [{"ok": True, **score_cell(1.0, 2.0, "pull")} for _ in range(20)]
    assert summarize(good)["target_met"] is True
    one_wrong = good[:19] + [{"ok": True, **score_cell(1.0, 2.0, "recompute")}]  # 0.95, regret 0.05
    assert summarize(one_wrong)["target_met"] is True
    assert summarize(one_wrong + [{"ok": True, **score_cell(1.0, 2.0, "recompute")}])["target_met"] is False
    failed = summarize([*good, {"ok": False}])  # every scored cell right, one measurement failed
    assert failed["decision_accuracy"] == 1.0 and failed["num_failed_cells"] == 1
    assert failed["target_met"] is False
    nothing = summarize([{"ok": False}])  # no scored cell: no accuracy (not 0.0 regret, "perfect")
    assert nothing["decision_accuracy"] is None and nothing["mean_regret"] is None
    assert nothing["target_met"] is False


def test_auto_choice_reconstruction_matches_decide_reuse() -> None:
    """decide_reuse's optimum is all-or-nothing, and predict_cell reproduces it from load(h) alone."""
    rng = random.Random(7)
    bs, nbytes = 16, 4096
    for _ in range(300):
        model = RecomputeModel(overhead_s=rng.uniform(0, 0.05), per_token_s=rng.uniform(1e-5, 2e-3),
                               per_pair_s=rng.choice([0.0, rng.uniform(0, 1e-6)]))  # fmt: skip
        link = LinkEstimate(alpha_s=rng.uniform(0, 0.01), beta_bytes_per_s=10 ** rng.uniform(5, 10))
        h = rng.randint(1, 40)
        prompt = h * bs + rng.randint(1, 40)
        margin = rng.choice([0.0, 0.1, 0.25])
        d = decide_reuse(h, bs, prompt, nbytes, link, model, margin=margin)
        assert d.num_load_blocks in (0, h)
        cell = predict_cell(model, t_transfer_s(h * nbytes, link), prompt, h * bs, margin)
        assert cell["choice"] == ("pull" if d.num_load_blocks == h else "recompute")
        assert cell["predicted_recompute_ttft_s"] == pytest.approx(d.predicted_recompute_all_s)
        # The node corrected its model online (a uniform scale) since the heartbeat the bench read: its
        # own recompute-all prediction rescales the heartbeat model to the one it decided with.
        scale = rng.uniform(0.3, 3.0)
        now = RecomputeModel(overhead_s=model.overhead_s * scale, per_token_s=model.per_token_s * scale,
                             per_pair_s=model.per_pair_s * scale)  # fmt: skip
        d = decide_reuse(h, bs, prompt, nbytes, link, now, margin=margin)
        cell = predict_cell(
            model, t_transfer_s(h * nbytes, link), prompt, h * bs, margin, d.predicted_recompute_all_s
        )
        assert cell["choice"] == ("pull" if d.num_load_blocks == h else "recompute")
        # with the node's own compute-of-the-rest prediction too, any (refitted) model reconstructs exactly
        other = RecomputeModel(overhead_s=rng.uniform(0, 0.05), per_token_s=rng.uniform(1e-5, 2e-3),
                               per_pair_s=rng.uniform(0, 1e-6))  # fmt: skip
        d = decide_reuse(h, bs, prompt, nbytes, link, other, margin=margin)
        rest = max(1, prompt - h * bs)
        cell = predict_cell(model, t_transfer_s(h * nbytes, link), prompt, h * bs, margin,
                            d.predicted_recompute_all_s, other.t_recompute_s(rest, prompt - rest))  # fmt: skip
        assert cell["choice"] == ("pull" if d.num_load_blocks == h else "recompute")


def test_breakeven_and_interpolation_exact() -> None:
    model = RecomputeModel(overhead_s=0.0, per_token_s=1e-3, per_pair_s=0.0)
    # 100 tokens x 1000 B saved 0.1 s of compute -> 100 kB / 0.1 s = 8 Mb/s
    assert breakeven_bits_per_s(model, 100, 10, 1000) == pytest.approx(8e6)
    assert breakeven_bits_per_s(model, 100, 10, 1000, alpha_s=0.05) == pytest.approx(16e6)
    assert math.isinf(breakeven_bits_per_s(model, 100, 10, 1000, alpha_s=1.0))
    # pull/recompute = 2 at 10 Mb/s, 0.5 at 40 Mb/s: log-log midpoint 20 Mb/s
    assert measured_breakeven_bits_per_s([(10e6, 2.0, 1.0), (40e6, 0.5, 1.0)]) == pytest.approx(20e6)
    assert measured_breakeven_bits_per_s([(10e6, 0.5, 1.0), (40e6, 0.4, 1.0)]) is None
    assert crossover_prefix([(64, 2.0, 1.0), (256, 0.5, 1.0)]) == pytest.approx(128.0)
    assert crossover_prefix([(64, 0.5, 1.0), (256, 0.4, 1.0)]) == 64.0
    assert crossover_prefix([(64, 2.0, 1.0), (256, 3.0, 1.0)]) is None


def test_tbf_args_bucket_and_rate() -> None:
    args = tbf_args(10e6)
    assert args[:3] == ["tbf", "rate", "10000000bit"]
    assert int(args[args.index("burst") + 1]) == MIN_BURST_BYTES  # 10 ms of 10 Mb/s < 64 KiB
    assert int(tbf_args(1e9)[4]) == 1_250_000  # 10 ms of 1 Gb/s
    with pytest.raises(ValueError):
        tbf_args(0)


class _NoPoolMaster:
    def match(self, ns: bytes, hashes: list[bytes], **kwargs: Any) -> Any:
        from kvpool.client import Match

        return Match(num_matched=0, replicas=[], lease_id=None, nodes={})

    def release_lease(self, lease_id: int) -> None:
        pass


def test_forced_decision_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FORCE_DECISION_ENV, raising=False)
    assert forced_decision() == "auto"
    monkeypatch.setenv(FORCE_DECISION_ENV, "bogus")
    assert forced_decision() == "auto"
    conn = KVConnector(master=_NoPoolMaster(), pool=None, transport=None, node_id="n", block_size=4, block_nbytes=64,
                       recompute=RecomputeModel(overhead_s=0.001, per_token_s=1e-4, per_pair_s=0.0),
                       local_tier=LocalTier(640))  # fmt: skip
    ns, hashes = b"n" * 16, [bytes([i]) * 16 for i in range(4)]
    for parent, h in zip([None, *hashes[:2]], hashes[:3], strict=True):
        conn.local_tier.put(ns, h, np.full(64, h[0], dtype=np.uint8), parent=parent)
    auto = conn.load_prefix(ns, list(range(17)), hashes, count_hit=True)
    assert auto.stats.num_reused_tokens == 12 and auto.stats.decision == "local"
    monkeypatch.setenv(FORCE_DECISION_ENV, "recompute")
    forced = conn.load_prefix(ns, list(range(17)), hashes, count_hit=True)
    assert forced.stats.num_reused_tokens == 0 and forced.stats.decision == "recompute"
    assert forced.stats.reason == "forced_recompute (auto: load_all)"


def _synthetic_records() -> list[dict[str, Any]]:
    recs = []
    for link, rate in (("tcp", None), ("tbf-10Mbit", 10.0)):
        for p in (64, 256, 1024):
            pull = p * (1e-4 if rate is None else 1e-3)
            rec = 0.02 + p * 4e-4
            r = {"model": "m", "link": link, "link_kind": "tcp" if rate is None else "tbf",
                 "configured_rate_mbit": rate, "prefix_tokens": p, "ok": True, "pull_ttft_s": pull,
                 "recompute_ttft_s": rec, "predicted_pull_ttft_s": pull * 1.1, "predicted_recompute_ttft_s": rec,
                 "choice": "pull" if pull * 1.1 < rec else "recompute"}  # fmt: skip
            recs.append(r | score_cell(pull, rec, r["choice"]))
    return recs


def test_plot_writes_png(tmp_path: Path) -> None:
    recs = _synthetic_records()
    out = tmp_path / "x.png"
    plot_crossover(recs, summarize(recs) | {"links": {"m/tcp": {"predicted_crossover_prefix": 100.0}}}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@mark("netns", netns_unavailable_reason())
def test_throttled_pair_creates_throttles_and_cleans_up() -> None:
    with ThrottledPair(prefix=f"kvpt{os.getpid() % 10000}", subnet=250) as pair:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert pair.addr.ns_a in names and pair.addr.ns_b in names
        pair.set_rate(50e6)
        q = subprocess.run(["ip", "netns", "exec", pair.addr.ns_b, "tc", "qdisc", "show", "dev", pair.addr.dev_b],
                           capture_output=True, text=True).stdout  # fmt: skip
        assert "tbf" in q and "50Mbit" in q
        pair.set_rate(None)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert pair.addr.ns_a not in names and pair.addr.ns_b not in names


@pytest.mark.slow
def test_quick_crossover_live(tmp_path: Path) -> None:
    """A real cluster, unthrottled links, two prefixes, one repetition (~1-2 min on a busy 2-core VM)."""
    from kvpool.bench.crossover import run_crossover

    report = run_crossover(
        quick=True, reps=1, netns=False, json_out=tmp_path / "x.json", plot_out=tmp_path / "x.png"
    )
    s = report["summary"]
    assert s["num_cells"] == 4 and s["num_failed_cells"] == 0
    cells = report["records"]  # the summary's figures are the records' own (each cell measured and scored)
    assert all(c["ok"] and c["pull_ttft_s"] > 0 and c["recompute_ttft_s"] > 0 for c in cells)
    assert s["decision_accuracy"] == pytest.approx(sum(c["right"] for c in cells) / 4)
    assert s["mean_regret"] == pytest.approx(sum(c["regret"] for c in cells) / 4)
    assert isinstance(s["target_met"], bool)
    assert {r["link"] for r in report["records"]} == {"shm", "tcp"}
    assert (tmp_path / "x.png").is_file()
