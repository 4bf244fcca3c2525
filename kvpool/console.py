"""The rich Console the CLI prints tables and reports with."""

from __future__ import annotations

from typing import Any

PIPE_WIDTH = 1 << 16  # columns when stdout is no terminal: wider than any row, so no cell is cut


def console() -> Any:
    """A rich Console: the terminal's width on a terminal (unchanged look); piped or redirected, where rich
    would assume 80 columns (or the width of a terminal on stdin/stderr) and wrap or cut cells with '…' (a
    node id, an address, a benchmark's column header), one wide enough that every value stays whole on its
    line (`| grep`, `> file`). Tables must not be `expand`ed (they would grow to that width)."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=PIPE_WIDTH)
