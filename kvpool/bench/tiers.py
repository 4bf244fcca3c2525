"""`kvpool bench tiers`: the disk half. The store's disk tier engine (`kvpool.store.disk_tier`) writes and
reads back `total` bytes of blocks in batches of 1 and 4 MiB (checksums verified both ways, every write
synced and recorded, the page cache bypassed), against `dd oflag=direct` / `dd iflag=direct` with `bs=4M`
on the same file system in the same run (the engine's write time includes its final sync, as dd's
`conv=fdatasync`). GB/s figures are medians of `reps` rounds; in each round the engine and dd run back to
back (in turn first), and a ratio is the median of the rounds' ratios, so that a shared disk's changing load
falls on both sides. Headline fields: `disk_write_over_baseline` and `disk_read_over_baseline` (the lower of
the two batch sizes; target ≥ 0.7 each).

The memory-path and warm-restart halves of the issue's benchmark need the master's side of the tier.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.store.disk_io import aligned_empty

TARGET_OVER_BASELINE = 0.7
BATCHES_BYTES = (1 << 20, 4 << 20)
DD_BS_BYTES = 4 << 20
_FIRST_SLOT = 1 << 31


def _fs_type(path: Path) -> str:
    out = subprocess.run(["findmnt", "-no", "FSTYPE", "-T", str(path)], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _dd(args: list[str]) -> float:
    """Seconds `dd` took (its own figure: `... copied, 0.51 s, ...`). Raises `RuntimeError` on failure."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"dd {' '.join(args)}: {out.stderr.strip()}")
    line = next(x for x in out.stderr.splitlines() if " copied, " in x)
    return float(line.split(" copied, ")[1].split(" s")[0])


def _engine_round(
    tier: Any, blocks: np.ndarray, cs: np.ndarray, batch: int, total_slots: int
) -> tuple[float, float]:
    """(write s, read s) of `total_slots` blocks through the engine in batches of `batch` slots; frees
    them after (not timed)."""
    ns = [b"bench-tiers-ns00"] * batch
    h = np.zeros((batch, 16), dtype=np.uint8)
    has_parent = np.zeros(batch, dtype=np.bool_)
    out = aligned_empty(blocks.nbytes).reshape(blocks.shape)  # as a store's segment rows: page-aligned
    starts = range(_FIRST_SLOT, _FIRST_SLOT + total_slots, batch)
    t0 = time.perf_counter()
    for a in starts:
        s = np.arange(a, a + batch, dtype=np.int64)
        h[:, :8] = s.astype("<u8").view(np.uint8).reshape(-1, 8)
        if any(tier.write(s, tier.generation_of(s), blocks, ns, h, h, has_parent, cs)):
            raise RuntimeError(f"disk tier write failed: {tier.degraded}")
    if not tier.sync():  # durable, as dd's conv=fdatasync
        raise RuntimeError(f"disk tier sync failed: {tier.degraded}")
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for a in starts:
        s = np.arange(a, a + batch, dtype=np.int64)
        if any(tier.read(s, tier.generation_of(s), out)):
            raise RuntimeError(f"disk tier read failed: {tier.degraded}")
    read_s = time.perf_counter() - t0
    if not np.array_equal(out, blocks):
        raise RuntimeError("the engine read back other bytes than it wrote")
    every = np.arange(_FIRST_SLOT, _FIRST_SLOT + total_slots, dtype=np.int64)
    tier.free(every, tier.generation_of(every))
    return write_s, read_s


