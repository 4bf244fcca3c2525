"""Checks of command-line values shared by commands that start processes: each runs before anything starts
and turns a bad value into one usage line (exit 2) naming the option."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from kvpool.trace import Trace


def device_option(value: str | None) -> str | None:
    """A `--device` callback: torch must name the device and this machine must be able to use it."""
    if value is None:
        return value
    from kvpool.model.settings import check_device

    try:
        return check_device(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


ENGINES = ("kvpool", "vllm")


def engine_option(value: str | None) -> str | None:
    """An `--engine`/`--engines` callback: kvpool (kvpool's own serving nodes) or vllm (vLLM engines)."""
    if value is not None and value not in ENGINES:
        raise typer.BadParameter(f"must be {' or '.join(ENGINES)}, got {value!r}")
    return value


def load_trace_option(path: Path, param_hint: str = "'--trace'") -> Trace:
    """Read a Mooncake-format trace; a missing or malformed file is a usage error naming the file and line."""
    from kvpool.errors import InvalidArgument
    from kvpool.trace import load_trace

    try:
        return load_trace(path)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint=param_hint) from None
