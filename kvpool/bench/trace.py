"""`kvpool bench trace`: replay a Mooncake-format JSONL trace (`kvpool.trace`) through the real `RadixIndex`.

Per request: match its blocks (`count_hit=True`, no lease), count the leading run of resident blocks as hit
tokens (capped at `input_length`), insert the missing blocks, then evict down to the capacity. Capacity is a
fraction of the trace's unique blocks. Token prefix-hit rate = hit tokens / input tokens.

Time: the index clock follows the trace timestamps (ms), moved on by at least 1 ms per request so the
requests of one quantised bucket keep their order. `opt` (Belady) is fed each block's next use
(the index of the next request holding it) before the request touches it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvpool.errors import InvalidArgument
from kvpool.index import POLICY_NAMES, BeladyPolicy, RadixIndex, make_policy
from kvpool.trace import TRACE_BLOCK_TOKENS, TRACE_NS, Trace, block_hash, insert_rest, load_trace
from kvpool.types import FakeClock


def _next_uses(trace: Trace) -> list[list[float]]:
    """`out[i][j]`: index of the next request after i that holds block j of request i (inf: none)."""
    seen: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in trace.requests]
    for i in range(len(trace.requests) - 1, -1, -1):
        ids = trace.requests[i].hash_ids
        out[i] = [seen.get(b, math.inf) for b in ids]
        for b in ids:
            seen[b] = float(i)
    return out


def replay(
    trace: Trace,
    policy_name: str,
    capacity_blocks: int,
    *,
    next_uses: list[list[float]] | None = None,
    on_request: Callable[[], None] | None = None,
) -> float:
    """Replay `trace` through a fresh index with `capacity_blocks`; returns the token prefix-hit rate."""
    if capacity_blocks < 0:
        raise InvalidArgument(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    policy = make_policy(policy_name)
    oracle = policy if isinstance(policy, BeladyPolicy) else None
    if oracle is not None and next_uses is None:
        next_uses = _next_uses(trace)
    clock = FakeClock(0)
    index = RadixIndex(clock=clock, policy=policy)
    index.register_namespace(TRACE_NS)
    hit_tokens = input_tokens = 0
    now_ms = -1
    for i, req in enumerate(trace.requests):
        now_ms = max(req.timestamp_ms, now_ms + 1)
        clock.set(now_ms)
        hashes = [block_hash(b) for b in req.hash_ids]
        if oracle is not None and next_uses is not None:
            for bh, next_use in zip(hashes, next_uses[i], strict=True):
                oracle.set_next_use(bh, next_use)
        matched = index.match_prefix(TRACE_NS, hashes, count_hit=True, lease_ttl_ms=0).num_matched
        hit_tokens += min(matched * TRACE_BLOCK_TOKENS, req.input_length)
        input_tokens += req.input_length
        if matched < len(hashes):
            insert_rest(index, hashes, matched, req.input_length)
        over = index.num_blocks - capacity_blocks
        if over > 0:
            index.evict(over)
        if on_request is not None:
            on_request()
    return hit_tokens / input_tokens if input_tokens else 0.0


LRU_SLACK = 0.002
"""The default policy may fall this far below `lru` (token hit rate) on a trace and capacity."""
GAIN_TARGETS = {("conversation", 0.05): 0.035, ("synthetic", 0.10): 0.05}
"""(trace name prefix, capacity fraction) -> the default's gain over `lru` the docs page targets there."""


