"""What every `kvpool admin` command shares: the Typer app, `--master`/`--timeout`, option checks, and
`_run` (one call to the master; a table or `--json`; one line and a non-zero exit on failure)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from typing import Any

import typer

from kvpool.console import console

admin_app = typer.Typer(no_args_is_help=True, help="Operate a live pool (status, nodes, stats, versions...).")


def _checked(ok: Callable[[float], bool], expected: str) -> Callable[[Any], Any]:
    """An option callback: a value outside `ok` (NaN and ±inf never pass) is a usage error (exit 2, naming
    the option and what it expects) before any call to the master, not a refusal by the master (exit 1)."""

    def callback(value: Any) -> Any:
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise typer.BadParameter(f"must be {expected}, got {value}")
        return value

    return callback


POSITIVE = _checked(lambda v: v > 0, "> 0")
NON_NEGATIVE = _checked(lambda v: v >= 0, ">= 0")
UNIT_FRACTION = _checked(lambda v: 0 < v <= 1, "in (0, 1]")


def _non_empty(value: str) -> str:
    if not value.strip():
        raise typer.BadParameter("must not be empty")
    return value


def _namespace_hex(value: str) -> str:
    """A `--namespace` digest given as hex, checked before any call ("" only where it may be left out)."""
    from kvpool.hashing import parse_hash

    if value:
        try:
            parse_hash(value, "namespace")
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def _namespace_hex_given(value: str) -> str:
    if not value:
        raise typer.BadParameter("must be 32 hex characters, got ''")
    return _namespace_hex(value)


def _known_gpu(gpu: str) -> str:
    from kvpool.economics import GPUS

    if gpu not in GPUS:
        raise typer.BadParameter(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    return gpu


class _Ctx:
    master: str = "127.0.0.1:50051"
    timeout_s: float = 5.0


@admin_app.callback()
def _admin(
    master: str = typer.Option(
        "127.0.0.1:50051", "--master", help="Master HOST:PORT (HOST:PORT,HOST:PORT...: masters in HA)."
    ),
    timeout_s: float = typer.Option(5.0, "--timeout", help="Deadline per call (s), > 0.", callback=POSITIVE),
) -> None:
    from kvpool.config import check_host_port

    try:
        for address in master.split(","):
            check_host_port(address.strip())
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--master") from None
    _Ctx.master, _Ctx.timeout_s = master, timeout_s


def _tls_hint(exc: Exception) -> str:
    """For a master that did not answer while no TLS is configured: say how a `kvpool up` cluster's
    mutual TLS is reached (a plaintext call to it reads as a closed socket)."""
    from kvpool.errors import Unavailable

    if isinstance(exc, Unavailable) and not os.environ.get("KVPOOL_TLS_CA_FILE"):
        return (
            " (a cluster under `kvpool up` serves gRPC over mutual TLS: run the `export KVPOOL_TLS_CA_FILE=... "
            "KVPOOL_TLS_CERT_FILE=... KVPOOL_TLS_KEY_FILE=...` line it printed)"
        )
    return ""


def _run(fn: Callable[[Any], Any], as_json: bool, render: Callable[[Any], None]) -> None:
    """Call `fn(client)`; print JSON or a table; one line and exit 1 on any kvpool error."""
    from kvpool.client import MasterClient
    from kvpool.errors import KVPoolError

    try:
        with MasterClient(_Ctx.master, timeout_s=_Ctx.timeout_s) as client:
            result = fn(client)
    except KVPoolError as exc:
        typer.echo(f"kvpool admin: {type(exc).__name__}: {exc}{_tls_hint(exc)}", err=True)
        raise typer.Exit(1) from None
    except ValueError as exc:
        typer.echo(f"kvpool admin: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(_plain(result), indent=2, sort_keys=True))
    else:
        render(result)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.hex()
    return value


def _table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    table = Table(title=title)  # not expanded: as wide as its cells (see kvpool.console)
    for c in columns:
        table.add_column(c)
    for r in rows:
        table.add_row(*[str(x) for x in r])
    console().print(table)


def _kv(title: str, data: dict[str, Any]) -> None:
    _table(title, ["key", "value"], [[k, v] for k, v in data.items()])


JSON = typer.Option(False, "--json", help="Print JSON instead of a table.")