def run_tiers_bench(
    disk_path: Path, *, total_bytes: int, block_nbytes: int, reps: int, json_out: Path | None
) -> dict[str, Any]:
    """Measure, print a table, write the report (`kvpool.report.write_report`). Raises `InvalidArgument` for
    a path that is missing or cannot bypass the page cache (tmpfs), or sizes that do not fit."""
    from rich.console import Console
    from rich.table import Table

    from kvpool.report import write_report
    from kvpool.store.disk_tier import DiskTier, DiskTierError
    from transfer import checksums

    if not disk_path.is_dir():
        raise InvalidArgument(f"--disk-path {disk_path}: no such directory")
    if block_nbytes <= 0 or any(b % block_nbytes for b in (*BATCHES_BYTES, total_bytes)):
        raise InvalidArgument("--block-size must divide 1 MiB and --total")
    work = Path(tempfile.mkdtemp(prefix="kvpool-bench-tiers-", dir=disk_path))
    try:
        try:
            tier = DiskTier.open(work, total_bytes, block_nbytes, first_slot=_FIRST_SLOT)
        except DiskTierError as exc:
            raise InvalidArgument(str(exc)) from None
        if not tier.direct:
            tier.close()
            raise InvalidArgument(
                f"--disk-path {disk_path}: its file system ({_fs_type(disk_path)}) refuses O_DIRECT"
            )
        alpha_s, beta = tier.measure()
        dd_file = work / "dd.bin"
        count = total_bytes // DD_BS_BYTES
        records: list[dict[str, Any]] = []
        summary_rows: list[dict[str, Any]] = []
        for batch_bytes in BATCHES_BYTES:
            k = batch_bytes // block_nbytes
            blocks = aligned_empty(batch_bytes).reshape(k, block_nbytes)
            blocks[:] = np.random.default_rng(k).integers(0, 256, blocks.shape, dtype=np.uint8)
            cs = np.array(checksums(blocks), dtype=np.uint64)
            ew: list[float] = []
            er: list[float] = []
            dw: list[float] = []
            dr: list[float] = []
            dd_write = [
                "if=/dev/zero",
                f"of={dd_file}",
                "bs=4M",
                f"count={count}",
                "oflag=direct",
                "conv=fdatasync",
            ]
            for rep in range(reps):  # engine and dd side by side, in turn first (the disk here is shared)
                for engine_turn in (rep % 2 == 0, rep % 2 == 1):
                    if engine_turn:
                        w, r = _engine_round(tier, blocks, cs, k, total_bytes // block_nbytes)
                        ew.append(w)
                        er.append(r)
                    else:
                        dw.append(_dd(dd_write))
                        dr.append(_dd([f"if={dd_file}", "of=/dev/null", "bs=4M", "iflag=direct"]))
            row: dict[str, Any] = {
                "batch_bytes": batch_bytes,
                "engine_write_gbps": round(total_bytes / statistics.median(ew) / 1e9, 3),
                "engine_read_gbps": round(total_bytes / statistics.median(er) / 1e9, 3),
                "dd_write_gbps": round(total_bytes / statistics.median(dw) / 1e9, 3),
                "dd_read_gbps": round(total_bytes / statistics.median(dr) / 1e9, 3),
                # the median of each round's engine/dd ratio: a round's two runs met the same disk load
                "write_over_baseline": round(
                    statistics.median(d / e for d, e in zip(dw, ew, strict=True)), 3
                ),
                "read_over_baseline": round(statistics.median(d / e for d, e in zip(dr, er, strict=True)), 3),
            }
            summary_rows.append(row)
            records.append(
                {
                    "op": "rounds",
                    "batch_bytes": batch_bytes,
                    "engine_write_s": ew,
                    "engine_read_s": er,
                    "dd_write_s": dw,
                    "dd_read_s": dr,
                }
            )
        counters = vars(tier.counters).copy()
        tier.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {
        "disk_path": str(disk_path),
        "fs_type": _fs_type(disk_path),
        "direct_io": True,
        "block_nbytes": block_nbytes,
        "total_bytes": total_bytes,
        "reps": reps,
        "disk_write_over_baseline": min(r["write_over_baseline"] for r in summary_rows),
        "disk_read_over_baseline": min(r["read_over_baseline"] for r in summary_rows),
        "target_over_baseline": TARGET_OVER_BASELINE,
        "alpha_s": alpha_s,
        "beta_s_per_byte": beta,
        "batches": summary_rows,
        "engine_counters": counters,
    }
    summary["target_met"] = (
        min(summary["disk_write_over_baseline"], summary["disk_read_over_baseline"]) >= TARGET_OVER_BASELINE
    )
    table = Table(
        title=f"kvpool bench tiers: disk ({summary['fs_type']}, {block_nbytes >> 10} KiB blocks, "
        f"{total_bytes >> 20} MiB a round, median of {reps})"
    )
    for col in (
        "batch",
        "engine write GB/s",
        "dd write GB/s",
        "ratio",
        "engine read GB/s",
        "dd read GB/s",
        "ratio",
    ):
        table.add_column(col, justify="right")
    for x in summary_rows:
        table.add_row(
            f"{x['batch_bytes'] >> 20} MiB", f"{x['engine_write_gbps']:.2f}", f"{x['dd_write_gbps']:.2f}",
            f"{x['write_over_baseline']:.2f}", f"{x['engine_read_gbps']:.2f}", f"{x['dd_read_gbps']:.2f}",
            f"{x['read_over_baseline']:.2f}",
        )  # fmt: skip
    console = Console()
    console.print(table)
    console.print(
        f"disk α {alpha_s * 1e6:.0f} us, β {1 / beta / 1e9 if beta else float('inf'):.2f} GB/s (the tier's own probe)"
    )
    verdict = "[green]target met[/green]" if summary["target_met"] else "[red]target NOT met[/red]"
    console.print(
        f"disk_write_over_baseline {summary['disk_write_over_baseline']}, disk_read_over_baseline "
        f"{summary['disk_read_over_baseline']} (target ≥ {TARGET_OVER_BASELINE}): {verdict}"
    )
    return write_report(json_out, "tiers", records, summary)
