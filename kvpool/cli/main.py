"""Entry point of the `kvpool` console script.

`kvpool --help` must stay fast: nothing here imports torch, grpc or ucxx at module level.
"""

from __future__ import annotations

import logging
import sys

import typer

from kvpool.cli.admin import admin_app
from kvpool.cli.bench import bench_app
from kvpool.cli.master_cmd import register_master_command
from kvpool.cli.roles import register_role_commands
from kvpool.cli.router_cmd import register_router_command
from kvpool.cli.serving_cmd import register_serving_commands
from kvpool.cli.store_cmd import register_store_command
from kvpool.cli.up_cmd import register_up_command

app = typer.Typer(
    name="kvpool",
    help="kvpool: a disaggregated KV-cache pool for LLM serving.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(bench_app, name="bench", help="Benchmarks: each prints a table and writes --json.")
register_role_commands(app)
register_serving_commands(app)
register_store_command(app)
register_master_command(app)
register_router_command(app)
register_up_command(app)
app.add_typer(admin_app, name="admin")


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging.")) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main() -> None:
    from pydantic import ValidationError

    try:
        app()
    except (
        ValidationError
    ) as exc:  # a bad flag, env var or config value: one clear line per field, no traceback
        for err in exc.errors():
            field = ".".join(str(x) for x in err.get("loc", ())) or exc.title
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            print(f"kvpool: invalid setting {field}: {msg}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
