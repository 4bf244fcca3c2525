"""`kvpool bench routing` graded against measurements (issue #45): the simulation's service times come
from the measured table (`kvpool.bench.routing_service`), not from the cost model the `cost` policy scores
with; the live mode's interleaved order; failed live requests fail the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.bench.routing import summarize
from kvpool.bench.routing_live import interleaved_schedule, live_record
from kvpool.bench.routing_service import FORMAT, SHIPPED_TABLE, ServiceTimes, table_profile
from kvpool.bench.routing_sim import SimConfig, simulate
from kvpool.bench.routing_workload import EMBEDDED_CPU, build_workload
from kvpool.cost import decide_reuse
from kvpool.errors import InvalidArgument
from kvpool.router.policy import COST_MARGIN
from kvpool.trace import Trace, TraceRequest

BT = 32  # tokens per block of the hand-made tables


def _cell(kind: str, p: int, r: int, *ts: float) -> dict[str, object]:
    return {"kind": kind, "prompt_tokens": p, "reused_tokens": r, "ttft_s": list(ts)}


def _table(cells: list[dict[str, object]], **meta: object) -> ServiceTimes:
    return ServiceTimes.from_dict({"format": FORMAT, "block_tokens": BT, "cells": cells} | meta)


# A table far from the embedded calibration (cold 256 tokens: ~0.03 s by the model, 2 s "measured").
SLOW = _table(
    [
        _cell("cold", 64, 0, 1.0),
        _cell("cold", 256, 0, 2.0),
        _cell("pulled", 64, 32, 0.6),
        _cell("pulled", 256, 128, 1.5),
        _cell("pulled", 256, 224, 0.4),
        _cell("local", 64, 32, 0.2),
        _cell("local", 256, 128, 0.9),
        _cell("local", 256, 224, 0.1),
    ]
)


def test_interpolation_follows_the_measured_cells() -> None:
    t = SLOW
    assert t.noise_sigma == 0.0  # one repetition per cell: no measured spread
    assert t.service_s(256, 0) == t.cold_s(256) == 2.0
    assert t.service_s(256, 128) == 1.5 and t.service_s(256, 128, 128) == 0.9
    assert t.service_s(256, 64) == pytest.approx(1.75)  # half way from cold (fraction 0) to 0.5
    assert t.service_s(160, 0) == pytest.approx(1.5)  # half way between 64 and 256 tokens
    assert t.service_s(160, 80) == pytest.approx((0.6 + 1.5) / 2)  # fraction 0.5 on both rows
    assert t.service_s(32, 0) == 1.0  # below the shortest length: its value
    assert t.service_s(448, 0) == pytest.approx(3.0)  # above the longest: the last slope, extended
    # part local, part pulled: local + (pulled - local) x the pulled share
    assert t.service_s(256, 128, 32) == pytest.approx(0.9 + (1.5 - 0.9) * 96 / 128)
    for bad in ((256, 256, 0), (256, 128, 129), (256, -1, 0)):
        with pytest.raises(InvalidArgument):
            t.service_s(*bad)


def test_noise_sigma_is_the_repetitions_spread() -> None:
    t = _table([_cell("cold", 64, 0, 1.0, 2.0, 4.0)])
    assert t.medians[("cold", 64, 0)] == 2.0
    import math

    assert t.noise_sigma == pytest.approx(math.sqrt(2 * math.log(2) ** 2 / 3))


def test_bad_tables_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="format"):
        ServiceTimes.from_dict({"format": "x", "block_tokens": BT, "cells": []})
    with pytest.raises(InvalidArgument, match="cold cell"):
        _table([_cell("pulled", 64, 32, 0.5)])
    with pytest.raises(InvalidArgument, match="bad service-time cell"):
        _table([_cell("cold", 64, 0, -1.0)])
    bad = tmp_path / "t.json"
    bad.write_text("{")
    with pytest.raises(InvalidArgument, match="cannot read"):
        ServiceTimes.load(bad)


def test_the_shipped_table_is_a_recorded_measurement() -> None:
    raw = json.loads(SHIPPED_TABLE.read_text())
    t = ServiceTimes.load()
    assert "--routing-table" in raw["command"] and raw["recorded_utc"] and raw["git_commit"]
    assert raw["machine"]["num_cpus"] and "shared" in raw["machine"]["note"]
    assert set(raw["reported_recompute"]) == {"overhead_s", "per_token_s", "per_pair_s"}
    assert {k for k, _, _ in t.medians} == {"cold", "pulled", "local"}
    assert t.prompts["cold"] == t.prompts["pulled"] == t.prompts["local"] and len(t.prompts["cold"]) >= 3
    for c in raw["cells"]:
        assert len(c["ttft_s"]) >= 2 and all(x > 0 for x in c["ttft_s"])
        assert c["decisions"] == ({"cold": ["none"], "pulled": ["pull"], "local": ["local"]}[c["kind"]])
    assert 0 < t.noise_sigma < 2


def test_the_router_scores_with_what_the_tables_node_reported() -> None:
    t = ServiceTimes.load()
    rec = t.meta["reported_recompute"]
    prof = table_profile(EMBEDDED_CPU, t)
    assert prof.recompute.per_token_s == rec["per_token_s"] and prof.recompute.per_pair_s == rec["per_pair_s"]
    assert prof.kv_bytes_per_token == t.meta["kv_bytes_per_token"] and "reported" in prof.source
    assert table_profile(EMBEDDED_CPU, SLOW) == EMBEDDED_CPU  # a table without one: the profile as is


def _two_requests(shared_blocks: int) -> Trace:
    """Two 8-block requests sharing their first `shared_blocks`, 100 s apart (no queueing)."""
    a = tuple(range(8))
    b = a[:shared_blocks] + tuple(100 + j for j in range(8 - shared_blocks))
    return Trace("two", (TraceRequest(0, 8 * 512, a), TraceRequest(100_000, 8 * 512, b)), 16)


@pytest.mark.parametrize(("policy", "local"), [("round-robin", False), ("affinity", True)])
def test_service_time_is_the_tables_not_the_cost_models(policy: str, local: bool) -> None:
    """The second request reuses the first's 6 blocks (pulled on the other node with round-robin, from the
    node's own tier with affinity): its TTFT is the table's interpolated value for that (prompt, reused,
    local) and not what `decide_reuse` predicts (the cost model the `cost` policy scores with)."""
    wl = build_workload(
        _two_requests(6), EMBEDDED_CPU, num_nodes=2, load=0.01, block_tokens=BT, cold_s=SLOW.cold_s
    )
    assert wl.requests[1].arrival_s > 10 * SLOW.cold_s(256)  # the first is long done
    cfg = SimConfig(
        policy=policy,
        num_nodes=2,
        profile=EMBEDDED_CPU,
        service=SLOW,
        pool_capacity_frac=1.0,
        local_capacity_frac=1.0,
    )
    res = simulate(wl, cfg)
    assert res.ttft_s[0] == pytest.approx(SLOW.cold_s(256))  # cold, alone on its node
    assert res.node_of[0] != res.node_of[1] if not local else res.node_of[0] == res.node_of[1]
    assert res.reused_tokens == 6 * BT and res.local_tokens == (6 * BT if local else 0)
    want = SLOW.service_s(256, 6 * BT, res.local_tokens)
    assert res.ttft_s[1] == pytest.approx(want)
    p = EMBEDDED_CPU
    model = decide_reuse(
        6,
        BT,
        256,
        BT * p.kv_bytes_per_token,
        p.link,
        p.recompute,
        num_local_blocks=6 if local else 0,
        margin=COST_MARGIN,
    ).predicted_total_s
    assert abs(model - want) > 0.1  # the two differ: the test tells them apart


def test_the_load_is_scaled_by_the_measured_cold_times() -> None:
    trace = _two_requests(0)
    wl = build_workload(trace, EMBEDDED_CPU, num_nodes=1, load=0.5, block_tokens=BT, cold_s=SLOW.cold_s)
    span_s = 2 * wl.requests[1].arrival_s  # two requests: one mean gap more
    assert 2 * SLOW.cold_s(256) / span_s == pytest.approx(0.5)


def test_the_live_order_interleaves_the_policies_per_batch() -> None:
    order = interleaved_schedule(["a", "b", "c"], 2, 3)
    assert order[:9] == [
        (0, 0, "a"),
        (0, 0, "b"),
        (0, 0, "c"),
        (0, 1, "b"),
        (0, 1, "c"),
        (0, 1, "a"),
        (1, 0, "c"),
        (1, 0, "a"),
        (1, 0, "b"),
    ]
    assert len(order) == 3 * 2 * 3
    slots = [order[i : i + 3] for i in range(0, len(order), 3)]
    assert [(s[0][0], s[0][1]) for s in slots] == [(r, b) for r in range(3) for b in range(2)]
    for s in slots:  # one batch slot: every policy once, on the same (round, batch)
        assert sorted(p for _, _, p in s) == ["a", "b", "c"] and len({(r, b) for r, b, _ in s}) == 1
    firsts = [s[0][2] for s in slots]
    assert sorted(set(firsts)) == ["a", "b", "c"]  # no policy always runs first
    with pytest.raises(InvalidArgument):
        interleaved_schedule(["a"], 1, 0)


def _res(rnd: int, ttft: float | None, error: str | None = None) -> dict[str, object]:
    return {
        "round": rnd,
        "ttft_s": ttft,
        "error": error,
        "node": "p0",
        "prompt_tokens": 100,
        "cached_tokens": 50,
    }


def test_live_record_counts_failures_and_the_spread_over_rounds() -> None:
    rec = live_record("cost", [_res(0, 1.0), _res(0, 3.0), _res(1, 2.0), _res(1, None, "boom")], ["p0", "p1"])
    assert rec["num_requests"] == 4 and rec["num_failed"] == 1 and rec["errors"] == ["boom"]
    assert rec["p90_ttft_s_by_round"] == [pytest.approx(2.8), 2.0]
    assert rec["p90_spread_s"] == pytest.approx(0.8)
    none = live_record("cost", [_res(0, None, "boom")], ["p0", "p1"])
    assert none["p90_ttft_s"] is None and none["num_failed"] == 1 and none["p90_spread_s"] is None


def test_a_failed_live_request_fails_the_target() -> None:
    def sim(policy: str, p90: float, workload: str = "trace") -> dict[str, object]:
        return {"mode": "sim", "policy": policy, "num_nodes": 8, "p90_ttft_s": p90, "workload": workload}

    def real(policy: str, p90: float | None, failed: int) -> dict[str, object]:
        return {
            "mode": "real",
            "policy": policy,
            "num_nodes": 2,
            "p50_ttft_s": p90,
            "p90_ttft_s": p90,
            "num_failed": failed,
        }

    sims = [sim("cost", 8.0), sim("affinity", 10.0), sim("least-load", 9.0)]
    mirror = [sim(p, 1.0, "real-mirror") for p in ("cost", "affinity", "least-load")]
    good = summarize(
        sims + mirror + [real("cost", 1.0, 0), real("affinity", 2.0, 0), real("least-load", 1.5, 0)], [8]
    )
    assert good["target_met"] is True and good["real_failed_requests"] == 0
    assert good["real_cost_p90_gain_vs_least_load"] == pytest.approx(1 / 3, abs=1e-4)
    bad = summarize(
        sims + mirror + [real("cost", 1.0, 0), real("affinity", 2.0, 0), real("least-load", 1.5, 2)], [8]
    )
    assert bad["target_met"] is False and bad["real_failed_requests"] == 2
    assert bad["real_over_sim_p90"]["least-load"] is None and bad["real_over_sim_p90"]["cost"] == 1.0
    assert bad["real_cost_p90_gain_vs_least_load"] is None  # no ratio against an arm with errors
    assert bad["real_ttft_s"]["least-load"]["num_failed"] == 2


def test_a_profile_without_its_own_table_is_refused() -> None:
    from typer.testing import CliRunner

    from kvpool.cli.main import app

    res = CliRunner().invoke(app, ["bench", "routing", "--quick", "--profile", "llama3-8b-h100"])
    assert res.exit_code != 0 and "no measured service times" in res.output


@pytest.mark.slow
def test_recording_a_tiny_table(tmp_path: Path) -> None:
    """`kvpool bench ttft --routing-table` on a 2 x 2 grid, 2 repetitions (about a minute on 2 cores): the
    node loaded exactly the cells' reused tokens, pulled or from its local tier, and the table loads."""
    from typer.testing import CliRunner

    from kvpool.bench.routing_record import record_service_times
    from kvpool.cli.main import app

    out = tmp_path / "table.json"
    t = record_service_times(out, prompts=(128, 256), fractions=(0.5, 1.0), reps=2, log=lambda _: None)
    raw = json.loads(out.read_text())
    assert t == ServiceTimes.load(out) and t.block_tokens == BT
    assert sorted((c["kind"], c["prompt_tokens"], c["reused_tokens"]) for c in raw["cells"]) == [
        ("cold", 128, 0),
        ("cold", 256, 0),
        ("local", 128, 64),
        ("local", 128, 96),
        ("local", 256, 128),
        ("local", 256, 224),
        ("pulled", 128, 64),
        ("pulled", 128, 96),
        ("pulled", 256, 128),
        ("pulled", 256, 224),
    ]
    for c in raw["cells"]:
        assert len(c["ttft_s"]) == 2
        assert c["decisions"] == ({"cold": ["none"], "pulled": ["pull"], "local": ["local"]}[c["kind"]])
    assert raw["reported_recompute"]["per_token_s"] > 0 and raw["machine"]["loadavg_after"]
    bad = CliRunner().invoke(app, ["bench", "ttft", "--routing-table", str(out), "--requests", "0"])
    assert bad.exit_code != 0
