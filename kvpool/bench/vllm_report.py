"""`kvpool bench vllm`'s report: per-prefix records, the summary with its target verdicts, the table, the plot.

No vllm here (nor in `vllm_bench`): the engines run in subprocesses, this only reads their results.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

POOL_OVER_COLD_MAX = 0.10
POOL_OVER_COLD_STRETCH = 0.05
PULL_FACTOR_MAX = 1.5  # (c) - (b) <= this x the measured pull + match time (the worker's, not predicted)
_POOL_KEYS = (
    "decision",
    "reason",
    "num_pool_blocks",
    "num_loaded_tokens",
    "loaded_bytes",
    "predicted_pull_s",
    "predicted_recompute_s",
    "match_s",
)


def prefix_record(
    i: int,
    cold: Sequence[dict[str, Any]],
    local: Sequence[dict[str, Any]],
    pool: dict[str, Any],
    pull: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One prefix's record from the engines' results (`kvpool.vllm.engine_job`): `cold` and `local` are
    [prefix+q1, prefix+q2] on the cold engine (a) and the publishing engine (b), `pool` is prefix+q2 on
    the fresh engine (c); `pull` the pool engine worker's logged pull of that request, if found."""
    rep = pool.get("kvpool") or {}
    rec: dict[str, Any] = {
        "prefix": i,
        "cold_ttft_s": cold[1]["ttft_s"],
        "cold_q1_ttft_s": cold[0]["ttft_s"],
        "local_ttft_s": local[1]["ttft_s"],
        "publish_ttft_s": local[0]["ttft_s"],
        "pool_ttft_s": pool["ttft_s"],
        "pool_over_cold": _ratio(pool["ttft_s"], cold[1]["ttft_s"]),
        "pool_minus_local_s": pool["ttft_s"] - local[1]["ttft_s"],
        "cold_num_cached_tokens": cold[1]["num_cached_tokens"],
        "local_num_cached_tokens": local[1]["num_cached_tokens"],
        "pool_num_cached_tokens": pool["num_cached_tokens"],
    }
    rec |= {k: rep.get(k) for k in _POOL_KEYS}
    rec["decision"] = rep.get("decision", "no report")
    rec["load_failed"] = bool(rep.get("load_failed"))  # the pull failed: vLLM recomputed the rest
    rec["pull_s"] = pull.get("pull_s") if pull else None  # measured by the worker (its log), not predicted
    rec["pull_over_predicted"] = _ratio(rec["pull_s"], rec["predicted_pull_s"])
    rec["pull_plus_match_s"] = (
        None if rec["pull_s"] is None or rec["match_s"] is None else rec["pull_s"] + rec["match_s"]
    )
    rec["local_decision"] = (local[1].get("kvpool") or {}).get("decision", "no report")
    rec["published_blocks"] = (local[0].get("kvpool") or {}).get("num_saved_blocks")
    rec["greedy_equal"] = pool["tokens"] == cold[1]["tokens"]
    rec["local_greedy_equal"] = (
        local[0]["tokens"] == cold[0]["tokens"] and local[1]["tokens"] == cold[1]["tokens"]
    )
    rec |= {"cold_tokens": cold[1]["tokens"], "pool_tokens": pool["tokens"]}
    rec["kvpool"] = {"publish": local[0].get("kvpool"), "local": local[1].get("kvpool"), "pool": rep}
    return rec


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarize(records: Sequence[dict[str, Any]], **settings: Any) -> dict[str, Any]:
    """Medians over the prefixes, the ratios, and the targets with their verdicts. `settings` (prompt
    sizes, engines' timings, ...) are copied in as they are.

    (c) - (b) is bounded by `PULL_FACTOR_MAX` x the median of the MEASURED pull + match time (the pool
    engine's worker log and the connector's match), so the bound holds only when the load really is what
    (c) pays over (b); the cost model's predicted pull is reported beside it (`predicted_pull_s`,
    `pull_over_predicted`), never the bound. A prefix whose pull was not measured (no pull logged: it
    recomputed, or the load failed) leaves the bound unproven: not met; a failed load
    (`num_load_failed`) is a target missed of its own. Every verdict is a boolean
    (`None` values are not met); `target_met` is all non-stretch targets met."""
    cold = _median([r["cold_ttft_s"] for r in records])
    local = _median([r["local_ttft_s"] for r in records])
    pool = _median([r["pool_ttft_s"] for r in records])
    predicted = _median([r["predicted_pull_s"] for r in records])
    measured = _median([r["pull_s"] for r in records])
    over = _ratio(pool, cold)
    minus = None if pool is None or local is None else pool - local
    n = len(records)
    num_measured = sum(1 for r in records if r.get("pull_plus_match_s") is not None)
    pull_plus_match = _median([r.get("pull_plus_match_s") for r in records])
    s: dict[str, Any] = dict(settings)
    s |= {
        "num_prefixes": n,
        "cold_ttft_s": cold,
        "cold_ttft_over": "the cold engine's prefix+q2 requests (the prompts (b) and (c) serve)",
        "cold_all_ttft_s": _median([x for r in records for x in (r["cold_ttft_s"], r["cold_q1_ttft_s"])]),
        "local_ttft_s": local,
        "pool_ttft_s": pool,
        "publish_ttft_s": _median([r["publish_ttft_s"] for r in records]),
        "pool_over_cold": over,
        "local_over_cold": _ratio(local, cold),
        "pool_minus_local_s": minus,
        "predicted_pull_s": predicted,
        "pull_s": measured,
        "pull_over_predicted": _ratio(measured, predicted),
        "pull_plus_match_s": pull_plus_match,
        "num_pulls_measured": num_measured,
        "predicted_recompute_s": _median([r["predicted_recompute_s"] for r in records]),
        "match_s": _median([r["match_s"] for r in records]),
        "loaded_bytes": _median([r["loaded_bytes"] for r in records]),
        "loaded_bytes_total": sum(r["loaded_bytes"] or 0 for r in records),
        "num_loaded_tokens": _median([r["num_loaded_tokens"] for r in records]),
        "pool_num_cached_tokens": _median([r["pool_num_cached_tokens"] for r in records]),
        "local_num_cached_tokens": _median([r["local_num_cached_tokens"] for r in records]),
        "decisions": dict(Counter(r["decision"] for r in records)),
        "num_load_failed": sum(1 for r in records if r.get("load_failed")),
        "greedy_equal": sum(r["greedy_equal"] for r in records) / n if n else None,
        "greedy_equal_local": sum(r["local_greedy_equal"] for r in records) / n if n else None,
    }
    every_pull_measured = n > 0 and num_measured == n
    limit = PULL_FACTOR_MAX * pull_plus_match if pull_plus_match is not None and every_pull_measured else None
    targets = [
        _target(f"(c)/(a) <= {POOL_OVER_COLD_MAX}", over, POOL_OVER_COLD_MAX),
        _target(f"(c)/(a) <= {POOL_OVER_COLD_STRETCH} (stretch)", over, POOL_OVER_COLD_STRETCH, stretch=True),
        _target(f"(c) - (b) <= {PULL_FACTOR_MAX} x measured (pull + match)", minus, limit),
        _target("greedy equality (c) vs (a) = 100%", s["greedy_equal"], 1.0, at_least=True),
        _target("no failed load in (c)", s["num_load_failed"], 0),
    ]
    s["targets"] = targets
    s["pool_over_cold_met"] = targets[0]["met"]
    s["pool_over_cold_stretch_met"] = targets[1]["met"]
    s["pool_minus_local_met"] = targets[2]["met"]
    s["greedy_equal_met"] = targets[3]["met"]
    s["no_load_failed_met"] = targets[4]["met"]
    s["all_targets_met"] = all(t["met"] for t in targets if not t["stretch"])
    s["target_met"] = s["all_targets_met"]
    return s


