"""The `bench` extra: progress bars (tqdm) and plots (matplotlib) some benchmarks need
(`pip install 'kvpool[bench]'`); a command that needs a missing one says so before it starts."""

from __future__ import annotations

import importlib
from pathlib import Path

import typer

BENCH_EXTRA = "pip install 'kvpool[bench]'"


def need_bench_extra(command: str, *, progress: bool = False, plot: Path | None = None) -> None:
    """Exit 1 with one line naming the `bench` extra when `command` needs tqdm (`progress`) or matplotlib
    (`plot` given) and it is not installed; nothing has started yet."""
    wanted = [m for m, needed in (("tqdm", progress), ("matplotlib", plot is not None)) if needed]
    missing = []
    for module in wanted:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        typer.echo(
            f"kvpool bench {command}: needs {' and '.join(missing)} from the 'bench' extra: {BENCH_EXTRA}",
            err=True,
        )
        raise typer.Exit(1)
