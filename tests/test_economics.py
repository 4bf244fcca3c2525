"""Economics formulas with exact numbers, the trace replay on a tiny trace, the counters path."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.economics import (
    GPUS,
    HIT_RATES,
    ModelShape,
    Workload,
    economics_table,
    exact_saved_flop_per_s,
    gpu_prefill_tokens_per_s,
    gpus_saved,
    has_traffic,
    no_traffic,
    saved_flop_per_s,
    verdict,
    workload_from_counters,
    workload_from_trace,
)
from kvpool.errors import InvalidArgument

SHAPE = ModelShape(name="t", params=1e9, num_layers=2, d_attn=10)


def test_saved_tokens_is_lambda_h_sc() -> None:
    w = Workload(
        request_rate_per_s=10, hit_request_share=0.5, mean_reused_tokens=2000, mean_prompt_tokens=4000
    )
    assert w.saved_tokens_per_s == 10_000
    assert w.token_hit_rate == pytest.approx(0.25)
    with pytest.raises(InvalidArgument):
        Workload(request_rate_per_s=1, hit_request_share=1.5, mean_reused_tokens=1, mean_prompt_tokens=1)


def test_prefill_flop_dense_plus_causal_attention() -> None:
    # 2*1e9*3 + 4*2*10 * 3*4/2 = 6e9 + 480
    assert SHAPE.prefill_flop(3) == 6e9 + 480
    w = Workload(request_rate_per_s=2, hit_request_share=0.5, mean_reused_tokens=3, mean_prompt_tokens=3)
    assert saved_flop_per_s(w, SHAPE) == 6e9 + 480
    assert exact_saved_flop_per_s([3, 0, 3], 2.0, SHAPE) == 6e9 + 480


def test_gpus_saved_and_throughput_agree() -> None:
    h100 = GPUS["H100-SXM"]
    assert gpus_saved(989e12 * 0.5, h100, 0.5) == pytest.approx(1.0)
    assert gpus_saved(989e12, h100, 0.5) == pytest.approx(2.0)
    with pytest.raises(InvalidArgument):
        gpus_saved(1.0, h100, 0.0)
    llama = ModelShape(name="l", params=8e9, num_layers=32, d_attn=4096)
    w = Workload(
        request_rate_per_s=3, hit_request_share=0.4, mean_reused_tokens=5000, mean_prompt_tokens=8000
    )
    # saved tokens/s / one GPU's prefill tokens/s at that context == FLOP/s saved / (peak * MFU)
    by_tokens = w.saved_tokens_per_s / gpu_prefill_tokens_per_s(h100, llama, 5000, 0.5)
    assert by_tokens == pytest.approx(gpus_saved(saved_flop_per_s(w, llama), h100, 0.5))
    # 8B dense only: 2*8e9 FLOP/token at 494.5 TFLOP/s -> 30906.25 tokens/s
    assert gpu_prefill_tokens_per_s(h100, llama, 0, 0.5) == pytest.approx(30906.25)


def test_table_and_verdict() -> None:
    w = Workload(request_rate_per_s=1, hit_request_share=0.3, mean_reused_tokens=100, mean_prompt_tokens=200)
    rows = economics_table(w, SHAPE, gpu_names=("A100-SXM",), local_tokens_per_s=50.0)
    assert len(rows) == len(HIT_RATES) + 1 and rows[-1]["measured"] and rows[-1]["h"] == 0.3
    assert rows[0]["saved_tokens_per_s"] == 0.0
    assert rows[-1]["saved_tokens_per_s"] == pytest.approx(30.0)
    assert rows[-1]["local_devices_saved"] == pytest.approx(0.6)
    assert 0.0 < rows[-1]["share_prefill_flop_saved"] < 0.3 / 2 + 1e-9  # attention is convex: < h*s_c/s_p
    assert verdict(0.25, 1.5, "H100-SXM").startswith("pays")
    assert verdict(0.10, 0.5, "H100-SXM").startswith("marginal")
    assert verdict(0.01, 0.0, "H100-SXM").startswith("does not pay")


def test_trace_replay_through_the_index(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 1536, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 512, "output_length": 1, "hash_ids": [3]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    w, info = workload_from_trace(path)
    assert info["reused_tokens"] == [0, 1024, 0]
    assert w.request_rate_per_s == pytest.approx(1.5)
    assert w.hit_request_share == pytest.approx(1 / 3)
    assert w.mean_reused_tokens == 1024 and w.mean_prompt_tokens == 1024
    assert w.saved_tokens_per_s == pytest.approx(512.0)


@dataclass
class _Stats:
    num_match_requests: int
    hit_tokens: int
    requested_tokens: int


def test_counters_give_lambda_times_mean_reused() -> None:
    w = workload_from_counters(_Stats(10, 1000, 5000), _Stats(30, 9000, 25000), 2.0)
    assert w.request_rate_per_s == 10.0
    assert w.saved_tokens_per_s == 4000.0  # = Δhit_tokens / Δt
    assert w.mean_prompt_tokens == 1000.0
    idle = workload_from_counters(_Stats(1, 0, 0), _Stats(1, 0, 0), 1.0)
    assert idle.saved_tokens_per_s == 0.0


def test_a_window_without_traffic_has_no_verdict() -> None:
    """No request (or no prompt token) in the window: no share to judge, not `does not pay ... 0%`."""
    assert not has_traffic(workload_from_counters(_Stats(1, 0, 0), _Stats(1, 0, 0), 1.0))
    assert not has_traffic(workload_from_counters(_Stats(1, 0, 0), _Stats(3, 0, 0), 1.0))  # no tokens
    assert has_traffic(workload_from_counters(_Stats(1, 0, 0), _Stats(3, 0, 128), 1.0))
    assert (
        no_traffic(2.0)
        == "no traffic in the 2 s window: no prefill request reached the master, so no verdict"
    )