def _target(
    name: str, value: float | None, limit: float | None, *, stretch: bool = False, at_least: bool = False
) -> dict[str, Any]:
    """A verdict row; `met` is a boolean: a figure or limit that could not be measured is not met."""
    met = value is not None and limit is not None and (value >= limit if at_least else value <= limit)
    return {"target": name, "value": value, "limit": limit, "met": met, "stretch": stretch}


def _f(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def _mib(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**20:.1f}"


def print_report(console: Any, records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.table import Table

    title = (
        f"vLLM TTFT: {summary.get('prefix_tokens', '?')}-token RAG prefix + {summary.get('question_tokens', '?')}"
        "-token question; (a) cold, (b) vLLM's own cache, (c) loaded from kvpool by a fresh engine"
    )
    table = Table(title=title)
    cols = (
        "prefix",
        "(a) cold s",
        "(b) local s",
        "(c) pool s",
        "(c)/(a)",
        "(c)-(b) s",
        "pred. pull s",
        "meas. pull s",
        "pull+match s",
        "decision",
        "loaded MiB",
        "cached (b)/(c)",
        "greedy =",
    )
    for col in cols:
        table.add_column(col, justify="left" if col in ("decision",) else "right")
    for r in records:
        dec = r["decision"] + (f" ({r['reason']})" if r.get("reason") else "")
        table.add_row(
            str(r["prefix"]),
            _f(r["cold_ttft_s"]),
            _f(r["local_ttft_s"]),
            _f(r["pool_ttft_s"]),
            _f(r["pool_over_cold"]),
            _f(r["pool_minus_local_s"]),
            _f(r["predicted_pull_s"]),
            _f(r["pull_s"]),
            _f(r.get("pull_plus_match_s")),
            dec,
            _mib(r["loaded_bytes"]),
            f"{r['local_num_cached_tokens']}/{r['pool_num_cached_tokens']}",
            "yes" if r["greedy_equal"] else "[red]NO[/red]",
        )
    s = summary
    decisions = ", ".join(f"{k} x{v}" for k, v in s["decisions"].items())
    cached = f"{_f(s['local_num_cached_tokens'], '.0f')}/{_f(s['pool_num_cached_tokens'], '.0f')}"
    table.add_row(
        "median",
        _f(s["cold_ttft_s"]),
        _f(s["local_ttft_s"]),
        _f(s["pool_ttft_s"]),
        _f(s["pool_over_cold"]),
        _f(s["pool_minus_local_s"]),
        _f(s["predicted_pull_s"]),
        _f(s["pull_s"]),
        _f(s["pull_plus_match_s"]),
        decisions,
        _mib(s["loaded_bytes"]),
        cached,
        _f(s["greedy_equal"], ".0%"),
        style="bold",
        end_section=True,
    )
    console.print(table)
    console.print(
        f"(a) = median over the cold engine's prefix+q2 requests (all its requests: {_f(s['cold_all_ttft_s'])} s); "
        f"publishing request prefix+q1 on (b)'s engine: {_f(s['publish_ttft_s'])} s; "
        f"greedy equality of (b)'s engine vs (a): {_f(s['greedy_equal_local'], '.0%')}"
    )
    console.print(
        f"pull (measured by the worker) {_f(s['pull_s'])} s vs predicted {_f(s['predicted_pull_s'])} s "
        f"(measured/predicted {_f(s['pull_over_predicted'], '.2f')}); pulls measured: "
        f"{s['num_pulls_measured']} of {s['num_prefixes']}"
    )
    for t in s["targets"]:
        mark = "[green]met[/green]" if t["met"] else "[red]missed[/red]"
        console.print(f"  {t['target']:<46} {_f(t['value'])} (limit {_f(t['limit'])})  {mark}")
    verdict = "[green]target met[/green]" if s["target_met"] else "[red]target NOT met[/red]"
    console.print(f"  {verdict}")


def plot_report(records: Sequence[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    """Per-prefix TTFT bars of (a), (b) and (c), log scale, with the medians."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"prefix {r['prefix']}" for r in records] + ["median"]
    series = [
        ("cold_ttft_s", "(a) cold, fresh engine", "C3"),
        ("local_ttft_s", "(b) vLLM's own prefix cache", "C2"),
        ("pool_ttft_s", "(c) loaded from kvpool, fresh engine", "C0"),
    ]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(labels) + 2), 4.5))
    width = 0.27
    for k, (key, label, color) in enumerate(series):
        ys = [r[key] for r in records] + [summary[key]]
        xs = [i + (k - 1) * width for i in range(len(ys))]
        ax.bar(xs, [y or 0.0 for y in ys], width, label=label, color=color)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (s, log)")
    ax.set_title(
        f"vLLM + kvpool: {summary.get('prefix_tokens', '?')}-token prefix + {summary.get('question_tokens', '?')}"
        f"-token question; (c)/(a) = {_f(summary['pool_over_cold'])}"
    )
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
