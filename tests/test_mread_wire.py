"""The `mread` wire (transfer/mread_wire.py): what round-trips, and what a store or reader refuses."""

from __future__ import annotations

import numpy as np
import pytest

from transfer import BlockRead
from transfer.mread_wire import block_rows, decode_reply, decode_request, encode_reply, encode_request


def encode_rows(rows: list[tuple[int, int, int]]) -> bytes:
    return encode_request(np.array(rows, dtype=np.uint64).reshape(-1, 3))


def test_a_request_round_trips_and_malformed_ones_are_refused() -> None:
    rows = [(0, 1, 65536), (7, 2**40, 65536), (2**62, 3, 1)]
    assert decode_request(encode_request(block_rows([BlockRead(*r) for r in rows])), 8).tolist() == [
        list(r) for r in rows
    ]
    for bad, why in [
        (None, "malformed"),
        (b"", "malformed"),
        (b"x" * 25, "malformed"),
        ([[0, 1, 2]], "malformed"),
        (encode_rows([(0, 1, 2)] * 9), "at most 8"),
        (encode_rows([(2**63, 1, 2)]), "malformed block entry"),
    ]:
        with pytest.raises(ValueError, match=why):
            decode_request(bad, 8)
    for r in [(-1, 1, 2), (True, 1, 2), (0, 2**63, 2), (0, 1, 2.0), (0, 1, np.int64(2))]:
        with pytest.raises(ValueError, match="must be ints"):  # a bool or numpy int is no slot id
            block_rows([BlockRead(*r)])  # type: ignore[arg-type]
    assert block_rows([]).shape == (0, 3)


def test_a_reply_round_trips_and_every_inconsistency_is_refused() -> None:
    ok = np.array([True, False, True])
    cs, off = np.array([5, 0, 2**64 - 1], np.uint64), np.array([0, 0, 1 << 40], np.uint64)
    reply = encode_reply(9, ok, cs, off, [[1, "StaleGeneration: slot 1"]])
    got_ok, got_cs, got_off, errors = decode_reply(reply, 3)
    assert (
        got_ok.tolist() == ok.tolist() and got_cs.tolist() == cs.tolist() and got_off.tolist() == off.tolist()
    )
    assert errors == {1: "StaleGeneration: slot 1"}
    assert reply["id"] == 9 and reply["ph"] == 0
    for broken in [
        {**reply, "ok": b"\x01\x00"},  # one result short
        {**reply, "e": []},  # a failed block without its error
        {**reply, "e": [[0, "x"], [1, "y"]]},  # an error for a block that is ok
        {**reply, "e": [[1]]},
        {k: v for k, v in reply.items() if k != "cs"},
        {**reply, "off": "nope"},
    ]:
        with pytest.raises(ValueError):
            decode_reply(broken, 3)
    with pytest.raises(ValueError, match="one result per block"):
        decode_reply(reply, 4)
