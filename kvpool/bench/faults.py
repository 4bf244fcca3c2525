"""Gray-failure figures (docs/bench_faults.md): a store that fails every write, at a steady
publish rate. `python -m kvpool.bench.faults [--json PATH]`.

The real master (`kvpool.master.core.Master`: placement, reservations, commits, data-plane health) runs in
process on a simulated clock; the store calls it makes are answered in process (`_Stores`), since only the
master's decisions are measured. Two stores; every write to `bad` fails, every write to `ok` lands. Each
publish reserves `blocks_per_publish` new blocks (one replica), its writer writes them for `write_ms`, then
commits what landed and reports each failed write (`ReportDataPlaneFailure`, as `PoolClient.put_blocks`
does). Figures:

- `blocks_after_first_failure`: blocks placed on `bad` in reservations the master made after it received
  the first failure report (the first commit or report naming `bad`), for `seconds` of publishing;
- the same without counting at commit (`commit_counting=False`: only the seconds-coalesced failure reports,
  as the master did before it counted writes at commit), for comparison;
- `transient_store_failed`: stores taken out (gray or failed) by one failed write on a healthy store.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import typer

from kvpool.master import dataplane
from kvpool.master.core import Master
from kvpool.master.maintenance import Maintenance
from kvpool.master.placement import CommitBlock
from kvpool.master.registry import PROTOCOL_VERSION
from kvpool.master.settings import MasterSettings
from kvpool.types import DEFAULT_LAYOUT, FakeClock, InventoryBatch, KVLayout

LAY = KVLayout.from_fingerprint(DEFAULT_LAYOUT)
RATES = (10, 100, 1000)


class _Stores:
    """The store calls of the master, answered in process: every order succeeds (the writes fail on the
    data plane, which the writer reports; the control plane of the failing store still answers)."""

    num_withheld = 0

    def identity(self, address: str, timeout_s: float, *, role: str = "store") -> None:
        return None

    def inventory(self, address: str, *, after_slot: int = 0) -> Iterator[InventoryBatch]:
        u64, hashes, none = np.zeros(0, np.uint64), np.zeros((0, 16), np.uint8), np.zeros(0, bool)
        return iter([InventoryBatch([], np.zeros(0, np.int32), hashes, hashes, none, u64, u64, u64, u64, -1)])

    def reserve(self, address: str, orders: object, write_lease_ms: int) -> None:
        return None

    def commit(self, address: str, slots: object) -> dict[tuple[int, int], str]:
        return {}

    def copy(self, address: str, src: str, blocks: object) -> dict[tuple[int, int], str]:
        return {}

    def free(self, address: str, slots: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
        return [(s, g + 1, False) for s, g in slots]

    def close(self) -> None:
        return None


def _master(clock: FakeClock, num_slots: int) -> tuple[Master, bytes]:
    settings = MasterSettings(port=0, bind_host="127.0.0.1", metrics=False, stale_after_ms=10**9)
    m = Master(settings, clock=clock, stores=_Stores())  # type: ignore[arg-type]
    for i, node_id in enumerate(("ok", "bad")):
        m.register_node(
            node_id=node_id,
            role="store",
            grpc_address=f"127.0.0.1:{i + 1}",
            data_address=f"127.0.0.1:{i + 11}",
            epoch=1,
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=LAY.fingerprint(),
            num_slots=num_slots,
            block_nbytes=LAY.block_nbytes,
        )
    Maintenance(m).tick()  # adopts the (empty) inventories: both placeable
    ns, _ = m.register_namespace(
        model_id="m",
        weights_version="v1",
        layout_fingerprint=LAY.fingerprint(),
        cache_salt="",
        adapter_digest="",
        extra={},
    )
    return m, ns


@contextmanager
def _commit_counting(on: bool) -> Iterator[None]:
    if on:
        yield
        return
    with mock.patch.object(dataplane, "note_commit", lambda *a, **k: None):
        yield


def run_rate(
    rate: float,
    *,
    seconds: float = 5.0,
    write_ms: int = 20,
    blocks_per_publish: int = 4,
    commit_counting: bool = True,
) -> dict[str, Any]:
    """Publish at `rate` per second for `seconds` with every write to `bad` failing (see the module)."""
    clock = FakeClock(1_000_000)
    n = int(rate * seconds)
    with _commit_counting(commit_counting):
        m, ns = _master(clock, num_slots=2 * n * blocks_per_publish + 64)
        start = clock.now_ms()
        events: list[
            tuple[float, int, int, Any]
        ] = []  # (ms from start, order, kind 0 publish / 1 commit, data)
        for i in range(n):
            heapq.heappush(events, (i * 1000.0 / rate, 2 * i, 0, i))
        first_report_ms: float | None = None
        after_blocks = bad_blocks = 0
        while events:
            at_ms, order, kind, data = heapq.heappop(events)
            clock.advance(max(0, start + int(at_ms) - clock.now_ms()))
            if kind == 0:
                hashes = [np.random.default_rng(data * 1000 + j).bytes(16) for j in range(blocks_per_publish)]
                out = m.publisher.reserve(
                    ns, b"", hashes, num_replicas=1, block_nbytes=0, costs=[], write_lease_ms=30_000
                )
                on_bad = sum(1 for locs in out.locations for x in locs if x.node_id == "bad")
                bad_blocks += on_bad
                if first_report_ms is not None and at_ms > first_report_ms:
                    after_blocks += on_bad
                heapq.heappush(events, (at_ms + write_ms, order + 1, 1, (out, hashes)))
                continue
            out, hashes = data
            blocks = []
            for h, locs in zip(hashes, out.locations, strict=True):
                written = [x for x in locs if x.node_id != "bad"]
                if written:
                    blocks.append(CommitBlock(h, 1, written))
                if len(written) < len(locs):
                    dataplane.report_failure(m, "bad", 1, "write", "write refused")
                    if first_report_ms is None:
                        first_report_ms = at_ms
            m.publisher.commit(out.rid, blocks)
        health = m.st.nodes["bad"].dataplane
        return {
            "publishes_per_s": rate,
            "publishes": n,
            "blocks_per_publish": blocks_per_publish,
            "write_ms": write_ms,
            "commit_counting": commit_counting,
            "blocks_on_failing_store": bad_blocks,
            "blocks_after_first_failure": after_blocks,
            "failing_store_state": health.state,
            "failing_store_grayed": health.num_grayed,
        }


def transient_store_failed() -> int:
    """Stores taken out (gray, or data plane failed) after one failed write on a healthy store among
    successful publishes."""
    clock = FakeClock(1_000_000)
    m, ns = _master(clock, num_slots=4096)
    for i in range(200):
        clock.advance(10)
        hashes = [np.random.default_rng(i).bytes(16)]
        out = m.publisher.reserve(
            ns, b"", hashes, num_replicas=1, block_nbytes=0, costs=[], write_lease_ms=30_000
        )
        locs = out.locations[0]
        fail = i == 50  # one transient error, on whichever store the block went to
        if fail:
            dataplane.report_failure(m, locs[0].node_id, 1, "write", "one transient error")
        m.publisher.commit(out.rid, [] if fail else [CommitBlock(hashes[0], 1, list(locs))])
    now = clock.now_ms()
    return sum(
        1
        for rec in m.st.nodes.values()
        if rec.dataplane.num_grayed or not rec.dataplane.usable(now, m.dataplane_policy)
    )


def main(
    json_out: Path = typer.Option(None, "--json", help="write the figures as JSON here"),
    seconds: float = typer.Option(5.0, min=1.0, help="seconds of publishing per rate"),
) -> None:
    """Blocks placed on a store failing every write after the master heard of its first failure, at 10,
    100 and 1,000 publishes/s, with and without counting at commit; and transient_store_failed."""
    rows = [run_rate(r, seconds=seconds, commit_counting=c) for c in (True, False) for r in RATES]
    figures = {"gray_writes": rows, "transient_store_failed": transient_store_failed()}
    for row in rows:
        typer.echo(
            f"{row['publishes_per_s']:>5} publishes/s, counting at commit {'on ' if row['commit_counting'] else 'off'}:"
            f" {row['blocks_after_first_failure']} blocks placed on the failing store after its first failure"
            f" report ({row['blocks_on_failing_store']} in all)"
        )
    typer.echo(f"transient_store_failed: {figures['transient_store_failed']}")
    if json_out is not None:
        json_out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
