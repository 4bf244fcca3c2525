"""Entry point of the `kvpool` console script.

`kvpool --help` must stay fast: nothing here imports torch, grpc or ucxx at module level.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import typer

from kvpool.cli.admin import admin_app
from kvpool.cli.bench import bench_app
from kvpool.cli.master_cmd import register_master_command
from kvpool.cli.model_cmd import model_app
from kvpool.cli.roles import register_role_commands
from kvpool.cli.router_cmd import register_router_command
from kvpool.cli.serving_cmd import register_serving_commands
from kvpool.cli.store_cmd import register_store_command
from kvpool.cli.tls_cmd import register_tls_command
from kvpool.cli.token_cmd import token_app
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
register_tls_command(app)
app.add_typer(admin_app, name="admin")
app.add_typer(model_app, name="model")
app.add_typer(token_app, name="token")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"kvpool {version('kvpool')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("kvpool (not installed)")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug logging."),
    _version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
    ),
) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


BOOL_WORDS = "true/false, yes/no, on/off, 1/0 (any case; also t/f, y/n)"
"""What a boolean setting accepts from a flag value, a `KVPOOL_*` variable or the TOML file (pydantic)."""


def setting_error_line(err: Mapping[str, Any]) -> str:
    """One line for one error of a settings `ValidationError` (a bad flag, `KVPOOL_*` variable or TOML value)."""
    field = ".".join(str(x) for x in err.get("loc", ()))
    msg = str(err.get("msg", "")).removeprefix("Value error, ")
    if err.get("type") in ("bool_parsing", "bool_type"):
        msg = f"expected a boolean: {BOOL_WORDS}; got {err.get('input')!r}"
    if not field:  # a check across fields (e.g. the watermarks): its message names them
        return f"kvpool: invalid settings: {msg}"
    return f"kvpool: invalid setting {field}: {msg}"


def main() -> None:
    from pydantic import ValidationError

    from kvpool.errors import KVPoolError

    try:
        app()
    except (
        ValidationError
    ) as exc:  # a bad flag, env var or config value: one clear line per field, no traceback
        for err in exc.errors():
            print(setting_error_line(err), file=sys.stderr)
        raise SystemExit(2) from None
    except KVPoolError as exc:  # a failure the user can act on (a missing model, a node that did not start)
        logging.getLogger("kvpool").debug("traceback (kvpool -v)", exc_info=True)
        print(f"kvpool: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
