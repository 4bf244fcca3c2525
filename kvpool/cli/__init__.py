"""The `kvpool` command line (typer). Every subcommand imports its role lazily.

`--help` shows a flag as a flag: recent typer versions print a `<bool>` type beside every on/off option
(`--insecure <bool>`, `--help <bool>`), which reads as if it took a value. Here an option that is a flag
and names no metavar of its own shows no type (as typer did before); every other option is unchanged.
"""

from __future__ import annotations

from typing import Any

import typer.core


def _flags_show_no_type() -> None:
    option = typer.core.TyperOption
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "_kvpool_flags", False):  # an older typer, or already done
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        if self.is_flag and self.metavar is None:
            return None
        return shown(self, ctx)  # type: ignore[no-any-return]

    display_type_rich._kvpool_flags = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_show_no_type()
