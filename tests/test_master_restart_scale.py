"""A master holding many blocks (200 K in CI, `KVPOOL_SCALE_TEST_BLOCKS=1000000` for the 1 M run) is killed -9
and restarted with its stores alive: its matches hit again
from the stores' inventories, and no read ever returns another block's bytes.

Real processes throughout: a master on a fixed port, 4 stores with a tiny layout (4-byte blocks, each
block's bytes its hash's first bytes), filled with the conversation trace's tree under salted namespaces
through Reserve → UCX write → Commit (`kvpool.bench.master_scale`, the fill of `kvpool bench master`).
Reads go through the stores' data plane (`--no-share-segment`), so each store counts what it refuses
(`kvpool_store_transfer_errors_total{op="read"}`). The speed of the rebuild is the bench's figure
(docs/bench_master.md); here the bound is generous. The fill dominates the run: 200 K blocks take about 2.5
min here, 1 M about 13.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from collections.abc import Sequence

import numpy as np
import pytest

from kvpool.bench import master_scale_work as work
from kvpool.bench.master_scale import ScaleCluster, block_bytes, fill
from kvpool.bench.routing import default_trace
from kvpool.types import Location, Match
from tests.capabilities import require_ucx

transfer = pytest.importorskip("transfer")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]  # a 1 M-block fill on a loaded host: up to an hour

NUM_BLOCKS = int(os.environ.get("KVPOOL_SCALE_TEST_BLOCKS", "200000"))
HITS_AGAIN_WITHIN_S = 180.0  # generous on a shared 2-core VM; the figure belongs to the bench
FREED_WITHIN_S = 60.0
_READ_ERRORS = re.compile(r'^kvpool_store_transfer_errors_total\{op="read"\} ([0-9.e+]+)$', re.M)


def _read_errors(cluster: ScaleCluster) -> float:
    """Reads refused or failed, summed over the live stores' /metrics."""
    total = 0.0
    for s in cluster.stores:
        if s.popen.poll() is not None:
            continue
        with urllib.request.urlopen(f"http://{s.ready['metrics_address']}/metrics", timeout=10) as r:
            m = _READ_ERRORS.search(r.read().decode())
        total += float(m.group(1)) if m else 0.0
    return total


def _read_at(
    transport: object, match: Match, hashes: Sequence[bytes], nbytes: int
) -> list[tuple[bytes, Location, bool, bytes]]:
    """Read every replica of a match's blocks at the location the match named, straight from its store:
    (hash, location, ok, bytes read)."""
    from transfer import BlockRead
    from transfer.xxh3 import as_bytes_view

    out = []
    for i, locs in enumerate(match.replicas):
        for loc in locs:
            buf = np.zeros(nbytes, dtype=np.uint8)
            read = BlockRead(loc.slot, loc.generation, nbytes, loc.capability, loc.capability_expiry_ms)
            (res,) = transport.read_blocks(  # type: ignore[attr-defined]
                match.data_address(loc.node_id), [read], [as_bytes_view(buf)], timeout_s=10
            )
            out.append((hashes[i], loc, res.ok, buf.tobytes()))
    return out


def _assert_own_bytes(reads: list[tuple[bytes, Location, bool, bytes]], nbytes: int) -> int:
    """Every read that succeeded returned its own block's bytes; returns how many succeeded."""
    ok = 0
    for h, loc, success, got in reads:
        if success:
            assert got == block_bytes(h, nbytes).tobytes(), f"block {h.hex()} at {loc}: other bytes"
            ok += 1
    return ok


def test_a_restarted_master_hits_again_and_no_read_returns_other_bytes() -> None:
    require_ucx()
    from kvpool.client import MasterClient
    from transfer import UcxTransport

    store_args = ("--metrics", "--metrics-port", "0", "--no-share-segment")
    with ScaleCluster(NUM_BLOCKS, num_stores=4, store_args=store_args) as cl:
        nbytes = cl.block_nbytes
        f = fill(cl, default_trace(quick=False), NUM_BLOCKS, writers=3)
        picks, want = work.prompts(f.tree, f.namespaces, f.resident, 48, 64, seed=7)
        transport = UcxTransport()
        try:
            with MasterClient(cl.address) as c:
                assert c.stats().num_blocks == NUM_BLOCKS
                before = [c.match(ns, h) for ns, h in picks]
            assert [m.num_matched for m in before] == want
            for (_, h), m in zip(picks, before, strict=True):
                assert _assert_own_bytes(_read_at(transport, m, h, nbytes), nbytes) == m.num_matched

            t_kill = time.monotonic()
            cl.kill_master()
            cl.start_master()
            cl.register(f.salts)  # engines register their namespaces again at once
            with MasterClient(cl.address, timeout_s=30) as c:
                pending = set(range(len(picks)))
                while pending and time.monotonic() - t_kill < HITS_AGAIN_WITHIN_S:
                    for i in sorted(pending):
                        ns, h = picks[i]
                        m = c.match(ns, h)
                        assert m.num_matched <= want[i]  # never a block no one published
                        # a partly adopted master offers what it has: each block there is its own
                        _assert_own_bytes(_read_at(transport, m, h, nbytes), nbytes)
                        if m.num_matched == want[i]:
                            pending.discard(i)
                    time.sleep(0.5)
                assert not pending, (
                    f"{len(pending)} of {len(picks)} prompts did not hit again within {HITS_AGAIN_WITHIN_S} s"
                )
                after = [c.match(ns, h) for ns, h in picks]
                # the stores kept every block where it was: the old locations still read their own bytes
                for (_, h), m in zip(picks, before, strict=True):
                    assert _assert_own_bytes(_read_at(transport, m, h, nbytes), nbytes) == m.num_matched

                # blocks removed after the restart: their slots are freed (generation bumped), so the
                # locations the first master handed out are refused, counted, and never read other bytes
                errors_before = _read_errors(cl)
                gone = [(picks[i], before[i]) for i in range(0, len(picks), 4) if want[i] > 1]
                for (ns, h), m in gone:  # leaf first: each block's own slot is freed by its own removal
                    assert c.remove(ns, h[1 : m.num_matched][::-1], force=True) >= 1
                stale = [
                    r
                    for (_, h), m in gone
                    for r in _read_at(transport, m, h, nbytes)
                    if r[0] in set(h[1 : m.num_matched])
                ]
                deadline = time.monotonic() + FREED_WITHIN_S
                while any(r[2] for r in stale) and time.monotonic() < deadline:
                    time.sleep(0.5)  # the master's free orders reach the stores on its next ticks
                    stale = [
                        r
                        for (_, h), m in gone
                        for r in _read_at(transport, m, h, nbytes)
                        if r[0] in set(h[1 : m.num_matched])
                    ]
                assert stale and _assert_own_bytes(stale, nbytes) == 0  # every stale location refused
                assert _read_errors(cl) - errors_before >= len(stale)
                assert all(m.num_matched == w for m, w in zip(after, want, strict=True))
        finally:
            transport.close()
