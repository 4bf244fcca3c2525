"""The transfer-vs-recompute cost model (issue 8): link estimates, recompute fit, pull decision."""

from __future__ import annotations

import math

import pytest

from kvpool.cost import (
    LOCAL_LINK,
    LinkEstimate,
    RecomputeModel,
    RecomputeSample,
    attention_pairs,
    decide_reuse,
    load_deadline_s,
    t_transfer_s,
)
from kvpool.errors import InvalidArgument

BS = 64
BLOCK_NBYTES = 4096 * BS  # the embedded model: 4 KiB/token
# About the embedded model on a quiet 2-core CPU: ~10k tok/s short, attention-bound at 8K.
RECOMPUTE = RecomputeModel(overhead_s=0.002, per_token_s=80e-6, per_pair_s=4e-9)
FAST = LinkEstimate(alpha_s=20e-6, beta_bytes_per_s=10e9)  # RDMA-class
SLOW = LinkEstimate(alpha_s=5e-3, beta_bytes_per_s=5e6)  # 5 MB/s


def test_transfer_time() -> None:
    assert t_transfer_s(0, SLOW) == 0.0
    assert t_transfer_s(5_000_000, SLOW) == pytest.approx(5e-3 + 1.0)
    assert t_transfer_s(10**9, LOCAL_LINK) == 0.0
    with pytest.raises(InvalidArgument):
        t_transfer_s(-1, FAST)
    with pytest.raises(InvalidArgument):
        LinkEstimate(alpha_s=-1.0, beta_bytes_per_s=1.0)


def test_link_fit_and_ewma() -> None:
    truth = LinkEstimate(alpha_s=1e-3, beta_bytes_per_s=1e9)
    fitted = LinkEstimate.from_samples([(n, truth.t_transfer_s(n)) for n in (1 << 10, 1 << 20, 1 << 26)])
    assert fitted.alpha_s == pytest.approx(1e-3, rel=1e-6)
    assert fitted.beta_bytes_per_s == pytest.approx(1e9, rel=1e-6)
    est = LinkEstimate(alpha_s=1e-3, beta_bytes_per_s=4e9)
    for _ in range(60):  # large transfers at the true 1 GB/s pull beta down to it
        est = est.observe(1 << 28, truth.t_transfer_s(1 << 28))
    assert est.beta_bytes_per_s == pytest.approx(1e9, rel=0.01)
    for _ in range(60):  # tiny transfers (latency-dominated) move alpha, not beta
        est = est.observe(64, 3e-3)
    assert est.alpha_s == pytest.approx(3e-3, rel=0.01)
    assert est.beta_bytes_per_s == pytest.approx(1e9, rel=0.01)
    assert est.observe(0, 1.0) is est and est.num_observations == 120


def test_fit_recovers_known_coefficients() -> None:
    truth = RecomputeModel(overhead_s=0.003, per_token_s=90e-6, per_pair_s=5e-9)
    samples = [
        RecomputeSample(n_new=n, n_ctx=c, seconds=truth.t_recompute_s(n, c))
        for c in (0, 1024, 4096)
        for n in (32, 256, 1024)
    ]
    fit = RecomputeModel.fit(samples)
    assert fit.source == "calibrated" and fit.num_samples == 9
    assert fit.overhead_s == pytest.approx(0.003, rel=1e-6)
    assert fit.per_token_s == pytest.approx(90e-6, rel=1e-6)
    assert fit.per_pair_s == pytest.approx(5e-9, rel=1e-6)
    assert fit.fit_rel_rmse < 1e-9
    # With 3 % multiplicative noise the fit stays close.
    noisy = [
        RecomputeSample(n_new=s.n_new, n_ctx=s.n_ctx, seconds=s.seconds * (1.03 if i % 2 else 0.97))
        for i, s in enumerate(samples)
    ]
    nfit = RecomputeModel.fit(noisy)
    assert nfit.per_token_s == pytest.approx(90e-6, rel=0.15)
    assert nfit.per_pair_s == pytest.approx(5e-9, rel=0.15)
    assert RecomputeModel.from_dict(nfit.to_dict()) == nfit


