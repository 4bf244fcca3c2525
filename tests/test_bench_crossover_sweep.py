"""The TTFT sweep's fit of `TTFT ≈ (s_p − s_hit)·t_prefill_token + t_overhead` on synthetic points."""

from __future__ import annotations

import pytest

from kvpool.bench.ttft_sweep import fit_seed_formula


def _rec(prompt: int, reused: int, ttft: float, pull: float = 0.0) -> dict[str, float]:
    return {"prompt_tokens": prompt, "reused_tokens": reused, "ttft_s": ttft, "pull_s": pull}


def test_exact_linear_points_are_recovered() -> None:
    recs = [
        _rec(p, r, (p - r) * 2e-3 + 0.05)
        for p, r in ((100, 0), (500, 0), (500, 448), (2000, 1984), (2000, 0))
    ]
    fit = fit_seed_formula(recs)
    assert fit["t_prefill_token_s"] == pytest.approx(2e-3)
    assert fit["t_overhead_s"] == pytest.approx(0.05)
    assert fit["rel_rmse"] == pytest.approx(0.0, abs=1e-9)
    assert len(fit["predicted_ttft_s"]) == 5


def test_attention_term_shows_as_fit_error() -> None:
    # quadratic attention cost: the seed formula misfits, the extended fit does not
    def t(n: int, ctx: int) -> float:
        return 0.01 + 1e-4 * n + 1e-7 * (n * ctx + n * (n + 1) / 2)

    pts = [(n + c, c) for n in (16, 256, 2048) for c in (0, 1024, 4096)]
    fit = fit_seed_formula([_rec(p, c, t(p - c, c)) for p, c in pts])
    assert fit["rel_rmse"] > 0.05
    assert fit["extended"]["rel_rmse"] < 1e-6


def test_needs_two_sizes() -> None:
    with pytest.raises(ValueError):
        fit_seed_formula([_rec(10, 0, 0.1)])
