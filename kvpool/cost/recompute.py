"""Recompute (prefill) time: `t(n_new, n_ctx) = overhead_s + per_token_s·n_new + per_pair_s·pairs`.

`pairs = n_new·n_ctx + n_new·(n_new + 1)/2` is the number of (query, key) pairs causal attention touches
when `n_new` tokens are computed on top of `n_ctx` cached ones: the linear term carries the dense layers
(`2Ψ` FLOP per token), the pair term carries attention (`4·n_layers·n_heads·head_dim` FLOP per pair,
Kaplan et al. 2020, arXiv 2001.08361). The coefficients are fitted by least squares (kept >= 0) to a
start-up micro-benchmark of the runner (`kvpool.model.calibrate.calibrate_recompute`), as Mooncake's
scheduler predicts prefill time from the uncached length (Qin et al., FAST'25, arXiv 2407.00079); SGLang
(Zheng et al., arXiv 2312.07104) motivates skipping the cached prefix. `from_flops` is the fallback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvpool.errors import InvalidArgument


def attention_pairs(n_new: int, n_ctx: int) -> int:
    """(query, key) pairs of causal attention for `n_new` tokens after `n_ctx` cached ones."""
    return n_new * n_ctx + n_new * (n_new + 1) // 2


@dataclass(frozen=True, slots=True, kw_only=True)
class RecomputeSample:
    """One timed prefill: `n_new` tokens computed on `n_ctx` cached ones took `seconds`."""

    n_new: int
    n_ctx: int
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RecomputeModel:
    """Predicted prefill time in seconds. All coefficients >= 0.

    - `overhead_s`: fixed cost of one forward (launch, Python, sampling).
    - `per_token_s`: seconds per computed token (dense layers).
    - `per_pair_s`: seconds per attention (query, key) pair.
    - `source`: "calibrated" (fitted to timings), "flops" (fallback) or "given".
    - `fit_rel_rmse`: relative RMS error of the fit over its samples (0 when not fitted).
    """

    overhead_s: float
    per_token_s: float
    per_pair_s: float
    source: str = "given"
    fit_rel_rmse: float = 0.0
    num_samples: int = 0

    def __post_init__(self) -> None:
        for name in ("overhead_s", "per_token_s", "per_pair_s"):
            value = getattr(self, name)
            if not (value >= 0.0 and np.isfinite(value)):
                raise InvalidArgument(f"RecomputeModel.{name} must be finite and >= 0, got {value!r}")

    def t_recompute_s(self, n_new: int, n_ctx: int = 0) -> float:
        """Seconds to compute `n_new` tokens on top of `n_ctx` cached tokens (0 when `n_new == 0`)."""
        if n_new < 0 or n_ctx < 0:
            raise InvalidArgument(f"n_new and n_ctx must be >= 0, got {n_new}, {n_ctx}")
        if n_new == 0:
            return 0.0
        return self.overhead_s + self.per_token_s * n_new + self.per_pair_s * attention_pairs(n_new, n_ctx)

    def tokens_per_s(self, n_tokens: int) -> float:
        """Predicted cold prefill throughput for a prompt of `n_tokens`."""
        return n_tokens / self.t_recompute_s(n_tokens, 0)

    @classmethod
    def fit(cls, samples: Sequence[RecomputeSample]) -> RecomputeModel:
        """Non-negative least squares on `[1, n_new, pairs]`, weighted by 1/seconds (relative error).

        Needs >= 3 samples with >= 2 distinct `n_new` values and >= 2 distinct pair counts; a term whose
        coefficient comes out negative is dropped and the rest refitted. Raises `InvalidArgument`.
        """
        pts = [s for s in samples if s.n_new > 0 and s.seconds > 0]
        if len(pts) < 3 or len({s.n_new for s in pts}) < 2:
            raise InvalidArgument("a recompute fit needs >= 3 timed samples with >= 2 distinct n_new")
        x = np.array([[1.0, s.n_new, attention_pairs(s.n_new, s.n_ctx)] for s in pts])
        y = np.array([s.seconds for s in pts])
        w = 1.0 / y
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:
            sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
            if (sol >= 0).all():
                coef[:] = 0.0
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        if coef[1] <= 0 and coef[2] <= 0:
            raise InvalidArgument("recompute samples do not grow with tokens; cannot fit")
        rel = (x @ coef - y) / y
        return cls(
            overhead_s=float(coef[0]),
            per_token_s=float(coef[1]),
            per_pair_s=float(coef[2]),
            source="calibrated",
            fit_rel_rmse=float(np.sqrt(np.mean(rel**2))),
            num_samples=len(pts),
        )

    @classmethod
    def from_heartbeat(
        cls, overhead_s: float, per_token_s: float, per_pair_s: float
    ) -> RecomputeModel | None:
        """A node's model from the figures its heartbeats carry (`NodeLoad.recompute_overhead_s`,
        `recompute_s_per_token`, `recompute_s_per_token_ctx`; seconds). None when the node reports none yet:
        both growth terms are 0. Either term alone is a valid fit (`fit` drops a term that comes out negative,
        so a calibrated node may report 0 s per token and its whole cost per attention pair).
        """
        if per_token_s <= 0 and per_pair_s <= 0:
            return None
        return cls(
            overhead_s=max(0.0, overhead_s),
            per_token_s=max(0.0, per_token_s),
            per_pair_s=max(0.0, per_pair_s),
            source="given",
        )

    @classmethod
    def from_flops(
        cls,
        *,
        flop_params: int,
        num_layers: int,
        attn_dim: int,
        flops_per_s: float,
        overhead_s: float = 0.0,
    ) -> RecomputeModel:
        """Fallback: `2·flop_params` FLOP per token and `4·num_layers·attn_dim` FLOP per attention pair
        (QKᵀ and AV, multiply-add = 2) at a measured effective `flops_per_s`.

        `flop_params` = parameters used in per-token matmuls (decoder layers), `attn_dim` = heads·head_dim.
        """
        if flops_per_s <= 0 or flop_params <= 0 or num_layers <= 0 or attn_dim <= 0:
            raise InvalidArgument("from_flops needs positive flop_params, num_layers, attn_dim, flops_per_s")
        return cls(
            overhead_s=overhead_s,
            per_token_s=2.0 * flop_params / flops_per_s,
            per_pair_s=4.0 * num_layers * attn_dim / flops_per_s,
            source="flops",
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RecomputeModel:
        """Inverse of `to_dict`; raises `InvalidArgument` on missing/unknown keys or bad values."""
        try:
            return cls(**dict(data))
        except TypeError as exc:
            raise InvalidArgument(f"bad RecomputeModel record: {exc}") from None
