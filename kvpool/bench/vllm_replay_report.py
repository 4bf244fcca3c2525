"""`kvpool bench vllm-replay`'s report: per-setup summaries from per-request records, the table, the plot.

A record is one replayed request on one setup: `{"setup", "index", "session", "turn", "engine",
"arrival_s", "start_delay_s", "prompt_tokens", "cached_tokens", "ttft_s", "e2e_s", "decision", "error"}`
(`decision`: the connector's logged pull/recompute decision, None without one; `error`: None when it
served). No vllm here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

SETUPS = ("two_engines_no_pool", "two_engines_pool", "one_engine")
LABELS = {
    "two_engines_no_pool": "2 engines, no pool",
    "two_engines_pool": "2 engines + kvpool",
    "one_engine": "1 engine",
}
TARGET_POOL_OVER_ONE = 0.95  # two engines with kvpool reach this share of the one-engine hit rate


def _pct(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else None


def setup_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One setup's figures: hit rate = sum(cached) / sum(prompt tokens) over the served requests, TTFT
    percentiles (s), the decisions counted (`no line`: the connector logged none for the request)."""
    ok = [r for r in records if r.get("error") is None]
    prompt = sum(int(r["prompt_tokens"]) for r in ok)
    cached = sum(int(r["cached_tokens"]) for r in ok)
    ttft = [float(r["ttft_s"]) for r in ok]
    decisions = Counter(r.get("decision") or "no line" for r in ok)
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
        "start_delay_p90_s": _pct([float(r["start_delay_s"]) for r in ok], 90),
        "decisions": dict(sorted(decisions.items())),
    }


def summarize(records: Sequence[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    """The report's summary: flat `<figure>_<setup>` keys for every setup that ran, the pool's hit rate
    over the one engine's against the target, the no-pool loss as measured, and `settings`.

    A failed request is a failure, never left out: a ratio is None when either of its setups failed a
    request, and `target_met` (a boolean) is False when any setup failed one (`num_failed` counts them
    all); otherwise it is the pool's ratio >= `TARGET_POOL_OVER_ONE`."""
    out: dict[str, Any] = {}
    per: dict[str, dict[str, Any]] = {}
    for setup in SETUPS:
        recs = [r for r in records if r["setup"] == setup]
        if not recs:
            continue
        s = per[setup] = setup_summary(recs)
        for key in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "num_requests", "num_failed", "decisions"):
            out[f"{key}_{setup}"] = s[key]
    out["pool_over_one_engine_hit_rate"] = _hit_ratio(per, "two_engines_pool")
    out["no_pool_over_one_engine_hit_rate"] = _hit_ratio(per, "two_engines_no_pool")
    out["num_failed"] = sum(p["num_failed"] for p in per.values())
    out["target_pool_over_one_engine"] = TARGET_POOL_OVER_ONE
    ratio = out["pool_over_one_engine_hit_rate"]
    out["target_met"] = out["num_failed"] == 0 and ratio is not None and ratio >= TARGET_POOL_OVER_ONE
    out["setups"] = per
    return out | settings


def _hit_ratio(per: dict[str, dict[str, Any]], setup: str) -> float | None:
    """`setup`'s hit rate over the one engine's; None when either did not run, had no prompt tokens, or
    failed a request (a hit rate over the served requests only would hide the failures)."""
    a, b = per.get(setup), per.get("one_engine")
    if a is None or b is None or a["num_failed"] or b["num_failed"]:
        return None
    return a["hit_rate"] / b["hit_rate"] if a["hit_rate"] is not None and b["hit_rate"] else None


def _f(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(console: Any, summary: dict[str, Any]) -> None:
    """The rich table: one row per setup."""
    from rich.table import Table

    table = Table(
        title=f"vLLM trace replay: {summary.get('num_requests', '?')} requests, "
        f"{summary.get('num_sessions', '?')} sessions, speedup {summary.get('speedup', '?')}x"
    )
    for col in ("setup", "requests", "failed", "hit rate", "vs 1 engine", "TTFT p50 s", "TTFT p90 s"):
        table.add_column(col, justify="left" if col == "setup" else "right")
    table.add_column("decisions", justify="left")
    for setup, s in summary["setups"].items():
        ratio = (
            1.0 if setup == "one_engine" and s["num_failed"] == 0 else _hit_ratio(summary["setups"], setup)
        )
        decisions = ", ".join(f"{k} {v}" for k, v in s["decisions"].items())
        table.add_row(
            LABELS[setup],
            str(s["num_requests"]),
            str(s["num_failed"]),
            _f(s["hit_rate"]),
            _f(ratio, ".2f"),
            _f(s["ttft_p50_s"]),
            _f(s["ttft_p90_s"]),
            decisions,
        )
    console.print(table)
    ratio = summary.get("pool_over_one_engine_hit_rate")
    verdict = "[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]"
    failed = summary.get("num_failed", 0)
    reached = "n/a" if ratio is None else f"{ratio:.2f}"
    console.print(
        f"two engines + kvpool reach {reached} of the one-engine hit rate (target >= {TARGET_POOL_OVER_ONE} "
        f"with no failed request; {failed} failed): {verdict}"
    )
    loss = summary.get("no_pool_over_one_engine_hit_rate")
    if loss is not None:
        console.print(f"two engines without the pool reach {loss:.2f} of it")


def plot_report(summary: dict[str, Any], path: Path) -> None:
    """A PNG: hit rate and TTFT p50/p90 per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(summary["setups"])
    labels = [LABELS[s] for s in setups]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(labels, [summary["setups"][s]["hit_rate"] or 0.0 for s in setups], color="tab:blue")
    ax1.set_ylabel("token hit rate")
    ax1.set_ylim(0, 1)
    x = np.arange(len(setups))
    for off, key in ((-0.2, "ttft_p50_s"), (0.2, "ttft_p90_s")):
        ax2.bar(x + off, [summary["setups"][s][key] or 0.0 for s in setups], 0.4, label=key[5:8])
    ax2.set_xticks(x, labels)
    ax2.set_ylabel("TTFT (s)")
    ax2.legend()
    fig.suptitle(f"Mooncake conversation replay on vLLM ({summary.get('num_requests', '?')} requests)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
