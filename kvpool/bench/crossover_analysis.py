"""The crossover benchmark's analysis, pure functions over its records: the cost model's view of a cell (a
node's `RecomputeModel` from its heartbeat, the predicted TTFTs and `auto`'s reconstructed choice, break-even
bandwidths), the scoring of choices against the measured medians (`score_cell`, `summarize`), and the
measured vs predicted crossovers (prefix length per link, bandwidth per prefix) by interpolation.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvpool.cost import RecomputeModel

TOLERANCE = 0.10
"""Cells whose two measured TTFTs are within 10 % count as right either way."""
TARGET_ACCURACY = 0.95
TARGET_MEAN_REGRET = 0.05

# ---------------------------------------------------------------- the cost model's view (pure)


def predict_cell(
    model: RecomputeModel,
    predicted_load_s: float,
    prompt_tokens: int,
    reused_tokens: int,
    margin: float,
    node_recompute_all_s: float | None = None,
    node_compute_rest_s: float | None = None,
) -> dict[str, Any]:
    """Predicted TTFT pulled / recomputed and auto's choice (see `kvpool.bench.crossover`'s docstring).

    The node corrects its model online (kvpool.cost.online), so the heartbeat's model may lag the one it
    decided with. With both of the node's own per-request predictions (`node_recompute_all_s`: the whole
    prompt; `node_compute_rest_s`: the rest once every hit block is loaded) the choice is exactly the
    node's; with only the first, the heartbeat model is rescaled to agree with it.
    """
    n_new = max(1, prompt_tokens - reused_tokens)
    if node_recompute_all_s and node_compute_rest_s:
        pull = (1.0 + margin) * predicted_load_s + node_compute_rest_s < node_recompute_all_s
        return {
            "predicted_pull_ttft_s": predicted_load_s + node_compute_rest_s,
            "predicted_recompute_ttft_s": node_recompute_all_s,
            "choice": "pull" if pull else "recompute",
        }
    recompute_all = model.t_recompute_s(prompt_tokens, 0)
    if node_recompute_all_s and recompute_all > 0:
        scale = node_recompute_all_s / recompute_all
        model = replace(
            model,
            overhead_s=model.overhead_s * scale,
            per_token_s=model.per_token_s * scale,
            per_pair_s=model.per_pair_s * scale,
        )
        recompute_all = model.t_recompute_s(prompt_tokens, 0)
    compute_rest = model.t_recompute_s(n_new, prompt_tokens - n_new)
    pull = (1.0 + margin) * predicted_load_s + compute_rest < recompute_all
    return {
        "predicted_pull_ttft_s": predicted_load_s + compute_rest,
        "predicted_recompute_ttft_s": recompute_all,
        "choice": "pull" if pull else "recompute",
    }


def breakeven_bits_per_s(
    model: RecomputeModel, prefix_tokens: int, question_tokens: int, token_nbytes: int, alpha_s: float = 0.0
) -> float:
    """Bandwidth at which pulling the prefix costs as much as recomputing it (inf if it never does)."""
    saved = model.t_recompute_s(prefix_tokens + question_tokens, 0) - model.t_recompute_s(
        question_tokens, prefix_tokens
    )
    budget = saved - alpha_s
    return 8.0 * prefix_tokens * token_nbytes / budget if budget > 0 else math.inf


def score_cell(
    pull_s: float, recompute_s: float, choice: str, tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Right/wrong and regret of one choice given the two measured medians."""
    best = min(pull_s, recompute_s)
    chosen = pull_s if choice == "pull" else recompute_s
    close = abs(pull_s - recompute_s) <= tolerance * best
    return {
        "faster": "pull" if pull_s < recompute_s else "recompute",
        "within_tolerance": close,
        "right": close or chosen == best,
        "regret": chosen / best - 1.0 if best > 0 else 0.0,
    }


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`decision_accuracy`, `mean_regret` and the side counts over scored cells (None with no scored
    cell), and `target_met` (bool): accuracy >= `TARGET_ACCURACY`, mean regret <= `TARGET_MEAN_REGRET`
    and no failed cell (a cell whose measurement failed is counted in `num_failed_cells`, never passed)."""
    cells = [r for r in records if r.get("ok")]
    n = len(cells)
    accuracy = sum(r["right"] for r in cells) / n if n else None
    regret = sum(r["regret"] for r in cells) / n if n else None
    return {
        "num_cells": n,
        "num_failed_cells": len(records) - n,
        "decision_accuracy": accuracy,
        "mean_regret": regret,
        "max_regret": max((r["regret"] for r in cells), default=None),
        "share_pull_faster": sum(r["faster"] == "pull" for r in cells) / n if n else None,
        "share_within_tolerance": sum(r["within_tolerance"] for r in cells) / n if n else None,
        "target_met": accuracy is not None
        and regret is not None
        and accuracy >= TARGET_ACCURACY
        and regret <= TARGET_MEAN_REGRET
        and n == len(records),
    }


def measured_breakeven_bits_per_s(points: Sequence[tuple[float, float, float]]) -> float | None:
    """From (rate, pull_s, recompute_s) over rates: the rate where pull/recompute crosses 1 (log-log interp)."""
    pts = sorted((r, math.log(p / c)) for r, p, c in points if r > 0 and p > 0 and c > 0)
    for (r0, y0), (r1, y1) in zip(pts, pts[1:], strict=False):
        if y0 >= 0 > y1 or y0 > 0 >= y1:
            t = y0 / (y0 - y1)
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return None


def crossover_prefix(points: Sequence[tuple[int, float, float]]) -> float | None:
    """From (prefix, pull_s, recompute_s): the prefix length where pulling starts to win (log interp)."""
    pts = sorted((float(n), math.log(p / c)) for n, p, c in points if p > 0 and c > 0)
    if pts and pts[0][1] < 0:
        return pts[0][0]  # pull already wins at the shortest prefix
    for (n0, y0), (n1, y1) in zip(pts, pts[1:], strict=False):
        if y0 >= 0 > y1:
            t = y0 / (y0 - y1)
            return math.exp(math.log(n0) + t * (math.log(n1) - math.log(n0)))
    return None


# ---------------------------------------------------------------- crossovers over the grid


def crossovers(records: Sequence[dict[str, Any]], question_tokens: int) -> dict[str, Any]:
    """Crossover prefix per (model, link), break-even bandwidth per (model, prefix): measured vs predicted,
    and each link's bandwidth as the cost model learned it (fit of predicted load vs bytes)."""
    from kvpool.cost import LinkEstimate

    cells = [r for r in records if r.get("ok")]
    by_link: dict[str, dict[str, Any]] = {}
    for model, link in sorted({(r["model"], r["link"]) for r in cells}):
        rs = sorted(
            (r for r in cells if r["model"] == model and r["link"] == link), key=lambda r: r["prefix_tokens"]
        )
        entry: dict[str, Any] = {
            "measured_crossover_prefix": crossover_prefix(
                [(r["prefix_tokens"], r["pull_ttft_s"], r["recompute_ttft_s"]) for r in rs]
            ),
            "predicted_crossover_prefix": crossover_prefix(
                [
                    (r["prefix_tokens"], r["predicted_pull_ttft_s"], r["predicted_recompute_ttft_s"])
                    for r in rs
                ]
            ),
            "configured_rate_mbit": rs[0]["configured_rate_mbit"],
        }
        try:
            est = LinkEstimate.from_samples([(r["kv_bytes"], r["predicted_load_s"]) for r in rs])
            entry |= {
                "learned_beta_mbit": round(est.beta_bytes_per_s * 8 / 1e6, 2),
                "learned_alpha_ms": round(est.alpha_s * 1e3, 3),
            }
        except Exception:  # noqa: BLE001 - fewer than two sizes
            entry |= {
                "learned_beta_mbit": round(8 * rs[-1]["kv_bytes"] / rs[-1]["predicted_load_s"] / 1e6, 2)
                if rs[-1]["predicted_load_s"] > 0
                else None
            }
        by_link[f"{model}/{link}"] = entry
    by_prefix: dict[str, dict[str, Any]] = {}
    for model, prefix in sorted({(r["model"], r["prefix_tokens"]) for r in cells if r["link_kind"] == "tbf"}):
        rs = [
            r
            for r in cells
            if r["model"] == model and r["prefix_tokens"] == prefix and r["link_kind"] == "tbf"
        ]
        meas = measured_breakeven_bits_per_s(
            [(r["configured_rate_mbit"] * 1e6, r["pull_ttft_s"], r["recompute_ttft_s"]) for r in rs]
        )
        alphas = [by_link[f"{model}/{r['link']}"].get("learned_alpha_ms") or 0.0 for r in rs]
        pred = breakeven_bits_per_s(
            RecomputeModel(**rs[0]["recompute_model"]),
            prefix,
            question_tokens,
            rs[0]["token_nbytes"],
            statistics.median(alphas) / 1e3,
        )
        by_prefix[f"{model}/{prefix}"] = {
            "measured_breakeven_mbit": round(meas / 1e6, 2) if meas else None,
            "predicted_breakeven_mbit": round(pred / 1e6, 2) if math.isfinite(pred) else None,
        }
    return {"links": by_link, "breakeven": by_prefix}
