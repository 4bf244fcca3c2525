"""The `mread` wire: a same-host read's request and reply as packed arrays, not one list per block.

A 256-block request and its reply as msgpack lists cost ~0.5 ms of per-block Python on the two sides (the
store's checks, the reply's lists, the reader's unpacking), a third of a 16 MiB read from a mapped
segment here; as arrays they cost a few numpy calls.

    request  {op:"mread", id, v: MREAD_VERSION, b: <u8[n, 3] bytes (slot, generation, nbytes), c?}
    reply    {id, ph:0, ok: u1[n] bytes, cs: <u8[n] bytes (stored xxh3), off: <u8[n] bytes (offset in the
              segment), e: [[index, error], ...] (the blocks not ok)}

A store advertises the version it serves as `mv` beside its segment descriptor in the handshake reply;
a reader maps the segment only when that version is its own (else it reads over UCX as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MREAD_VERSION = 2
_U64 = np.dtype("<u8")


def block_rows(reads: Sequence[Any]) -> np.ndarray:
    """(slot, generation, nbytes) of each read (`transfer.BlockRead`) as uint64 (n, 3). Raises `ValueError`
    unless every value is a plain int (not a bool) in [0, 2**63)."""
    flat = [v for r in reads for v in (r.slot, r.generation, r.nbytes)]
    if not all(type(v) is int for v in flat) or (flat and not 0 <= min(flat) <= max(flat) < 1 << 63):
        raise ValueError("block slot, generation and size must be ints in [0, 2**63)")
    return np.array(flat, dtype=_U64).reshape(-1, 3)


def encode_request(rows: np.ndarray) -> bytes:
    """`block_rows` -> the `b` field."""
    return rows.astype(_U64).tobytes()


def decode_request(field: Any, max_blocks: int) -> np.ndarray:
    """The `b` field -> uint64 array (n, 3), 1 <= n <= `max_blocks`, every value < 2**63 (a Python int
    fits every id). Raises `ValueError` saying what is wrong."""
    if not isinstance(field, bytes) or not field or len(field) % (3 * _U64.itemsize):
        raise ValueError("malformed block array")
    rows = np.frombuffer(field, dtype=_U64).reshape(-1, 3)
    if len(rows) > max_blocks:
        raise ValueError(f"a message names at most {max_blocks} blocks")
    if int(rows.max()) >= 1 << 63:
        raise ValueError("malformed block entry")
    return rows


def encode_reply(
    rid: int, ok: np.ndarray, checksums: np.ndarray, offsets: np.ndarray, errors: list[list[Any]]
) -> dict[str, Any]:
    """The reply to request `rid`: per block ok (bool), stored checksum and segment offset (uint64, 0 where
    not ok), and [index, error] of each failed block."""
    return {
        "id": rid,
        "ph": 0,
        "ok": ok.astype(np.uint8).tobytes(),
        "cs": checksums.astype(_U64).tobytes(),
        "off": offsets.astype(_U64).tobytes(),
        "e": errors,
    }


def decode_reply(reply: dict[str, Any], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[int, str]]:
    """A reply for `n` blocks -> (ok bool[n], checksums uint64[n], offsets uint64[n], {index: error}).
    Raises `ValueError` when it is malformed (wrong sizes, an error for an ok block or none for a failed one)."""
    try:
        ok = np.frombuffer(reply["ok"], dtype=np.uint8).astype(bool)
        cs = np.frombuffer(reply["cs"], dtype=_U64)
        off = np.frombuffer(reply["off"], dtype=_U64)
        errors = {int(i): str(e) for i, e in reply["e"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed reply ({exc})") from None
    if not len(ok) == len(cs) == len(off) == n:
        raise ValueError("one result per block expected")
    if sorted(errors) != np.flatnonzero(~ok).tolist():
        raise ValueError("errors do not match the failed blocks")
    return ok, cs, off, errors
