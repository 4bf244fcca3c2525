"""Online correction of a node's cost model from the loads and forwards it really runs.

The start-up calibrations drift: a recompute model fitted once at node start is off by the factor the
machine's load has changed since (3× measured on a shared 2-core host), and a link's Hockney
`alpha_s` from a ping probe misses the per-pull software cost (request set-up, per-block headers, thread
hand-offs: tens of ms here, more than the wire latency). Both biases flip pull/recompute decisions near
the break-even. `OnlineCalibration` removes them with two exponentially weighted estimates:

- **recompute model**: the geometric EWMA `s` of `observed / predicted` over real forwards follows the
  machine's level; the model used for decisions is refitted (non-negative least squares, as at start-up)
  to the start-up model's grid scaled by `s` (9 anchor points that keep its shape where nothing was
  observed) plus the last `MAX_OBSERVED` real forwards (which correct its shape where they fall: a
  start-up grid of <= 768 new tokens extrapolates the attention term poorly to 8K-token prompts);
- **pull overhead** `o` (seconds): the EWMA of `observed_pull_s − (alpha_s + bytes / beta)` over completed
  pulls, clamped at >= 0, added to the link's `alpha_s` when a load is predicted.

This is the measure-and-correct approach of Mooncake's TTFT predictor (Qin et al., FAST'25, arXiv
2407.00079, §5: predictions from measured prefill/transfer times) applied per node. Thread-safe.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import replace

from kvpool.cost.link import LinkEstimate, LinkLike
from kvpool.cost.recompute import RecomputeModel, RecomputeSample
from kvpool.errors import InvalidArgument

MIN_PREDICTED_S = 0.005
"""Forwards predicted shorter than this are not folded in: timer and scheduler noise dominates them."""
MAX_OBSERVED = 64
"""Real forwards kept for the refit (the most recent)."""
_ANCHOR_NEW = (64, 256, 768)
_ANCHOR_CTX = (0, 1024, 2048)


class OnlineCalibration:
    """A node's recompute model and pull overhead, corrected by what it observes.

    Args:
        recompute: the start-up calibrated model (its shape is kept).
        weight: EWMA weight of one observation, in (0, 1].
        min_scale, max_scale: bounds of the recompute scale (one wild sample cannot swing decisions).
    Raises:
        InvalidArgument: on a weight outside (0, 1] or bounds not 0 < min <= 1 <= max.
    """

    def __init__(
        self,
        recompute: RecomputeModel,
        *,
        weight: float = 0.25,
        min_scale: float = 0.2,
        max_scale: float = 5.0,
    ) -> None:
        if not 0.0 < weight <= 1.0:
            raise InvalidArgument(f"weight must be in (0, 1], got {weight!r}")
        if not 0.0 < min_scale <= 1.0 <= max_scale:
            raise InvalidArgument("scale bounds must satisfy 0 < min_scale <= 1 <= max_scale")
        self.base = recompute
        self._weight = weight
        self._log_min, self._log_max = math.log(min_scale), math.log(max_scale)
        self._lock = threading.Lock()
        self._log_scale = 0.0
        self._overhead_s = 0.0
        self._observed: deque[RecomputeSample] = deque(maxlen=MAX_OBSERVED)
        self._model = recompute
        self.num_compute_observations = 0
        self.num_pull_observations = 0

    @property
    def recompute_scale(self) -> float:
        """The current factor `s` applied to the calibrated model (1.0 until a forward is observed)."""
        return math.exp(self._log_scale)

    @property
    def pull_overhead_s(self) -> float:
        """The current per-pull software overhead `o` in seconds (0 until a pull is observed)."""
        return self._overhead_s

    @property
    def recompute(self) -> RecomputeModel:
        """The model decisions use now: the start-up one until a forward is observed, then the refit."""
        return self._model

    def _refit(self) -> None:
        """Refit to the scaled start-up anchors + the observed forwards (called under the lock)."""
        s, b = self.recompute_scale, self.base
        anchors = [
            RecomputeSample(n_new=n, n_ctx=c, seconds=b.t_recompute_s(n, c) * s)
            for n in _ANCHOR_NEW
            for c in _ANCHOR_CTX
        ]
        try:
            fitted = RecomputeModel.fit(anchors + list(self._observed))
        except InvalidArgument:  # degenerate start-up model (e.g. all zero): keep the level only
            fitted = replace(
                b, overhead_s=b.overhead_s * s, per_token_s=b.per_token_s * s, per_pair_s=b.per_pair_s * s
            )
        self._model = replace(fitted, source=b.source)

    def link(self, link: LinkLike) -> LinkEstimate:
        """`link` with the observed per-pull overhead added to its `alpha_s`."""
        return LinkEstimate(alpha_s=link.alpha_s + self._overhead_s, beta_bytes_per_s=link.beta_bytes_per_s)

    def observe_compute(self, n_new: int, n_ctx: int, seconds: float) -> None:
        """Fold in one real forward: `n_new` tokens on `n_ctx` cached ones took `seconds`."""
        if n_new <= 0 or not seconds > 0.0 or not math.isfinite(seconds):
            return
        predicted = self.base.t_recompute_s(n_new, n_ctx)
        if predicted < MIN_PREDICTED_S:
            return
        ratio = min(max(math.log(seconds / predicted), self._log_min), self._log_max)
        with self._lock:
            w = self._weight if self.num_compute_observations else 1.0  # the first sample replaces the prior
            self._log_scale = (1.0 - w) * self._log_scale + w * ratio
            self.num_compute_observations += 1
            self._observed.append(RecomputeSample(n_new=n_new, n_ctx=n_ctx, seconds=seconds))
            self._refit()

    def observe_pull(self, nbytes: int, seconds: float, link: LinkLike) -> None:
        """Fold in one completed pull of `nbytes` over `link` (its calibrated figures) that took `seconds`."""
        if nbytes <= 0 or not seconds > 0.0 or not math.isfinite(seconds):
            return
        wire_s = link.alpha_s + nbytes / link.beta_bytes_per_s
        residual = max(0.0, seconds - wire_s)
        with self._lock:
            w = self._weight if self.num_pull_observations else 1.0
            self._overhead_s = (1.0 - w) * self._overhead_s + w * residual
            self.num_pull_observations += 1
