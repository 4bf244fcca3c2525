"""`kvpool bench …`: each benchmark lives in `kvpool.bench.<name>` and is imported on use."""

from __future__ import annotations

import typer

bench_app = typer.Typer(no_args_is_help=True)
