"""The report of `kvpool bench transfer`: records and targets from the measurements (pool/raw and
pool/memcpy as medians of per-repeat ratios), the printed tables and the plot."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.bench.procs import KIB, MIB

TARGET_RAW_RATIO = 0.85
TARGET_MEMCPY_RATIO = 0.5


def _median(xs: Sequence[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _paired_ratio(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Median over repetitions of x_i / y_i. Each rep measures pool and raw back to back (`_measure_size`),
    so the ratio of a pair cancels the machine's drift between reps, which the ratio of medians does not."""
    ratios = [x / y for x, y in zip(xs, ys, strict=False) if y]
    return _median(ratios)


def build_report(
    measured: dict[str, Any], perftest: dict[str, dict[int, list[float]]], mooncake: dict[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records (one per transport, size, op) and the summary with the target ratios. `target_met` (bool):
    every graded target met (the Mooncake comparison is graded only where Mooncake was measured; a ratio
    that could not be computed for a pool/raw or pool/memcpy target is not met) and at least one graded."""
    records: list[dict[str, Any]] = []
    targets: list[dict[str, Any]] = []
    mc = mooncake.get("samples") or {}
    for transport, res in measured.items():
        for size_key, s in res["sizes"].items():
            size = int(size_key)
            memcpy = _median(s["memcpy"])
            pt = _median(perftest.get(transport, {}).get(size, []))
            for op in ("get", "put"):
                pool, raw = _median(s[op]), _median(s[f"raw_{op}"])
                mcv = _median(mc.get(size_key, {}).get(op, [])) if transport == "tcp" else None
                records.append(
                    {
                        "transport": transport,
                        "block_bytes": size,
                        "op": op,
                        "gb_per_s": pool,
                        "raw_ucx_gb_per_s": raw,
                        "perftest_gb_per_s": pt,
                        "memcpy_gb_per_s": memcpy,
                        "mooncake_gb_per_s": mcv,
                        "samples_gb_per_s": s[op],
                        "raw_ucx_samples_gb_per_s": s[f"raw_{op}"],
                        "pool_over_raw": _paired_ratio(s[op], s[f"raw_{op}"]),
                        "raw_ucx_xxh3_gb_per_s": _median(s.get(f"raw_{op}_xxh3", [])),
                        "pool_over_raw_xxh3": _paired_ratio(s[op], s.get(f"raw_{op}_xxh3", [])),
                        "path": "mapped" if op == "get" and "get_ucx" in s else "ucx",
                        "ucx_path_gb_per_s": _median(s["get_ucx"])
                        if op == "get" and "get_ucx" in s
                        else None,
                    }
                )
                r = records[-1]["pool_over_raw"]
                targets.append(
                    {
                        "target": f"{transport} {op} >= 85% raw UCX",
                        "block_bytes": size,
                        "ratio": r,
                        "met": r is not None and r >= TARGET_RAW_RATIO,
                    }
                )
                if op == "get" and transport == "tcp":
                    r = _ratio(pool, mcv)
                    targets.append(
                        {
                            "target": "tcp get >= Mooncake get",
                            "block_bytes": size,
                            "ratio": r,
                            "met": None if r is None else r >= 1.0,
                        }
                    )
                if op == "get" and transport == "shm":
                    r = _paired_ratio(s["get"], s["memcpy"])
                    targets.append(
                        {
                            "target": "shm get >= 50% memcpy",
                            "block_bytes": size,
                            "ratio": r,
                            "met": r is not None and r >= TARGET_MEMCPY_RATIO,
                        }
                    )
    graded = [t for t in targets if t["met"] is not None]  # Mooncake's is None when it was not measured
    met = bool(graded) and all(t["met"] for t in graded)
    summary = {
        "targets": targets,
        "all_targets_met": met,
        "target_met": met,
        "latency": {tr: res.get("latency") for tr, res in measured.items()},
        "ucx_tag_lanes": {tr: res.get("ucx_tag_lanes") for tr, res in measured.items()},
        "mooncake": {"measured": "samples" in mooncake, "error": mooncake.get("error")},
    }
    return records, summary


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def _size_name(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else f"{n // KIB} KiB"


def print_tables(console: Any, records: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="data plane throughput (GB/s, medians)")
    cols = (
        "transport",
        "block",
        "op",
        "pool",
        "pool, UCX path",
        "raw UCX",
        "pool/raw",
        "raw+xxh3",
        "pool/raw+xxh3",
        "perftest",
        "memcpy",
    )
    for col in (*cols, "Mooncake"):
        table.add_column(col, justify="right")
    for r in records:
        op = r["op"] + (" (mapped)" if r.get("path") == "mapped" else "")
        table.add_row(
            r["transport"],
            _size_name(r["block_bytes"]),
            op,
            _fmt(r["gb_per_s"]),
            _fmt(r.get("ucx_path_gb_per_s")),
            _fmt(r["raw_ucx_gb_per_s"]),
            _fmt(r["pool_over_raw"], ".0%"),
            _fmt(r.get("raw_ucx_xxh3_gb_per_s")),
            _fmt(r.get("pool_over_raw_xxh3"), ".0%"),
            _fmt(r["perftest_gb_per_s"]),
            _fmt(r["memcpy_gb_per_s"]),
            _fmt(r["mooncake_gb_per_s"]),
        )
    console.print(table)
    lat = Table(title="one-block read latency (µs)")
    for col in ("transport", "block", "pool p50", "pool p99", "raw p50", "raw p99"):
        lat.add_column(col, justify="right")
    for tr, v in summary["latency"].items():
        if v:
            lat.add_row(
                tr,
                _size_name(v["block_bytes"]),
                _fmt(v["pool_p50_us"], ".0f"),
                _fmt(v["pool_p99_us"], ".0f"),
                _fmt(v["raw_ucx_p50_us"], ".0f"),
                _fmt(v["raw_ucx_p99_us"], ".0f"),
            )
    console.print(lat)
    for t in summary["targets"]:
        mark = {True: "[green]met[/green]", False: "[red]missed[/red]", None: "[yellow]n/a[/yellow]"}[
            t["met"]
        ]
        console.print(
            f"  {t['target']:<28} {_size_name(t['block_bytes']):>7}: {_fmt(t['ratio'], '.0%'):>5}  {mark}"
        )
    console.print(f"UCX lanes seen: {summary['ucx_tag_lanes']}")
    console.print("[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]")
    if summary["mooncake"]["error"]:
        console.print(f"[yellow]Mooncake not measured: {summary['mooncake']['error']}[/yellow]")


def plot_report(records: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    transports = list(dict.fromkeys(r["transport"] for r in records))  # in measuring order
    fig, axes = plt.subplots(1, len(transports), figsize=(6 * len(transports), 4.5), squeeze=False)
    series = [
        ("get", "gb_per_s", "pool get", "C0", "-o"),
        ("put", "gb_per_s", "pool put", "C1", "-o"),
        ("get", "raw_ucx_gb_per_s", "raw ucxx get", "C0", "--x"),
        ("put", "raw_ucx_gb_per_s", "raw ucxx put", "C1", "--x"),
        ("get", "raw_ucx_xxh3_gb_per_s", "raw ucxx get + xxh3", "C0", ":+"),
        ("put", "raw_ucx_xxh3_gb_per_s", "raw ucxx put + xxh3", "C1", ":+"),
        ("get", "perftest_gb_per_s", "ucx_perftest tag_bw", "C2", ":s"),
        ("get", "memcpy_gb_per_s", "memcpy", "C7", ":^"),
        ("get", "mooncake_gb_per_s", "Mooncake get", "C3", "-.d"),
        ("put", "mooncake_gb_per_s", "Mooncake put", "C4", "-.d"),
        ("get", "ucx_path_gb_per_s", "pool get, UCX path (not mapped)", "C5", "-v"),
    ]
    for ax, tr in zip(axes[0], transports, strict=True):
        for op, key, label, color, style in series:
            pts = sorted(
                (r["block_bytes"], r[key])
                for r in records
                if r["transport"] == tr and r["op"] == op and r.get(key) is not None
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("block size (bytes)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"UCX {tr}: batch of blocks, 2 processes")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
