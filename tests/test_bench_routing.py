"""`kvpool bench routing` (issue #11): the routing simulation on tiny workloads, its scaling and summary.

The policy-level properties the issue names (no node above 1.5x its fair share under one hot prefix, a
restarted node losing its old blocks' traffic, seeded ties) are tested on the policy itself in
`tests/test_router_policy.py`; here the hot-prefix case runs again through the whole simulation.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from kvpool.bench.routing import BUNDLED_TRACE, run_sim_grid, summarize
from kvpool.bench.routing_live import interleaved_schedule, run_real
from kvpool.bench.routing_service import FORMAT, ServiceTimes, reuse_tokens
from kvpool.bench.routing_sim import SimConfig, simulate
from kvpool.bench.routing_workload import EMBEDDED_CPU, build_workload, spread_arrivals_s
from kvpool.errors import InvalidArgument
from kvpool.router.policy import POLICIES
from kvpool.trace import Trace, TraceRequest, load_trace

KEYS = {"mode", "policy", "p50_ttft_s", "p90_ttft_s", "token_hit_rate", "imbalance"}
SHIPPED = ServiceTimes.load()  # the shipped, measured table


def _smooth_table() -> ServiceTimes:
    """A fixed table shaped like the embedded calibration (pulled = compute + the link's time, local =
    compute; +-10 % repetitions): the simulation's mechanics tested on service times that do not move
    when the shipped table is re-recorded on a noisy machine."""
    rc, bt, cells = EMBEDDED_CPU.recompute, 32, []
    for p in (128, 512, 2048, 8192, 32768, 131072):
        cells.append(
            {"kind": "cold", "prompt_tokens": p, "reused_tokens": 0, "ttft_s": rc.t_recompute_s(p, 0)}
        )
        for f in (0.25, 0.5, 0.75, 1.0):
            r = reuse_tokens(p, f, bt)
            pull_s = 0.001 + r * EMBEDDED_CPU.kv_bytes_per_token / EMBEDDED_CPU.link.beta_bytes_per_s
            for kind, extra in (("pulled", pull_s), ("local", 0.0)):
                t = rc.t_recompute_s(p - r, r) + extra
                cells.append({"kind": kind, "prompt_tokens": p, "reused_tokens": r, "ttft_s": t})
    for c in cells:
        c["ttft_s"] = [0.9 * c["ttft_s"], c["ttft_s"], 1.1 * c["ttft_s"]]
    return ServiceTimes.from_dict({"format": FORMAT, "block_tokens": bt, "cells": cells})


SERVICE = _smooth_table()


@pytest.fixture(scope="module")
def small() -> Trace:
    full = load_trace(BUNDLED_TRACE)
    return replace(full, requests=full.requests[:150])


def _uniform(n: int, *, shared_blocks: int = 0, gap_ms: int = 1000) -> Trace:
    """`n` requests of 8 blocks (4096 tokens), the first `shared_blocks` common to all, one every `gap_ms`."""
    reqs = []
    for i in range(n):
        ids = list(range(shared_blocks)) + [10_000 + 8 * i + j for j in range(8 - shared_blocks)]
        reqs.append(TraceRequest(i * gap_ms, 8 * 512, tuple(ids)))
    return Trace("uniform", tuple(reqs), len({h for r in reqs for h in r.hash_ids}))


def test_tiny_grid_records_have_the_issue_keys(small: Trace) -> None:
    records = run_sim_grid(small, [4], POLICIES, EMBEDDED_CPU, SHIPPED, load=0.9, seed=0)
    assert [r["policy"] for r in records] == list(POLICIES)
    # the grid's workload: the table's block size, arrivals scaled by its measured cold times
    wl = build_workload(
        small, EMBEDDED_CPU, num_nodes=4, load=0.9, block_tokens=SHIPPED.block_tokens, cold_s=SHIPPED.cold_s
    )
    assert {r["time_scale"] for r in records} == {round(wl.time_scale, 4)}
    for r in records:
        assert set(r) >= KEYS and r["mode"] == "sim" and r["num_requests"] == 150
        assert 0 < r["p50_ttft_s"] <= r["p90_ttft_s"] <= r["p99_ttft_s"]
        assert 0.0 < r["token_hit_rate"] < 1.0  # every request shares the trace's first block
        assert 1.0 <= r["imbalance"] <= 4.0
        assert 0.0 < r["utilization"] < 1.5
    json.dumps(records)  # the report is JSON


def test_round_robin_is_even_on_uniform_load() -> None:
    wl = build_workload(_uniform(64), EMBEDDED_CPU, num_nodes=4, load=0.5)
    rr = simulate(
        wl, SimConfig(policy="round-robin", num_nodes=4, profile=EMBEDDED_CPU, service=SERVICE)
    ).record()
    assert rr["imbalance"] == pytest.approx(1.0, abs=0.02)
    # the same requests on one node out of four: the imbalance metric sees it
    one = simulate(
        wl, SimConfig(policy="round-robin", num_nodes=1, profile=EMBEDDED_CPU, service=SERVICE)
    ).record()
    assert one["imbalance"] == 1.0 and one["p90_ttft_s"] > rr["p90_ttft_s"]


def test_same_seed_same_result_other_seed_other_noise(small: Trace) -> None:
    wl = build_workload(small, EMBEDDED_CPU, num_nodes=4, load=0.9)
    a, b, c = (
        simulate(wl, SimConfig(policy="cost", num_nodes=4, profile=EMBEDDED_CPU, service=SERVICE, seed=s))
        for s in (3, 3, 4)
    )
    assert a == b
    assert a.ttft_s != c.ttft_s


def test_the_policy_drives_placement(small: Trace) -> None:
    """Would fail if the simulation ignored the policy: affinity keeps every prompt on the node that holds
    the shared first block (its local hits beat round-robin's), and pays for it in imbalance and TTFT."""
    wl = build_workload(small, EMBEDDED_CPU, num_nodes=4, load=0.9, cold_s=SERVICE.cold_s)
    res = {
        p: simulate(wl, SimConfig(policy=p, num_nodes=4, profile=EMBEDDED_CPU, service=SERVICE))
        for p in POLICIES
    }
    rec = {p: r.record() for p, r in res.items()}
    assert rec["affinity"]["local_hit_rate"] > rec["round-robin"]["local_hit_rate"]
    assert rec["affinity"]["imbalance"] > 2.0 > rec["round-robin"]["imbalance"]
    assert sorted(Counter(res["round-robin"].node_of).values()) == [37, 37, 38, 38]
    assert rec["cost"]["p90_ttft_s"] < rec["affinity"]["p90_ttft_s"]
    assert rec["cost"]["p90_ttft_s"] < rec["round-robin"]["p90_ttft_s"]


def test_hot_prefix_burst_spreads_in_the_simulation() -> None:
    """One request warms a 7-block prefix on one node; then 80 requests sharing it arrive within a few ms.
    `cost` keeps every node within 1.5x its fair share; `affinity` sends the burst to the warm node."""
    warm = _uniform(81, shared_blocks=7)
    burst = [warm.requests[0]] + [
        replace(r, timestamp_ms=60_000 + i) for i, r in enumerate(warm.requests[1:])
    ]
    wl = build_workload(replace(warm, requests=tuple(burst)), EMBEDDED_CPU, num_nodes=4, load=4.0)
    assert wl.requests[-1].arrival_s - wl.requests[1].arrival_s < 0.05 < wl.requests[1].arrival_s - 1.5

    def big(policy: str) -> SimConfig:  # tiers that hold the whole (tiny) workload
        return SimConfig(
            policy=policy,
            num_nodes=4,
            profile=EMBEDDED_CPU,
            service=SERVICE,
            pool_capacity_frac=1.0,
            local_capacity_frac=1.0,
        )

    res = simulate(wl, big("cost"))
    counts = Counter(res.node_of[1:])
    assert len(counts) == 4 and max(counts.values()) <= 1.5 * 80 / 4, counts
    assert res.record()["token_hit_rate"] > 0.8  # the prefix is still reused (pulled or local)
    aff = Counter(simulate(wl, big("affinity")).node_of[1:])
    assert aff.most_common(1)[0][1] == 80  # the baseline that overloads the warm node


def test_load_scales_the_cold_demand() -> None:
    trace = _uniform(20, gap_ms=500)
    cold_s = 20 * EMBEDDED_CPU.recompute.t_recompute_s(4096, 0)
    for n, load in ((2, 0.5), (8, 0.9)):
        wl = build_workload(trace, EMBEDDED_CPU, num_nodes=n, load=load)
        span_s = wl.requests[-1].arrival_s + (wl.requests[1].arrival_s - wl.requests[0].arrival_s)
        assert cold_s / (n * span_s) == pytest.approx(load, rel=1e-6)
    with pytest.raises(InvalidArgument):
        build_workload(trace, EMBEDDED_CPU, num_nodes=0, load=0.5)


def test_quantised_timestamps_are_spread() -> None:
    assert spread_arrivals_s([0, 0, 0, 3000, 3000, 6000]) == pytest.approx([0, 1, 2, 3, 4.5, 6])


def test_summary_gains_and_target() -> None:
    def rec(policy: str, p90: float, n: int = 8) -> dict[str, object]:
        return {"mode": "sim", "policy": policy, "num_nodes": n, "p90_ttft_s": p90}

    good = summarize(
        [rec("cost", 8.0), rec("affinity", 10.0), rec("least-load", 9.0), rec("cost", 1.0, 4)], [4, 8]
    )
    assert good["cost_p90_gain_vs_affinity"] == pytest.approx(0.2)
    assert good["cost_p90_gain_vs_least_load"] == pytest.approx(1 / 9, abs=1e-4)
    assert good["target_met"] is True and good["p90_ttft_s"]["4"] == {"cost": 1.0}
    bad = summarize([rec("cost", 8.5), rec("affinity", 10.0), rec("least-load", 9.0)], [8])
    assert bad["target_met"] is False
    assert summarize([rec("cost", 1.0, 4)], [4])["target_met"] is False  # no 8-node figures: not met


@pytest.mark.slow
def test_real_run_and_its_mirror(small: Trace) -> None:
    """A live 2-prefill cluster through the real RouterService, two policies interleaved per batch of 4
    over 2 rounds (about a minute on 2 cores)."""
    policies = ["cost", "round-robin"]
    real, mirror, info = run_real(
        small, policies, SHIPPED, num_requests=8, batch_requests=4, rounds=2, load=0.5
    )
    assert [r["policy"] for r in real] == [r["policy"] for r in mirror] == policies
    assert info["order"] == [f"r{r}b{b}:{p}" for r, b, p in interleaved_schedule(policies, 2, 2)]
    for r in real:
        assert set(r) >= KEYS and r["num_requests"] == 16 and r["num_failed"] == 0, r["errors"]
        assert r["p90_ttft_s"] > 0 and len(r["p90_ttft_s_by_round"]) == 2 and r["p90_spread_s"] >= 0
    for r in mirror:
        assert set(r) >= KEYS and r["num_requests"] == 8 and r["p90_ttft_s"] > 0
    assert {r["mode"] for r in real} == {"real"}
    assert all(1.0 <= r["imbalance"] <= 2.0 for r in real)
    assert set(info["reported_recompute"]) == {"overhead_s", "per_token_s", "per_pair_s"}


def test_cli_quick_writes_the_report_and_plot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from kvpool.cli.main import app

    out, png = tmp_path / "routing.json", tmp_path / "routing.png"
    args = ["bench", "routing", "--quick", "--nodes", "2,4", "--max-requests", "60", "--json", str(out)]
    res = CliRunner().invoke(app, [*args, "--plot", str(png)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["benchmark"] == "routing" and set(report) == {"benchmark", "env", "records", "summary"}
    assert len(report["records"]) == 2 * len(POLICIES) and {r["mode"] for r in report["records"]} == {"sim"}
    assert set(report["summary"]["p90_ttft_s"]) == {"2", "4"}
    assert report["summary"]["target_met"] is False  # no 8-node figures: not met
    assert png.stat().st_size > 1000
    bad = CliRunner().invoke(app, ["bench", "routing", "--quick", "--nodes", "x"])
    assert bad.exit_code != 0
