"""A store's data path says nothing of a slot to a caller without a capability (issue #46, lower items).

A real in-process store (`SlotTable` with capabilities, `UcxBlockServer`) read and written over real UCX
from a fresh interpreter (tests/fresh_process.py). The capability is checked before the generation and
the slot's state: a read or write naming a stale generation, a freed slot or a never-used one, without
a valid capability, gets the same capability refusal as any other; a reader holding a valid capability
for a slot's older generation is told the generation is stale.
"""

from __future__ import annotations

import os
import re
from typing import Any

os.environ.setdefault("UCX_TLS", "tcp")  # noqa: E402 - before UCX initialises

from kvpool.capability import READ, WRITE, Capabilities, CapabilityKey  # noqa: E402
from kvpool.store import Segment, SlotTable  # noqa: E402
from kvpool.store.slots import Reservation  # noqa: E402
from kvpool.types import FakeClock  # noqa: E402
from tests.fresh_process import in_fresh_process  # noqa: E402
from transfer import BlockRead, BlockWrite, checksum  # noqa: E402

NB = 4096
NS = b"n" * 16
NODE = "store-a"
NOW = 1_700_000_000_000


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _commit(table: SlotTable, caps: Capabilities, slot: int, data: bytes) -> None:
    table.reserve([Reservation(slot, 1, NS, _h(slot))], 60_000)
    wcap = caps.sign(WRITE, NS, _h(slot), NODE, slot, 1, NOW + 60_000)
    table.begin_write(slot, 1, NB, wcap, NOW + 60_000)[:] = data
    table.end_write(slot, 1, checksum(data), True)
    assert table.commit([(slot, 1)]) == [(slot, 1, "")]


def test_no_slot_state_reaches_a_caller_without_a_capability() -> None:
    in_fresh_process(
        "tests.test_store_check_order", "_case_check_order", transport_kwargs="probe_bytes=1 << 20"
    )


def _case_check_order(ucx: Any) -> None:
    from transfer import UcxBlockServer

    caps = Capabilities(CapabilityKey(b"s" * 32), clock=FakeClock(NOW), skew_ms=1000)
    table = SlotTable(Segment(16 * NB, NB, pin_memory="off"), capabilities=caps, node_id=NODE)
    server = UcxBlockServer(table, "127.0.0.1", 0, send_timeout_s=5.0)
    server.start()
    try:
        _commit(table, caps, 3, b"\x03" * NB)  # committed at generation 1
        _commit(table, caps, 5, b"\x05" * NB)
        table.free([(5, 1)])  # freed: now FREE at generation 2
        exp = NOW + 10_000
        forged = bytes(16)
        probes = [  # (slot, generation, capability): each tells a different story without the fix
            (3, 2, b""),  # a stale generation of a committed slot
            (3, 2, forged),
            (5, 1, b""),  # a freed slot's old generation
            (5, 2, forged),  # a freed slot's current generation
            (9, 1, b""),  # a never-used slot
            (9, 7, forged),
        ]

        def shape(error: str) -> str:
            return re.sub(r"(slot|generation) \d+", r"\1 N", error)

        out = [bytearray(NB) for _ in probes]
        reads = [BlockRead(s, g, NB, c, exp if c else 0) for s, g, c in probes]
        got = ucx.read_blocks(server.address, reads, [memoryview(b) for b in out], timeout_s=5)
        errors = {shape(r.error) for r in got}
        assert all(not r.ok for r in got)
        assert errors == {"PermissionDenied: capability missing for read of slot N"} | (
            {"PermissionDenied: capability invalid for read of slot N generation N"}
        ), errors
        writes = [BlockWrite(s, g, b"\x00" * NB, checksum(b"\x00" * NB), c, exp) for s, g, c in probes]
        got = ucx.write_blocks(server.address, writes, timeout_s=5)
        assert all(not r.ok for r in got)
        assert {shape(r.error).replace("write", "read") for r in got} <= errors, [r.error for r in got]
        # a reader with a valid capability for the freed slot's old block learns it is stale
        old = caps.sign(READ, NS, _h(5), NODE, 5, 1, exp)
        [res] = ucx.read_blocks(
            server.address, [BlockRead(5, 1, NB, old, exp)], [memoryview(out[0])], timeout_s=5
        )
        assert not res.ok and "StaleGeneration" in res.error, res.error
        good = caps.sign(READ, NS, _h(3), NODE, 3, 1, exp)
        [res] = ucx.read_blocks(
            server.address, [BlockRead(3, 1, NB, good, exp)], [memoryview(out[0])], timeout_s=5
        )
        assert res.ok and bytes(out[0]) == b"\x03" * NB
    finally:
        server.stop()