def grade(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The verdict from a replay's own records: for every (trace, capacity) with both the default policy
    (given as "default" or by its name) and `lru` replayed, the default's gain over `lru`; `never_below_lru_met`
    when every gain is >= -`LRU_SLACK`; `gain_targets` (those of `GAIN_TARGETS` the replay covers, a trace
    matching by name prefix) each with its `met`; `target_met` (bool) when there was something to compare,
    the default was never below `lru` and every covered gain target is met."""
    default = make_policy("default").name
    rate = {
        (
            r["trace"],
            "default" if r["policy"] in ("default", default) else r["policy"],
            r["capacity_frac"],
        ): r["token_hit_rate"]
        for r in records
    }
    gains = {
        (t, frac): round(rate[(t, "default", frac)] - rate[(t, "lru", frac)], 4)
        for (t, p, frac) in rate
        if p == "default" and (t, "lru", frac) in rate
    }
    targets = [
        {"trace": t, "capacity_frac": frac, "gain": g, "target": want, "met": g >= want}
        for (t, frac), g in sorted(gains.items())
        for (prefix, want_frac), want in GAIN_TARGETS.items()
        if t.startswith(prefix) and math.isclose(frac, want_frac)
    ]
    never_below = bool(gains) and min(gains.values()) >= -LRU_SLACK
    return {
        "default_gain_over_lru": {f"{t}@{frac:g}": g for (t, frac), g in sorted(gains.items())},
        "never_below_lru_met": never_below,
        "gain_targets": targets,
        "target_met": never_below and all(t["met"] for t in targets),
    }


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names (`POLICY_NAMES` or "default"); raises `InvalidArgument`."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    for name in names:
        if name != "default" and name not in POLICY_NAMES:
            raise InvalidArgument(
                f"--policies: unknown policy {name!r}; expected {', '.join(POLICY_NAMES)}, default"
            )
    if not names:
        raise InvalidArgument("--policies: no policy given")
    return names


def parse_fractions(text: str) -> list[float]:
    """Comma-separated capacity fractions, each in (0, 1]; raises `InvalidArgument` naming the bad one."""
    out: list[float] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            frac = float(part)
        except ValueError:
            raise InvalidArgument(f"--capacity-frac: {part!r} is not a number") from None
        if not 0.0 < frac <= 1.0 or not math.isfinite(frac):
            raise InvalidArgument(f"--capacity-frac: {part} must be in (0, 1]")
        out.append(frac)
    if not out:
        raise InvalidArgument("--capacity-frac: no fraction given")
    return out


def run_trace_bench(
    traces: Sequence[Path],
    fractions: Sequence[float],
    policies: Sequence[str],
    json_out: Path | None,
    plot_out: Path | None,
    *,
    progress: bool = True,
) -> dict[str, Any]:
    """Replay every trace x policy x capacity; print a table; write the report (and plot)."""
    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from kvpool.report import write_report

    loaded = [load_trace(p) for p in traces]
    total = sum(len(t.requests) for t in loaded) * len(fractions) * len(policies)
    records: list[dict[str, Any]] = []
    with tqdm(total=total, unit="req", disable=not progress, desc="trace replay") as bar:
        for trace in loaded:
            next_uses = _next_uses(trace) if any(make_policy(p).name == "opt" for p in policies) else None
            for policy in policies:
                for frac in fractions:
                    capacity = max(1, round(frac * trace.num_unique_blocks))
                    rate = replay(trace, policy, capacity, next_uses=next_uses, on_request=bar.update)
                    records.append(
                        {
                            "trace": trace.name,
                            "policy": policy,
                            "capacity_frac": frac,
                            "capacity_blocks": capacity,
                            "token_hit_rate": round(rate, 4),
                        }
                    )
    table = Table(title="kvpool bench trace: token prefix-hit rate")
    table.add_column("trace")
    table.add_column("policy")
    for frac in fractions:
        table.add_column(f"{frac:.0%}", justify="right")
    for trace in loaded:
        for policy in policies:
            rates = [
                r["token_hit_rate"] for r in records if r["trace"] == trace.name and r["policy"] == policy
            ]
            table.add_row(trace.name, policy, *(f"{x:.3f}" for x in rates))
    console = Console()
    console.print(table)
    summary: dict[str, Any] = {
        "traces": [t.name for t in loaded],
        "default_policy": make_policy("default").name,
    }
    summary |= grade(records)
    verdict = "[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]"
    gains = ", ".join(
        f"{t['trace']} {t['capacity_frac']:.0%}: {t['gain']:+.3f} (>= +{t['target']})"
        for t in summary["gain_targets"]
    )
    console.print(
        f"default ({summary['default_policy']}) never below lru - {LRU_SLACK}: "
        f"{'yes' if summary['never_below_lru_met'] else 'NO (or default / lru not replayed)'}"
        + (f"; gains: {gains}" if gains else "")
        + f": {verdict}"
    )
    if plot_out is not None:
        _plot(records, plot_out)
    return write_report(json_out, "trace", records, summary)


def _plot(records: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["trace"] for r in records})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for policy in dict.fromkeys(r["policy"] for r in records):
            pts = [
                (r["capacity_frac"], r["token_hit_rate"])
                for r in records
                if r["trace"] == name and r["policy"] == policy
            ]
            ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("capacity (% of the trace's unique blocks)")
        ax.set_ylabel("token prefix-hit rate")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