def test_fit_keeps_coefficients_non_negative_and_refuses_nonsense() -> None:
    # Pure linear timings: the pair term must come out 0, never negative.
    fit = RecomputeModel.fit(
        [RecomputeSample(n_new=n, n_ctx=c, seconds=1e-4 * n) for c in (0, 512) for n in (16, 64, 256)]
    )
    assert fit.per_token_s == pytest.approx(1e-4)
    assert fit.per_pair_s == pytest.approx(0.0, abs=1e-15) and fit.overhead_s == pytest.approx(0.0, abs=1e-12)
    # Timings that shrink with the context: unconstrained, the pair term would come out negative; it is
    # dropped (exactly 0) and the rest refitted
    shrinking = [
        RecomputeSample(n_new=n, n_ctx=c, seconds=1e-4 * n - 1e-9 * n * c)
        for c in (0, 512)
        for n in (16, 64, 256)
    ]
    fit = RecomputeModel.fit(shrinking)
    assert fit.per_pair_s == 0.0 and fit.per_token_s == pytest.approx(1e-4, rel=0.01)
    assert fit.overhead_s == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(InvalidArgument):
        RecomputeModel.fit([RecomputeSample(n_new=8, n_ctx=0, seconds=1.0)] * 3)


def test_heartbeat_figures_with_one_growth_term_are_a_model() -> None:
    # Timings quadratic in the prompt: the fit drops the per-token term (0 s per token), and a node
    # reporting that model has figures all the same (the crossover bench waited for per-token > 0 forever).
    fit = RecomputeModel.fit(
        [RecomputeSample(n_new=n, n_ctx=0, seconds=1e-7 * attention_pairs(n, 0)) for n in (16, 64, 256, 1024)]
    )
    assert fit.per_token_s == 0.0 and fit.per_pair_s > 0
    model = RecomputeModel.from_heartbeat(fit.overhead_s, fit.per_token_s, fit.per_pair_s)
    assert model is not None and model.per_pair_s == pytest.approx(1e-7)
    assert model.t_recompute_s(100, 0) == pytest.approx(fit.t_recompute_s(100, 0))
    assert RecomputeModel.from_heartbeat(0.01, 0.0, 0.0) is None  # no growth term: no figures yet
    assert RecomputeModel.from_heartbeat(-1.0, 1e-4, -1.0) == RecomputeModel(
        overhead_s=0.0, per_token_s=1e-4, per_pair_s=0.0, source="given"
    )


def test_flops_fallback() -> None:
    m = RecomputeModel.from_flops(flop_params=3_000_000, num_layers=4, attn_dim=256, flops_per_s=1e10)
    assert m.source == "flops"
    assert m.per_token_s == pytest.approx(6e-4)
    assert m.t_recompute_s(10, 100) == pytest.approx(
        10 * 6e-4 + attention_pairs(10, 100) * 4 * 4 * 256 / 1e10
    )
    assert attention_pairs(3, 0) == 6 and attention_pairs(1, 10) == 11


def test_fast_link_loads_slow_link_recomputes() -> None:
    prompt = 8 * BS + 50
    fast = decide_reuse(8, BS, prompt, BLOCK_NBYTES, FAST, RECOMPUTE)
    assert fast.num_load_blocks == 8 and fast.reason == "load_all"
    assert fast.computed_tokens == 50 and fast.reused_tokens == 8 * BS
    assert fast.predicted_total_s < fast.predicted_recompute_all_s
    slow = decide_reuse(8, BS, prompt, BLOCK_NBYTES, SLOW, RECOMPUTE)
    assert slow.num_load_blocks == 0 and slow.reason == "recompute_cheaper"
    assert slow.computed_tokens == prompt and slow.predicted_load_s == 0.0
    record = fast.to_dict()
    assert record["num_load_blocks"] == 8 and isinstance(record["predicted_load_s"], float)


def test_monotonic_in_bandwidth() -> None:
    prompt = 32 * BS + 7
    loads = []
    for beta in [1e5 * 2**i for i in range(22)]:
        d = decide_reuse(
            32, BS, prompt, BLOCK_NBYTES, LinkEstimate(alpha_s=1e-4, beta_bytes_per_s=beta), RECOMPUTE
        )
        loads.append(d.num_load_blocks)
    assert loads == sorted(loads) and loads[0] == 0 and loads[-1] == 32
    assert any(0 < k < 32 for k in loads) or len(set(loads)) >= 2


