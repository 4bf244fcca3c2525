"""Argument checks for the radix index: raise `InvalidArgument` naming the argument, before any change."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvpool.errors import InvalidArgument
from kvpool.types import HASH_NBYTES, BlockHash, Location


def check_hash(value: object, what: str) -> BlockHash:
    if not isinstance(value, bytes) or len(value) != HASH_NBYTES:
        got = f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__
        raise InvalidArgument(f"{what} must be {HASH_NBYTES} bytes, got {got}")
    return BlockHash(value)


def check_hashes(values: Sequence[object], what: str = "block_hashes") -> list[BlockHash]:
    out = [check_hash(v, f"{what}[{i}]") for i, v in enumerate(values)]
    if len(set(out)) != len(out):
        raise InvalidArgument(f"{what} repeats a block hash (a chain cannot contain a cycle)")
    return out


def check_count(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{what} must be a non-negative int, got {value!r}")
    return value


def per_block_sizes(value: Sequence[int] | int, n: int) -> list[int]:
    values = [value] * n if isinstance(value, int) else list(value)
    if len(values) != n:
        raise InvalidArgument(f"size_bytes has {len(values)} entries for {n} blocks")
    for i, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= MAX_U32:
            raise InvalidArgument(f"size_bytes[{i}] must be an int in [1, 2**32), got {v!r}")
    return values


def per_block_costs(value: Sequence[float] | float, n: int) -> list[float]:
    values = [float(value)] * n if isinstance(value, int | float) else [float(v) for v in value]
    if len(values) != n:
        raise InvalidArgument(f"recompute_cost_s has {len(values)} entries for {n} blocks")
    for i, v in enumerate(values):
        if not math.isfinite(v) or v < 0:
            raise InvalidArgument(f"recompute_cost_s[{i}] must be finite and >= 0, got {v!r}")
    return values


def per_block_locations(value: Sequence[Sequence[Location]], n: int) -> list[tuple[Location, ...]]:
    if len(value) != n:
        raise InvalidArgument(f"locations has {len(value)} entries for {n} blocks")
    out: list[tuple[Location, ...]] = []
    for i, locs in enumerate(value):
        for loc in locs:
            check_location(loc, f"locations[{i}]")
        out.append(tuple(dict.fromkeys(locs)))
    return out


MAX_U32 = 2**32 - 1
"""The largest slot and block size the index's uint32 columns hold (see `columns.py`)."""
MAX_GENERATION = 2**63 - 1


def check_location(loc: object, what: str) -> Location:
    """A `Location` whose slot (uint32) and generation (uint64, below 2**63) fit the replica columns."""
    if not isinstance(loc, Location):
        raise InvalidArgument(f"{what} holds {type(loc).__name__}, not a Location")
    for name, limit, text in (("slot", MAX_U32, "2**32"), ("generation", MAX_GENERATION, "2**63")):
        value = getattr(loc, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
            raise InvalidArgument(f"{what}: {name} must be an int in [0, {text}), got {value!r}")
    if not isinstance(loc.node_id, str):
        raise InvalidArgument(f"{what}: node_id must be a str")
    return loc
