"""`kvpool bench routing`'s console table, verdict lines and plot (`kvpool.bench.routing`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_routing(
    records: Sequence[dict[str, Any]], summary: dict[str, Any], trace: str, profile: str, load: float
) -> None:
    """The table of every record, the live policies' spread over rounds, and the verdict."""
    from kvpool.bench.routing import TARGET_GAIN, TARGET_NODES
    from kvpool.console import console

    out = console()
    out.print(_table(records, trace, profile, load))
    for r in records:
        if r["mode"] == "real":
            rounds = " / ".join(_fmt(x, ".3g") for x in r["p90_ttft_s_by_round"])
            out.print(
                f"live {r['policy']}: p90 by round {rounds} s (spread {_fmt(r['p90_spread_s'], '.3g')} s), "
                f"failed {r['num_failed']} of {r['num_requests']}"
            )
    g_a, g_l = summary["cost_p90_gain_vs_affinity"], summary["cost_p90_gain_vs_least_load"]
    gains = (
        f"cost p90 {g_a:+.1%} vs affinity, {g_l:+.1%} vs least-load"
        if g_a is not None and g_l is not None
        else "no cost / affinity / least-load figures"
    )
    failed = summary.get("real_failed_requests", 0)
    out.print(
        f"{TARGET_NODES} nodes (simulated, measured service times): {gains} (target >= {TARGET_GAIN:.0%} "
        f"lower{', no failed live request' if 'real_failed_requests' in summary else ''}; "
        f"{failed} failed): {'met' if summary['target_met'] else 'NOT met'}"
    )


def _table(records: Sequence[dict[str, Any]], trace: str, profile: str, load: float) -> Any:
    from rich.table import Table

    table = Table(title=f"routing: {trace}, {profile}, load {load} (mirror = sim of the real run)")
    for col in ("mode", "N", "policy", "p50 s", "p90 s", "p99 s", "hit", "imbal", "util"):
        table.add_column(col, justify="left" if col in ("mode", "policy") else "right")
    for r in records:
        mode = "mirror" if r["mode"] == "sim" and r.get("workload") == "real-mirror" else r["mode"]
        util = f"{r['utilization']:.2f}" if "utilization" in r else "-"
        table.add_row(
            mode,
            str(r["num_nodes"]),
            r["policy"],
            _fmt(r["p50_ttft_s"], ".3g"),
            _fmt(r["p90_ttft_s"], ".3g"),
            _fmt(r["p99_ttft_s"], ".3g"),
            _fmt(r["token_hit_rate"], ".3f"),
            _fmt(r["imbalance"], ".2f"),
            util,
        )
    return table


def plot_routing(records: Sequence[dict[str, Any]], out: Path) -> None:
    """p90 TTFT per policy per node count (log scale: affinity's overload dwarfs the rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = [r for r in records if r["mode"] == "sim" and r.get("workload") != "real-mirror"]
    nodes = sorted({r["num_nodes"] for r in sim})
    policies = list(dict.fromkeys(r["policy"] for r in sim))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / max(1, len(policies))
    for j, policy in enumerate(policies):
        ys = [
            next((r["p90_ttft_s"] for r in sim if r["num_nodes"] == n and r["policy"] == policy), 0.0)
            for n in nodes
        ]
        ax.bar([i + j * width for i in range(len(nodes))], ys, width, label=policy)
    ax.set_xticks(
        [i + width * (len(policies) - 1) / 2 for i in range(len(nodes))], [f"{n} nodes" for n in nodes]
    )
    ax.set_yscale("log")
    ax.set_ylabel("p90 TTFT (s, simulated with measured service times)")
    ax.set_title("kvpool bench routing: p90 TTFT per policy")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