def test_partial_load_when_attention_dominates_late_blocks() -> None:
    """Later blocks save more compute (longer context), so a medium link may load only some... or all;
    whatever it picks, it is the argmin of the stated objective."""
    prompt = 64 * BS + 1
    link = LinkEstimate(alpha_s=1e-3, beta_bytes_per_s=3e8)
    d = decide_reuse(64, BS, prompt, BLOCK_NBYTES, link, RECOMPUTE)
    best = min(
        range(65),
        key=lambda k: (
            (1 + d.margin) * t_transfer_s(k * BLOCK_NBYTES, link)
            + RECOMPUTE.t_recompute_s(max(1, prompt - k * BS), prompt - max(1, prompt - k * BS)),
            k,
        ),
    )
    assert d.num_load_blocks == best


def test_fully_cached_prompt_still_computes_last_token() -> None:
    d = decide_reuse(4, BS, 4 * BS, BLOCK_NBYTES, FAST, RECOMPUTE)
    assert d.num_load_blocks == 4
    assert d.computed_tokens == 1 and d.reused_tokens == 4 * BS - 1
    assert d.predicted_compute_s > 0


def test_local_blocks_are_free_and_preferred() -> None:
    prompt = 8 * BS + 10
    d = decide_reuse(8, BS, prompt, BLOCK_NBYTES, SLOW, RECOMPUTE, num_local_blocks=5)
    assert d.num_load_blocks == 5 and d.num_local_used == 5 and d.num_remote_used == 0
    assert d.predicted_load_s == 0.0 and d.reason == "load_partial"


def test_margin_makes_loading_more_cautious() -> None:
    prompt = 16 * BS
    betas = [1e6 * 1.5**i for i in range(30)]
    first_load = {}
    for margin in (0.0, 1.0):
        first_load[margin] = next(
            b
            for b in betas
            if decide_reuse(
                16,
                BS,
                prompt,
                BLOCK_NBYTES,
                LinkEstimate(alpha_s=1e-4, beta_bytes_per_s=b),
                RECOMPUTE,
                margin=margin,
            ).num_load_blocks
        )
    assert first_load[1.0] > first_load[0.0]


def test_deadline() -> None:
    d = decide_reuse(8, BS, 8 * BS + 50, BLOCK_NBYTES, FAST, RECOMPUTE)
    assert d.load_deadline_s >= d.predicted_load_s
    assert d.load_deadline_s == pytest.approx(d.predicted_recompute_all_s - d.predicted_compute_s)
    assert load_deadline_s(0.0, 0.0, 0.0) == 0.002
    assert math.isfinite(d.load_deadline_s)


def test_invalid_inputs() -> None:
    with pytest.raises(InvalidArgument):
        decide_reuse(3, BS, 2 * BS, BLOCK_NBYTES, FAST, RECOMPUTE)  # more hits than the prompt holds
    with pytest.raises(InvalidArgument):
        decide_reuse(2, BS, 2 * BS, BLOCK_NBYTES, FAST, RECOMPUTE, num_local_blocks=3)
    with pytest.raises(InvalidArgument):
        decide_reuse(0, BS, 0, BLOCK_NBYTES, FAST, RECOMPUTE)
    with pytest.raises(InvalidArgument):
        decide_reuse(1, BS, BS, BLOCK_NBYTES, FAST, RECOMPUTE, margin=-0.1)
    d = decide_reuse(0, BS, 10, BLOCK_NBYTES, FAST, RECOMPUTE)
    assert d.reason == "no_hit" and d.computed_tokens == 10


def test_accepts_transfer_link_estimates() -> None:
    """Any object with alpha_s / beta_bytes_per_s works (e.g. `transfer.LinkEstimate`)."""

    class Other:
        alpha_s = 20e-6
        beta_bytes_per_s = 10e9

    d = decide_reuse(8, BS, 8 * BS + 1, BLOCK_NBYTES, Other(), RECOMPUTE)
    assert d.num_load_blocks == 8
    assert LinkEstimate.of(Other()).beta_bytes_per_s == 10e9


# ---------------------------------------------------------------- online calibration (kvpool.cost.online)


def _base_model() -> RecomputeModel:
    return RecomputeModel(overhead_s=0.01, per_token_s=2e-4, per_pair_s=1e-8, source="calibrated")


