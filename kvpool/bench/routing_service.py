"""Measured service times for the routing simulation (`kvpool.bench.routing_sim`).

The simulation must not grade the `cost` policy with the cost model it scores with, so a request's
service time comes from TTFTs measured on a real prefill node (`kvpool.bench.routing_record`, recorded
by `kvpool bench ttft --routing-table OUT`; the shipped table is `kvpool/data/routing_service_times.json`).

Cells: `cold` (prompt `P`, nothing reused), `pulled` and `local` (the first `R` tokens loaded from the
pool, or from the node-local tier). A cell's value is the median of its repetitions. Interpolation:
- along the reused fraction `R / P` within a measured prompt length: piecewise linear through the cold
  cell (fraction 0) and that length's cells (held flat past the largest measured fraction);
- along `P`: linear between the two measured lengths around it at the same fraction; below the shortest
  measured length, that length's value; above the longest, linear extrapolation of the two longest
  (never below the longest's value);
- a load that is partly local, partly pulled: `local + (pulled - local) * pulled_tokens / R`.
`noise_sigma`: the RMS of log(repetition / cell median) over all cells, the measured spread the
simulation draws its lognormal noise from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvpool.bench.routing_workload import SimProfile
from kvpool.cost import RecomputeModel
from kvpool.errors import InvalidArgument
from kvpool.prompt import max_reusable_blocks

FORMAT = "kvpool-routing-service-times/1"
SHIPPED_TABLE = Path(__file__).resolve().parent.parent / "data" / "routing_service_times.json"
KINDS = ("cold", "pulled", "local")


def reuse_tokens(prompt_tokens: int, fraction: float, block_tokens: int) -> int:
    """Whole blocks covering `fraction` of the prompt, at most the reusable ones (one token left to compute)."""
    blocks = min(
        round(fraction * prompt_tokens / block_tokens), max_reusable_blocks(prompt_tokens, block_tokens)
    )
    return max(1, blocks) * block_tokens


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise linear through (xs, ys) (xs ascending), flat outside."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x == xs[i]:
            return ys[i]
        if x < xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


@dataclass(frozen=True, slots=True)
class ServiceTimes:
    """A measured table: `medians[(kind, P, R)]` seconds, the metadata as recorded (`meta`)."""

    medians: dict[tuple[str, int, int], float]
    noise_sigma: float
    block_tokens: int
    meta: dict[str, Any]
    prompts: dict[str, list[int]] = field(default_factory=dict, compare=False)
    """Measured prompt lengths per kind (ascending); derived from `medians`."""
    rows: dict[tuple[str, int], tuple[list[float], list[float]]] = field(default_factory=dict, compare=False)
    """(kind, P) -> (reused fractions, seconds) through the cold cell; derived from `medians`."""

    def __post_init__(self) -> None:
        for kind in KINDS:
            self.prompts[kind] = sorted({p for k, p, _ in self.medians if k == kind})
            for p in self.prompts[kind]:
                cold = self.medians[("cold", p, 0)]
                pts = sorted(
                    (r / p, t) for (k, q, r), t in self.medians.items() if k == kind and q == p and r
                )
                self.rows[(kind, p)] = ([0.0] + [f for f, _ in pts], [cold] + [t for _, t in pts])

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ServiceTimes:
        """Parse a table (see the module docstring); `InvalidArgument` when it is not one or lacks a cold
        cell for a prompt length it measured loads at."""
        if raw.get("format") != FORMAT:
            raise InvalidArgument(
                f"not a routing service-time table (format {raw.get('format')!r}, expected {FORMAT})"
            )
        medians: dict[tuple[str, int, int], float] = {}
        logs: list[float] = []
        for c in raw.get("cells", []):
            kind, p, r, ts = c["kind"], int(c["prompt_tokens"]), int(c["reused_tokens"]), list(c["ttft_s"])
            if kind not in KINDS or not ts or min(ts) <= 0 or p < 1 or not 0 <= r < p:
                raise InvalidArgument(f"bad service-time cell {c!r}")
            med = (
                sorted(ts)[len(ts) // 2]
                if len(ts) % 2
                else sum(sorted(ts)[len(ts) // 2 - 1 : len(ts) // 2 + 1]) / 2
            )
            medians[(kind, p, r)] = med
            logs += [math.log(t / med) for t in ts] if len(ts) > 1 else []
        colds = {p for k, p, _ in medians if k == "cold"}
        if not colds or any(p not in colds for _, p, _ in medians):
            raise InvalidArgument("the table needs a cold cell for every measured prompt length")
        sigma = math.sqrt(sum(x * x for x in logs) / len(logs)) if logs else 0.0
        meta = {k: v for k, v in raw.items() if k != "cells"}
        return cls(medians, sigma, int(raw["block_tokens"]), meta)

    @classmethod
    def load(cls, path: Path | None = None) -> ServiceTimes:
        """Read a table (default: the shipped one)."""
        p = path or SHIPPED_TABLE
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"cannot read the service-time table {p}: {exc}") from None

    def _row(self, kind: str, p: int, frac: float) -> float:
        """Interpolated along the reused fraction at a measured prompt length `p`."""
        fracs, vals = self.rows[(kind, p)]
        return _interp(frac, fracs, vals)

    def _at(self, kind: str, prompt_tokens: int, reused_tokens: int) -> float:
        ps = self.prompts.get(kind, [])
        if not ps:
            raise InvalidArgument(f"the table has no {kind} cells")
        frac = reused_tokens / prompt_tokens
        if prompt_tokens <= ps[0]:
            return self._row(kind, ps[0], frac)
        if prompt_tokens >= ps[-1]:
            last = self._row(kind, ps[-1], frac)
            if len(ps) == 1:
                return last
            prev = self._row(kind, ps[-2], frac)
            slope = (last - prev) / (ps[-1] - ps[-2])
            return max(last, last + slope * (prompt_tokens - ps[-1]))
        hi = next(i for i, p in enumerate(ps) if p >= prompt_tokens)
        lo_p, hi_p = ps[hi - 1], ps[hi]
        w = (prompt_tokens - lo_p) / (hi_p - lo_p)
        return (1 - w) * self._row(kind, lo_p, frac) + w * self._row(kind, hi_p, frac)

    def service_s(self, prompt_tokens: int, reused_tokens: int, local_tokens: int = 0) -> float:
        """Measured TTFT (s) of a prompt of `prompt_tokens` whose first `reused_tokens` were loaded,
        `local_tokens` of them from the node-local tier and the rest pulled from the pool.

        Raises `InvalidArgument` unless 0 <= local_tokens <= reused_tokens < prompt_tokens."""
        if not 0 <= local_tokens <= reused_tokens < prompt_tokens:
            raise InvalidArgument(
                f"need 0 <= local ({local_tokens}) <= reused ({reused_tokens}) < prompt ({prompt_tokens}) tokens"
            )
        if reused_tokens == 0:
            return self._at("cold", prompt_tokens, 0)
        if local_tokens == 0:
            return self._at("pulled", prompt_tokens, reused_tokens)
        local = self._at("local", prompt_tokens, reused_tokens)
        if local_tokens == reused_tokens:
            return local
        pulled = self._at("pulled", prompt_tokens, reused_tokens)
        return local + (pulled - local) * (reused_tokens - local_tokens) / reused_tokens

    def cold_s(self, prompt_tokens: int) -> float:
        """Measured TTFT (s) with nothing reused."""
        return self.service_s(prompt_tokens, 0)


def table_profile(profile: SimProfile, service: ServiceTimes) -> SimProfile:
    """What the simulated nodes report: `profile` with the calibration the table's prefill node reported
    while it was measured (when the table has one) and the table's KV bytes per token."""
    rec = service.meta.get("reported_recompute") or {}
    out = profile
    if rec:
        model = RecomputeModel.from_heartbeat(rec["overhead_s"], rec["per_token_s"], rec["per_pair_s"])
        if model is not None:
            source = (
                f"the calibration the table's prefill node reported: overhead {rec['overhead_s'] * 1e3:.2f} ms, "
                f"{rec['per_token_s'] * 1e6:.1f} us/token, {rec['per_pair_s']:.3g} s/attention pair"
            )
            out = replace(out, recompute=model, source=source)
    kv = service.meta.get("kv_bytes_per_token")
    return replace(out, kv_bytes_per_token=int(kv)) if kv else out
