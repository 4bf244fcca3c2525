"""`kvpool bench failover`'s table (figures beside their targets) and its PNG of hit rate and TTFT over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def targets(s: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(figure, value, target, met) rows for a summary (a soak's or a kill's)."""

    def sec(v: float | None) -> str:
        return "never" if v is None else f"{v:.2f} s"

    rows = [
        ("failed requests", str(s["failed_requests"]), "0", s["failed_requests"] == 0),
        ("wrong outputs", _wrong(s), "0", s["wrong_outputs"] == 0),
    ]
    if "spurious_failovers" in s:
        rows.append(("spurious failovers", str(s["spurious_failovers"]), "0", s["spurious_failovers"] == 0))
        return rows
    fo, back, ttl = s["failover_s"], s["hits_back_s"], s["lease_ttl_s"]
    rows += [
        ("failover_s", sec(fo), f"<= {ttl + 1} s (TTL + 1)", fo is not None and fo <= ttl + 1),
        (
            "hits_back_s",
            sec(back),
            "<= failover_s + 3 s",
            back is not None and fo is not None and back <= fo + 3,
        ),
    ]
    return rows


def _wrong(s: dict[str, Any]) -> str:
    return f"{s['wrong_outputs']} ({s['wrong_tokens']} tokens of {s.get('max_tokens', '?')} each)"


def target_met(s: dict[str, Any]) -> bool:
    """Every target row met (a soak's or a kill's): the summary's `target_met`."""
    return all(met for _, _, _, met in targets(s))


def print_summary(s: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    kind = f"soak of {s['soak_s']:.0f} s" if s["soak_s"] > 0 else "kill -9 the leader"
    table = Table(title=f"Master failover: {s['masters']} masters, lease {s['lease_ttl_s']} s, {kind}")
    for col in ("figure", "measured", "target", ""):
        table.add_column(col)
    for name, value, target, met in targets(s):
        table.add_row(name, value, target, "[green]ok[/]" if met else "[red]MISSED[/]")
    table.add_row("requests", str(s["requests"]), "", "")
    table.add_row("publishes failed", str(s["publish_failed"]), "(decode recomputes)", "")
    table.add_row("hit rate", f"{s['hit_rate']:.3f}", "", "")
    if "ttft_p99_before_s" in s:
        table.add_row("hit rate before the kill", f"{s['hit_rate_before']:.3f}", "", "")
        table.add_row("TTFT p99 before", f"{s['ttft_p99_before_s'] * 1e3:.1f} ms", "", "")
        table.add_row(
            "TTFT p99 during",
            f"{s['ttft_p99_during_s'] * 1e3:.1f} ms",
            f"({s['requests_during']} requests)",
            "",
        )
        table.add_row("failovers seen", str(s["failovers"]), "1", "")
    else:
        table.add_row("TTFT p99", f"{s['ttft_p99_s'] * 1e3:.1f} ms", "", "")
    console.print(table)
    console.print("[green]target met[/]" if target_met(s) else "[red]target NOT met[/]")


def plot(records: list[dict[str, Any]], s: dict[str, Any], path: Path) -> None:
    """Hit rate (trailing mean of 5 requests) and TTFT per request against time; the kill, the first OK match
    and the hits' return as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in records if "ttft_s" in r]
    t = np.asarray([r["t_s"] for r in ok])
    hits = np.asarray([r["hit"] for r in ok])
    n = min(5, len(hits)) or 1
    rolling = np.convolve(hits, np.ones(n) / n, mode="valid")  # trailing: each point ends its window
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax.plot(t[n - 1 :], rolling, label=f"hit rate ({n}-request mean)")
    ax.scatter(t, hits, s=6, alpha=0.4, label="per request")
    ax.set_ylabel("reused / prompt tokens")
    ax.set_ylim(-0.05, 1.05)
    bx.scatter(t, [r["ttft_s"] * 1e3 for r in ok], s=6)
    bx.set_ylabel("TTFT (ms)")
    bx.set_xlabel("seconds since the traffic began")
    failed = [r["t_s"] for r in records if "error" in r]
    if failed:
        bx.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed")
    kill = s.get("kill_at_s")
    if kill is not None:
        for axis in (ax, bx):
            axis.axvline(kill, color="red", linestyle="--", label="leader killed")
            if s.get("failover_s") is not None:
                axis.axvline(kill + s["failover_s"], color="orange", linestyle=":", label="first OK match")
            if s.get("hits_back_s") is not None:
                axis.axvline(kill + s["hits_back_s"], color="green", linestyle=":", label="hits back")
    ax.legend(loc="lower left", fontsize=8)
    title = f"{s['masters']} masters, lease {s['lease_ttl_s']} s"
    ax.set_title(f"kvpool bench failover: {title}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