def test_online_recompute_scale_follows_observed_forwards() -> None:
    from kvpool.cost.online import OnlineCalibration

    cal = OnlineCalibration(_base_model(), weight=0.25)
    assert cal.recompute_scale == 1.0 and cal.recompute == _base_model()
    predicted = _base_model().t_recompute_s(512, 1024)
    cal.observe_compute(512, 1024, 3.0 * predicted)  # the machine got 3x slower
    assert cal.recompute_scale == pytest.approx(3.0)
    assert cal.recompute.t_recompute_s(512, 1024) == pytest.approx(3.0 * predicted)
    for _ in range(40):  # it recovers: EWMA back towards 1x
        cal.observe_compute(512, 1024, predicted)
    assert cal.recompute_scale == pytest.approx(1.0, rel=1e-3)


def test_online_refit_learns_the_shape_where_forwards_are_observed() -> None:
    """A start-up fit whose attention term is 6x too steep (fitted on small prompts) is corrected by the
    long prompts the node really runs, while small prompts stay right."""
    from kvpool.cost.online import OnlineCalibration

    true = RecomputeModel(overhead_s=0.005, per_token_s=1e-4, per_pair_s=5e-9)
    startup = RecomputeModel(overhead_s=0.005, per_token_s=1e-4, per_pair_s=3e-8, source="calibrated")
    cal = OnlineCalibration(startup)
    for n_new, n_ctx in [(2048, 0), (8192, 0), (4096, 0), (50, 8192), (512, 0), (128, 1024)] * 4:
        cal.observe_compute(n_new, n_ctx, true.t_recompute_s(n_new, n_ctx))
    for n_new, n_ctx in [(8192, 0), (2048, 0), (50, 8192), (256, 0)]:
        want = true.t_recompute_s(n_new, n_ctx)
        assert cal.recompute.t_recompute_s(n_new, n_ctx) == pytest.approx(want, rel=0.15), (n_new, n_ctx)
    assert startup.t_recompute_s(8192, 0) > 1.5 * true.t_recompute_s(8192, 0)  # the start-up fit was off
    assert cal.recompute.source == "calibrated"


def test_online_recompute_ignores_noise_and_clamps_outliers() -> None:
    from kvpool.cost.online import OnlineCalibration

    cal = OnlineCalibration(RecomputeModel(overhead_s=0.0, per_token_s=1e-6, per_pair_s=0.0), max_scale=5.0)
    cal.observe_compute(10, 0, 1.0)  # predicted 10 us: below MIN_PREDICTED_S, ignored
    cal.observe_compute(0, 5, 1.0)
    cal.observe_compute(10, 0, float("nan"))
    assert cal.num_compute_observations == 0 and cal.recompute_scale == 1.0
    cal.observe_compute(10_000, 0, 1000.0)  # 100000x: clamped
    assert cal.recompute_scale == pytest.approx(5.0)
    with pytest.raises(InvalidArgument):
        OnlineCalibration(_base_model(), weight=0.0)
    with pytest.raises(InvalidArgument):
        OnlineCalibration(_base_model(), min_scale=2.0)


def test_online_pull_overhead_is_learned_and_flips_a_marginal_decision() -> None:
    from kvpool.cost.online import OnlineCalibration

    link = LinkEstimate(alpha_s=1e-4, beta_bytes_per_s=1e9)
    cal = OnlineCalibration(_base_model())
    block_nbytes, bs = 262_144, 64
    # one block of a 96-token prompt: the wire says pull (0.36 ms vs ~13 ms of compute saved)
    before = decide_reuse(1, bs, 96, block_nbytes, cal.link(link), cal.recompute)
    assert before.num_load_blocks == 1
    for nbytes in (1 << 20, 8 << 20, 32 << 20):  # every real pull took 40 ms more than the wire
        cal.observe_pull(nbytes, link.alpha_s + nbytes / link.beta_bytes_per_s + 0.040, link)
    assert cal.pull_overhead_s == pytest.approx(0.040)
    assert cal.link(link).alpha_s == pytest.approx(0.040 + 1e-4)
    after = decide_reuse(1, bs, 96, block_nbytes, cal.link(link), cal.recompute)
    assert after.num_load_blocks == 0 and after.reason == "recompute_cheaper"
    cal.observe_pull(1 << 20, 1e-6, link)  # faster than the wire: residual clamps at 0
    assert cal.pull_overhead_s == pytest.approx(0.75 * 0.040)
