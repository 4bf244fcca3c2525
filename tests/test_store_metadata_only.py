"""`kvpool store --metadata-only` (benchmarks): a real store process commits reserved slots no write landed
in, lists them in its inventory, and refuses every read and write of bytes, so no reader ever gets bytes
nobody wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

os.environ.setdefault("UCX_TLS", "tcp")

from kvpool.client import convert as cv  # noqa: E402
from kvpool.v1 import kvpool_pb2 as pb  # noqa: E402
from tests.capabilities import require_ucx  # noqa: E402
from tests.test_store_node import NB, NS, StoreProc, commit, h, read, reserve, start_store  # noqa: E402
from transfer import BlockWrite, UcxTransport, checksum  # noqa: E402


@pytest.fixture(scope="module")
def transport() -> Iterator[UcxTransport]:
    require_ucx()
    t = UcxTransport()
    yield t
    t.close()


@pytest.fixture(scope="module")
def meta_store(transport: UcxTransport) -> Iterator[StoreProc]:
    s = start_store("--metadata-only", segment="1MiB")
    try:
        yield s
    finally:
        s.kill()


def test_commit_without_a_write_and_the_inventory_lists_it(meta_store: StoreProc) -> None:
    assert meta_store.info["metadata_only"] is True
    reserve(meta_store, [1, 2, 3])
    results = commit(meta_store, [1, 2])
    assert [(r.slot, r.error) for r in results] == [(1, ""), (2, "")]
    assert commit(meta_store, [9])[0].error  # never reserved: still refused
    [resp] = list(meta_store.stub.Inventory(pb.InventoryRequest(after_slot=0), timeout=10))
    b = cv.inventory_batch(resp)
    assert b.slots.tolist() == [1, 2]  # slot 3 is reserved only
    assert [b.block_hashes[i].tobytes() for i in range(2)] == [h(1), h(2)]
    assert all(b.namespaces[k] == NS for k in b.ns_index.tolist())


def test_every_read_and_write_is_refused(meta_store: StoreProc, transport: UcxTransport) -> None:
    reserve(meta_store, [20, 21])
    assert all(not r.error for r in commit(meta_store, [20]))
    res, out = read(transport, meta_store, [20])  # committed, no bytes: a read is refused
    assert not res[0].ok and "metadata-only" in res[0].error
    assert not out.any()
    data = np.full((1, NB), 7, dtype=np.uint8)
    wres = transport.write_blocks(
        meta_store.data_address, [BlockWrite(21, 1, data[0], checksum(data[0]))], timeout_s=30
    )
    assert not wres[0].ok and "metadata-only" in wres[0].error


def test_a_normal_store_still_refuses_a_commit_without_bytes(transport: UcxTransport) -> None:
    s = start_store(segment="1MiB")
    try:
        assert s.info["metadata_only"] is False
        reserve(s, [4])
        assert "not written" in commit(s, [4])[0].error
    finally:
        s.kill()


def test_metadata_only_takes_no_disk_tier_and_says_it_is_for_benchmarks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cmd = [sys.executable, "-m", "kvpool.cli.main", "store"]
    r = subprocess.run(
        [*cmd, "--metadata-only", "--disk-path", str(tmp_path), "--disk-size", "1MiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "metadata-only" in (r.stdout + r.stderr)
    help_text = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--metadata-only" in help_text and "benchmarks" in help_text
