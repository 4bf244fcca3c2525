"""The Mooncake-format request trace (Mooncake FAST'25, its open-sourced traces): its records, the
loader, and how a trace's blocks enter a `RadixIndex` (the demo's workload, `kvpool bench trace`, the
economics replay).

Format: one JSON object per line, `{"timestamp": ms, "input_length": tokens, "hash_ids": [int, ...]}`.
Each hash id is one 512-token block (the last one of a request possibly partial) and names its whole
prefix. Block size in bytes and recompute cost of an inserted block follow a nominal 8B dense model
(Llama-3-8B shapes, bf16 KV): 128 KiB per token; recompute = tokens * (2*params + 2*layers*d_model*context)
FLOP at 400 TFLOP/s.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.errors import InvalidArgument
from kvpool.types import BlockHash, Location, NamespaceId

if TYPE_CHECKING:
    from kvpool.index import RadixIndex

TRACE_BLOCK_TOKENS = 512
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
"""Llama-3-8B: 32 layers x (K,V) x 8 KV heads x head_dim 128 x bf16."""
_PARAMS, _LAYERS, _D_MODEL, _FLOP_PER_S = 8.0e9, 32, 4096, 400.0e12
TRACE_NS = NamespaceId(b"trace-replay-ns\x00")
SIM_LOCATION = Location("sim", 0, 0)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]
    num_unique_blocks: int


TRACE_ENV = "KVPOOL_TRACE"
"""Names the whole Mooncake conversation trace (a JSONL file) where a host has it; benches default to it."""
BUNDLED_TRACE = Path(__file__).resolve().parent / "data" / "traces" / "conversation_small.jsonl"
"""400 requests of the conversation trace, shipped with the package."""


def full_trace() -> Path:
    """The trace `KVPOOL_TRACE` names when it is a file, else the bundled excerpt (`BUNDLED_TRACE`)."""
    named = os.environ.get(TRACE_ENV, "")
    return Path(named) if named and Path(named).is_file() else BUNDLED_TRACE


def load_trace(path: Path) -> Trace:
    """Parse a JSONL trace; raises `InvalidArgument` naming the file and line of any malformed record."""
    requests: list[TraceRequest] = []
    unique: set[int] = set()
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise InvalidArgument(f"{path}: cannot read trace: {exc.strerror}") from None
    with fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode()
            except UnicodeDecodeError as exc:
                raise InvalidArgument(f"{path}:{lineno}: not UTF-8 text (byte {exc.start})") from None
            if not line.strip():
                continue
            requests.append(_parse_line(path, lineno, line))
            unique.update(requests[-1].hash_ids)
    if not requests:
        raise InvalidArgument(f"{path}: no trace records")
    return Trace(path.stem, tuple(requests), len(unique))


def _parse_line(path: Path, lineno: int, line: str) -> TraceRequest:
    where = f"{path}:{lineno}"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"{where}: not JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # an int of > 4300 digits; nesting too deep
        raise InvalidArgument(f"{where}: not a usable JSON record ({type(exc).__name__}: {exc})") from None
    if not isinstance(rec, dict):
        raise InvalidArgument(f"{where}: a record must be a JSON object")
    for key in ("timestamp", "input_length", "hash_ids"):
        if key not in rec:
            raise InvalidArgument(f"{where}: missing {key!r}")
    ts, n_in, ids = rec["timestamp"], rec["input_length"], rec["hash_ids"]
    if not isinstance(ts, int) or isinstance(ts, bool) or ts < 0:
        raise InvalidArgument(f"{where}: timestamp must be a non-negative int, got {ts!r}")
    if not isinstance(n_in, int) or isinstance(n_in, bool) or n_in <= 0:
        raise InvalidArgument(f"{where}: input_length must be a positive int, got {n_in!r}")
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise InvalidArgument(f"{where}: hash_ids must be a list of non-negative ints")
    if len(ids) != math.ceil(n_in / TRACE_BLOCK_TOKENS):
        raise InvalidArgument(
            f"{where}: {len(ids)} hash_ids for input_length {n_in} (expected ceil({n_in}/{TRACE_BLOCK_TOKENS}))"
        )
    if len(set(ids)) != len(ids):
        raise InvalidArgument(f"{where}: hash_ids repeats an id")
    return TraceRequest(ts, n_in, tuple(ids))


def block_hash(hash_id: int) -> BlockHash:
    """A trace hash id as a 16-byte `BlockHash` (big-endian)."""
    return BlockHash(hash_id.to_bytes(16, "big"))


def insert_rest(index: RadixIndex, hashes: list[BlockHash], start: int, input_length: int) -> None:
    """Insert `hashes[start:]` of one request (`input_length` tokens) under `TRACE_NS` at `SIM_LOCATION`,
    with the nominal model's sizes and recompute costs."""
    tokens = [
        min(TRACE_BLOCK_TOKENS, input_length - j * TRACE_BLOCK_TOKENS) for j in range(start, len(hashes))
    ]
    costs = [
        t * (2 * _PARAMS + 2 * _LAYERS * _D_MODEL * (j * TRACE_BLOCK_TOKENS + t / 2)) / _FLOP_PER_S
        for j, t in zip(range(start, len(hashes)), tokens, strict=True)
    ]
    index.insert(
        TRACE_NS,
        hashes[start:],
        parent=hashes[start - 1] if start else None,
        locations=[(SIM_LOCATION,)] * len(tokens),
        size_bytes=[t * KV_BYTES_PER_TOKEN for t in tokens],
        recompute_cost_s=costs,
    )
