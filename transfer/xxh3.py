"""Block checksums: xxh3_64 of a block's bytes, computed without holding the GIL.

The `xxhash` binding holds the GIL while it hashes (python-xxhash 3.x), so "hashing on a helper thread"
only blocked the UCX loop thread and every other hasher: two threads hashing 256 MiB each took as long as
one doing both (measured here: 40 ms either way). The binding's extension module exports the C function
`XXH3_64bits(const void*, size_t)`; called through `ctypes` (which releases the GIL around foreign calls)
it computes the identical value while other threads run: two threads, 20 ms. Small buffers keep the
binding (a ctypes call costs ~1 us more); where the symbol is missing the binding is used for all sizes.

Source: xxHash's XXH3 (Y. Collet, https://github.com/Cyan4973/xxHash, `XXH3_64bits`, seed 0).
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import xxhash

log = logging.getLogger(__name__)

GIL_FREE_MIN_BYTES = 64 << 10
"""Buffers at least this large are hashed with the GIL released."""
INLINE_MAX_BYTES = 256 << 10
"""The transports hash up to this many bytes in place rather than on `HASH_POOL`: handing a job to a
hashing thread and back (~0.3 ms in single-block reads here) costs more than hashing 256 KiB (~15 us)."""
NUM_HASH_THREADS = max(2, min(8, os.cpu_count() or 2))
T = TypeVar("T")


class _HashPool:
    """The process's checksum threads (client verification, store write checks, `checksums`).

    `NUM_HASH_THREADS` threads, started at import from the importing thread so that they run at its
    priority: a thread inherits its creator's niceness, and the UCX loop thread (nice 19,
    `transfer.ucx_runtime`) would otherwise create them on first use and leave the hashing of landed bytes
    to idle cycles only. A child made by `fork` gets a fresh pool (threads do not survive a fork: the
    inherited executor would queue work for threads that do not exist and never answer)."""

    def __init__(self) -> None:
        self._executor = self._start()
        os.register_at_fork(after_in_child=self._after_fork)

    @staticmethod
    def _start() -> ThreadPoolExecutor:
        executor = ThreadPoolExecutor(max_workers=NUM_HASH_THREADS, thread_name_prefix="kvpool-xxh3")
        barrier = threading.Barrier(NUM_HASH_THREADS)
        for _ in range(NUM_HASH_THREADS):  # each holds its thread until all have started: n threads
            executor.submit(barrier.wait, 10.0)
        return executor

    def _after_fork(self) -> None:
        self._executor = self._start()

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        return self._executor.submit(fn, *args)


HASH_POOL = _HashPool()


def _load_xxh3() -> Any:
    try:
        ext = importlib.import_module("xxhash._xxhash")  # the binding's C extension
        fn = ctypes.CDLL(ext.__file__).XXH3_64bits
    except (ImportError, OSError, AttributeError) as exc:
        log.info("xxh3 without the GIL released (%s): hashing threads serialise", exc)
        return None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    probe = b"kvpool xxh3 probe" * 5000
    if fn(probe, len(probe)) != xxhash.xxh3_64_intdigest(probe):  # never trust a symbol blindly
        log.warning("the exported XXH3_64bits disagrees with xxhash's binding; not using it")
        return None
    return fn


_XXH3 = _load_xxh3()
GIL_FREE = _XXH3 is not None
"""Whether large buffers are hashed with the GIL released (see the module docstring)."""


Buffer = memoryview | bytes | bytearray | np.ndarray


def as_bytes_view(data: Buffer) -> memoryview:
    """A flat, byte-typed view of a C-contiguous buffer (no copy). Raises `ValueError` otherwise."""
    view = memoryview(data)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ValueError("block buffers must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def address_of(view: memoryview) -> int:
    """The address of a buffer's first byte (read-only buffers too)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))  # ~0.5 us; writable, non-empty only
    except (TypeError, ValueError):
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)  # ~3.5 us


def checksum(data: Buffer) -> int:
    """xxh3_64 (seed 0) of the bytes of `data` (a C-contiguous buffer), as an unsigned int.

    The GIL is released while a buffer of at least `GIL_FREE_MIN_BYTES` is hashed (when `GIL_FREE`).
    Raises `ValueError` for a non-contiguous buffer."""
    view = as_bytes_view(data)
    if _XXH3 is None or view.nbytes < GIL_FREE_MIN_BYTES:
        return xxhash.xxh3_64_intdigest(view)
    return int(_XXH3(address_of(view), view.nbytes))


def checksums(views: Sequence[Buffer] | np.ndarray) -> list[int]:
    """`checksum` of each buffer (or of each row of a 2-D array), spread over `HASH_POOL`, in order.
    Call from outside `HASH_POOL`. Raises `ValueError` for a non-contiguous buffer, `TypeError` when given
    one buffer (bytes, a memoryview, an array that is not 2-D) instead of a sequence of them."""
    if isinstance(views, bytes | bytearray | memoryview) or (
        isinstance(views, np.ndarray) and views.ndim != 2
    ):
        raise TypeError("checksums takes a sequence of buffers or a 2-D array (one checksum per row)")
    n = len(views)
    if n == 0:
        return []
    total = sum(as_bytes_view(v).nbytes for v in views)
    parts = min(NUM_HASH_THREADS, n) if GIL_FREE and total >= 4 * GIL_FREE_MIN_BYTES else 1
    if parts == 1:
        return [checksum(v) for v in views]
    bounds = [n * k // parts for k in range(parts + 1)]
    futs = [
        HASH_POOL.submit(lambda lo, hi: [checksum(v) for v in views[lo:hi]], bounds[k], bounds[k + 1])
        for k in range(parts)
    ]
    return [cs for f in futs for cs in f.result()]
