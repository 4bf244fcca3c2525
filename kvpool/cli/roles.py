"""Role commands (`kvpool demo`, `master`, `store`, `prefill`, `decode`, `admin`), imported on use."""

from __future__ import annotations

from pathlib import Path

import typer


def register_role_commands(app: typer.Typer) -> None:
    @app.command()
    def demo(
        trace: Path | None = typer.Option(None, help="Mooncake-format JSONL trace to hash."),
        json_out: Path | None = typer.Option(None, "--json", help="Write the summary JSON here."),
    ) -> None:
        """Run the main job on real input (for now: hash a shipped trace's prompts)."""
        from kvpool.bench.trace_hash import run_trace_hash

        run_trace_hash(trace, json_out)
