"""Block checksums (transfer/checksum.py): the GIL-free path computes xxhash's value and lets threads run."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import xxhash

from transfer import xxh3
from transfer.xxh3 import GIL_FREE_MIN_BYTES, checksum, checksums


@pytest.mark.parametrize("nbytes", [0, 1, 100, GIL_FREE_MIN_BYTES - 1, GIL_FREE_MIN_BYTES, (1 << 20) + 3])
def test_same_value_as_the_xxhash_binding_for_every_buffer_kind(nbytes: int) -> None:
    raw = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    want = xxhash.xxh3_64_intdigest(raw)
    assert checksum(raw) == want  # read-only bytes
    assert checksum(bytearray(raw)) == want
    arr = np.frombuffer(bytearray(raw), dtype=np.uint8)
    assert checksum(arr) == want and checksum(memoryview(arr)) == want
    if nbytes % 4 == 0:
        assert checksum(arr.view(np.float32)) == want  # any dtype: its bytes are hashed
    padded = np.zeros(nbytes + 8, dtype=np.uint8)
    padded[5 : 5 + nbytes] = arr
    assert checksum(memoryview(padded)[5 : 5 + nbytes]) == want  # an unaligned slice


def test_non_contiguous_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="C-contiguous"):
        checksum(np.zeros((8, 8), dtype=np.uint8)[:, ::2])


def test_checksums_keeps_order_and_matches_one_by_one() -> None:
    rng = np.random.default_rng(1)
    blocks = [rng.integers(0, 256, n, dtype=np.uint8) for n in [3, 1 << 20, 0, 5 << 16, 1 << 18, 7, 1 << 20]]
    assert checksums(blocks) == [checksum(b) for b in blocks]
    assert checksums([]) == []


def test_large_buffers_are_hashed_with_the_gil_released() -> None:
    """The point of the module: python-xxhash holds the GIL while hashing, so hashing threads serialised
    with each other and with the UCX loop. With a 5 s switch interval the main thread gets the GIL back
    while the hashing thread is inside the hash only if the hash released it."""
    assert xxh3.GIL_FREE, "xxhash's extension no longer exports XXH3_64bits"
    buf = np.ones(64 << 20, dtype=np.uint8)
    started, done = threading.Event(), threading.Event()

    def work() -> None:
        started.set()
        for _ in range(20):  # ~80 ms of hashing here
            checksum(buf)
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        worker = threading.Thread(target=work)
        worker.start()
        started.wait()
        ran_during_hash = not done.is_set()
        worker.join()
    finally:
        sys.setswitchinterval(old)
    assert ran_during_hash


def _checksums_of_rows(seed: int) -> list[int]:
    rows = np.random.default_rng(seed).integers(0, 256, (16, 1 << 20), dtype=np.uint8)
    return checksums(rows)


def test_checksums_work_in_a_forked_child() -> None:
    """Threads do not survive fork: a child inherited a pool whose threads did not exist and hung on its
    first batch (found by a new-user pass). The child now starts its own pool."""
    import multiprocessing as mp

    parent = _checksums_of_rows(4)  # the pool is in use before the fork
    with mp.get_context("fork").Pool(1) as pool:
        child = pool.apply_async(_checksums_of_rows, (4,)).get(timeout=60)
    assert child == parent


@pytest.mark.parametrize("bad", [b"abc" * 100, np.zeros(1000, dtype=np.uint8), np.zeros((2, 2, 2))])
def test_checksums_refuses_a_single_buffer(bad: object) -> None:
    with pytest.raises(TypeError, match="sequence of buffers or a 2-D array"):
        checksums(bad)  # type: ignore[arg-type]
