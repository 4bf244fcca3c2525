"""Link estimates: the time to move `n` bytes is `alpha_s + n / beta_bytes_per_s` (Hockney model).

Figures come from the transport's link calibration (`transfer.LinkTracker`: a connect-time probe, then
real transfers) or from `LinkEstimate.observe`; never from a configured throttle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvpool.errors import InvalidArgument


class LinkLike(Protocol):
    """Anything with a latency and a bandwidth (our `LinkEstimate`, `transfer.LinkEstimate`)."""

    @property
    def alpha_s(self) -> float: ...

    @property
    def beta_bytes_per_s(self) -> float: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkEstimate:
    """A link's per-request latency `alpha_s` (seconds) and bandwidth `beta_bytes_per_s` (bytes/s).

    `beta_bytes_per_s` may be `math.inf` (a free link: node-local memory). `ewma_weight` in (0, 1] is the
    weight of a new observation; `num_observations` counts them. Raises `InvalidArgument` on
    negative/NaN figures.
    """

    alpha_s: float
    beta_bytes_per_s: float
    ewma_weight: float = 0.2
    num_observations: int = 0

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0.0 and math.isfinite(self.alpha_s)):
            raise InvalidArgument(f"alpha_s must be finite and >= 0, got {self.alpha_s!r}")
        if not self.beta_bytes_per_s > 0.0:
            raise InvalidArgument(f"beta_bytes_per_s must be > 0, got {self.beta_bytes_per_s!r}")
        if not 0.0 < self.ewma_weight <= 1.0:
            raise InvalidArgument(f"ewma_weight must be in (0, 1], got {self.ewma_weight!r}")

    @classmethod
    def of(cls, link: LinkLike) -> LinkEstimate:
        """Copy the figures of any `LinkLike` (e.g. a `transfer.LinkEstimate`)."""
        if isinstance(link, LinkEstimate):
            return link
        return cls(alpha_s=float(link.alpha_s), beta_bytes_per_s=float(link.beta_bytes_per_s))

    @classmethod
    def from_samples(cls, samples: Sequence[tuple[int, float]], *, ewma_weight: float = 0.2) -> LinkEstimate:
        """Least-squares fit of `seconds = alpha + nbytes / beta` to `(nbytes, seconds)` samples.

        Needs >= 2 distinct sizes; alpha is clamped at 0. Raises `InvalidArgument` otherwise.
        """
        pts = [(float(n), float(t)) for n, t in samples if n >= 0 and t > 0]
        if len({n for n, _ in pts}) < 2:
            raise InvalidArgument("a link fit needs samples of at least two distinct sizes")
        mean_n = sum(n for n, _ in pts) / len(pts)
        mean_t = sum(t for _, t in pts) / len(pts)
        cov = sum((n - mean_n) * (t - mean_t) for n, t in pts)
        var = sum((n - mean_n) ** 2 for n, _ in pts)
        slope = cov / var
        if slope <= 0:
            raise InvalidArgument("link samples do not grow with size; cannot fit a bandwidth")
        alpha = max(0.0, mean_t - slope * mean_n)
        return cls(
            alpha_s=alpha, beta_bytes_per_s=1.0 / slope, ewma_weight=ewma_weight, num_observations=len(pts)
        )

    def t_transfer_s(self, nbytes: int) -> float:
        """Seconds to move `nbytes` in one request (0 for 0 bytes)."""
        return t_transfer_s(nbytes, self)

    def observe(self, nbytes: int, seconds: float) -> LinkEstimate:
        """Fold one observed transfer in by EWMA and return the new estimate (self is unchanged).

        A latency-dominated transfer (`nbytes / beta < alpha`) updates alpha; otherwise the observation's
        implied bandwidth `nbytes / (seconds - alpha)` updates beta (in time-per-byte, so one slow outlier
        cannot send beta to infinity). Non-positive inputs are ignored.
        """
        if nbytes <= 0 or not seconds > 0.0 or not math.isfinite(seconds):
            return self
        w = self.ewma_weight
        wire_s = nbytes / self.beta_bytes_per_s
        if wire_s < self.alpha_s:
            alpha = (1 - w) * self.alpha_s + w * max(0.0, seconds - wire_s)
            return replace(self, alpha_s=alpha, num_observations=self.num_observations + 1)
        implied_s_per_byte = max(seconds - self.alpha_s, 0.1 * seconds) / nbytes
        s_per_byte = (1 - w) / self.beta_bytes_per_s + w * implied_s_per_byte
        return replace(self, beta_bytes_per_s=1.0 / s_per_byte, num_observations=self.num_observations + 1)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "alpha_s": self.alpha_s,
            "beta_bytes_per_s": self.beta_bytes_per_s,
            "num_observations": self.num_observations,
        }


LOCAL_LINK = LinkEstimate(alpha_s=0.0, beta_bytes_per_s=math.inf)
"""Node-local blocks: already in this node's memory, transfer cost ~0."""


def t_transfer_s(nbytes: int, link: LinkLike) -> float:
    """`alpha + nbytes / beta` seconds; 0 when `nbytes == 0` (nothing is requested, no round trip).

    Raises `InvalidArgument` for negative `nbytes`.
    """
    if nbytes < 0:
        raise InvalidArgument(f"nbytes must be >= 0, got {nbytes}")
    if nbytes == 0:
        return 0.0
    return float(link.alpha_s) + nbytes / float(link.beta_bytes_per_s)
