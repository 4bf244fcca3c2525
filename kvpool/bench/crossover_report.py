"""The crossover benchmark's output: the per-model tables of TTFT pulled / recomputed with `auto`'s choice and
the summary line (`print_tables`, to a rich console), and the PNG of TTFT vs prefix length per (model, link)
with the predictions and the predicted crossover (`plot_crossover`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def print_tables(console: Any, records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.table import Table

    for model in sorted({r["model"] for r in records}):
        rs = [r for r in records if r["model"] == model]
        prefixes = sorted({r["prefix_tokens"] for r in rs})
        table = Table(
            title=f"crossover, {model}: TTFT pulled / recomputed (s), auto's choice (P/R), ✗ = wrong"
        )
        table.add_column("link")
        table.add_column("learned β Mb/s", justify="right")
        for p in prefixes:
            table.add_column(f"{p} tok", justify="right")
        links = sorted(
            {r["link"] for r in rs},
            key=lambda n: next(r["configured_rate_mbit"] or 1e9 + ord(n[0]) for r in rs if r["link"] == n),
        )
        for link in links:
            row = [link, str(summary["links"].get(f"{model}/{link}", {}).get("learned_beta_mbit", "-"))]
            for p in prefixes:
                c = next((r for r in rs if r["link"] == link and r["prefix_tokens"] == p), None)
                if c is None:
                    row.append("")
                elif not c["ok"]:
                    row.append("failed")
                else:
                    mark = c["choice"][0].upper() + ("" if c["right"] else " ✗")
                    row.append(f"{c['pull_ttft_s']:.3f}/{c['recompute_ttft_s']:.3f} {mark}")
            table.add_row(*row)
        console.print(table)
    verdict = "[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]"
    console.print(
        f"decision_accuracy {_f(summary['decision_accuracy'])} (target >= 0.95), mean_regret "
        f"{_f(summary['mean_regret'])} (target <= 0.05) over {summary['num_cells']} cells, "
        f"{summary['num_failed_cells']} failed (target 0); pull faster in "
        f"{_f(summary['share_pull_faster'], '.0%')}; wall {summary.get('wall_s', '?')} s: {verdict}"
    )


def _f(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def plot_crossover(records: Sequence[dict[str, Any]], summary: dict[str, Any], out: Path) -> None:
    """One panel per (model, link): measured TTFT pulled (solid) and recomputed (dashed) vs prefix length,
    the predictions (dotted) and the predicted crossover prefix (vertical line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted(
        {(r["model"], r["link"], r["configured_rate_mbit"] or math.inf, r["link_kind"]) for r in records},
        key=lambda k: (k[0], k[3] == "tbf", k[2]),
    )
    ncols = 5
    nrows = max(1, math.ceil(len(keys) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 3.0 * nrows), squeeze=False, sharex=True)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax, (model, link, _, _) in zip(axes.flat, keys, strict=False):
        rs = sorted(
            (r for r in records if r["model"] == model and r["link"] == link and r.get("ok")),
            key=lambda r: r["prefix_tokens"],
        )
        x = [r["prefix_tokens"] for r in rs]
        ax.plot(x, [r["pull_ttft_s"] for r in rs], "o-", color="tab:blue", label="pulled")
        ax.plot(x, [r["recompute_ttft_s"] for r in rs], "s--", color="tab:red", label="recomputed")
        ax.plot(
            x, [r["predicted_pull_ttft_s"] for r in rs], ":", color="tab:blue", alpha=0.7, label="pred. pull"
        )
        ax.plot(
            x,
            [r["predicted_recompute_ttft_s"] for r in rs],
            ":",
            color="tab:red",
            alpha=0.7,
            label="pred. recompute",
        )
        for r in rs:
            if not r["right"]:
                ax.plot([r["prefix_tokens"]], [r[f"{r['choice']}_ttft_s"]], "x", color="black", ms=10)
        cx = summary.get("links", {}).get(f"{model}/{link}", {}).get("predicted_crossover_prefix")
        if cx:
            ax.axvline(cx, color="gray", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model}\n{link}", fontsize=8)
        ax.tick_params(labelsize=7)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(
        f"TTFT pulled vs recomputed (x = wrong auto choice; gray line = predicted crossover); accuracy "
        f"{_f(summary.get('decision_accuracy'), '.2f')}, mean regret {_f(summary.get('mean_regret'))}",
        fontsize=10,
    )
    fig.supxlabel("shared prefix (tokens)")
    fig.supylabel("TTFT (s)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
