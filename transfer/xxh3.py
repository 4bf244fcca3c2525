"""Block checksums: xxh3_64 of a block's bytes, computed without holding the GIL.

The `xxhash` binding holds the GIL while it hashes (python-xxhash 3.x), so "hashing on a helper thread"
only blocked the UCX loop thread and every other hasher: two threads hashing 256 MiB each took as long as
one doing both (measured here: 40 ms either way). The binding's extension module exports the C function
`XXH3_64bits(const void*, size_t)`; called through `ctypes` (which releases the GIL around foreign calls)
it computes the identical value while other threads run: two threads, 20 ms. Small buffers keep the
binding (a ctypes call costs ~1 us more); where the symbol is missing the binding is used for all sizes.

Batches (`checksum_many`, `checksums`, `addresses_of`, and the same-host copy in `shared_segment`) run in
one call of the C loops of `transfer/_kernels.c` (`KERNELS`) where the optional extension was built: one
ctypes call per block still takes the GIL back per block, and threads hashing 64 KiB blocks spent their
time handing it to each other. Without the extension the same work runs block by block. Those loops, and
`checksum` of large buffers, use the extension's AVX2 build of XXH3 where the CPU has AVX2 (`SIMD`; the
binding is built for SSE2 only: 21 against 37 GB/s on cache-resident bytes here, which is what the
same-host copy hashes), after checking that it returns the binding's values.

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

    `NUM_HASH_THREADS` threads, started at import from the importing thread (a thread inherits its
    creator's niceness: they run at the importer's priority whichever thread hashes first). A child made by `fork` gets a fresh pool (threads do not survive a fork: the
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


_PROBE = b"kvpool xxh3 probe" * 5000


def _load_xxh3() -> tuple[Any, Any]:
    """(XXH3_64bits through ctypes or None, the binding's extension library or None)."""
    try:
        ext = ctypes.CDLL(importlib.import_module("xxhash._xxhash").__file__)  # the binding's C extension
        fn = ext.XXH3_64bits
    except (ImportError, OSError, AttributeError) as exc:
        log.info("xxh3 without the GIL released (%s): hashing threads serialise", exc)
        return None, None
    fn.restype = ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    if fn(_PROBE, len(_PROBE)) != xxhash.xxh3_64_intdigest(_PROBE):  # never trust a symbol blindly
        log.warning("the exported XXH3_64bits disagrees with xxhash's binding; not using it")
        return None, None
    return fn, ext


_XXH3, _EXT = _load_xxh3()
GIL_FREE = _XXH3 is not None
"""Whether large buffers are hashed with the GIL released (see the module docstring)."""


_STREAM_FNS = (
    "XXH3_createState",
    "XXH3_freeState",
    "XXH3_64bits_reset",
    "XXH3_64bits_update",
    "XXH3_64bits_digest",
)


class Kernels:
    """The C loops of `transfer/_kernels.c` (built by setup.py where a C compiler is found), bound to XXH3:
    the extension's AVX2 build where the CPU has AVX2 (`simd` "avx2"), else the functions of the `xxhash`
    binding (`simd` "binding"). Each call runs a whole batch with the GIL released."""

    def __init__(self, module: Any, ext: Any, *, avx2: bool = True) -> None:
        self._module = module
        built = module.xxh3_avx2() if avx2 and hasattr(module, "xxh3_avx2") else None
        if built is not None:
            self._xxh3, self._stream = int(built[0]), tuple(int(a) for a in built[1:])
            self.simd = "avx2"
        else:
            self._xxh3 = int(ctypes.cast(ext.XXH3_64bits, ctypes.c_void_p).value or 0)
            self._stream = tuple(
                int(ctypes.cast(getattr(ext, name), ctypes.c_void_p).value or 0) for name in _STREAM_FNS
            )
            self.simd = "binding"

    @property
    def xxh3_address(self) -> int:
        """The address of the `XXH3_64bits(const void *, size_t)` these loops call."""
        return self._xxh3

    def copy_verify(
        self,
        src_base: int,
        src_nbytes: int,
        offsets: np.ndarray,
        dsts: Sequence[Buffer],
        got: np.ndarray,
        stop: np.ndarray,
    ) -> int:
        """For each destination (a writable C-contiguous buffer) in order, until `stop[0]` (uint8) is
        non-zero: copy its length in bytes from `src_base` + `offsets[k]` (int64) into it and set `got[k]`
        (uint64) to the xxh3 of the copy. Returns the number of blocks done. Raises `ValueError` for a
        block outside [0, `src_nbytes`) (nothing is copied then) or an unusable buffer."""
        return int(self._module.copy_verify(self._stream, src_base, src_nbytes, offsets, dsts, got, stop))

    def addresses(self, buffers: Sequence[Buffer], out: np.ndarray) -> None:
        """`out[k]` (int64) = the address of the first byte of `buffers[k]` (C-contiguous)."""
        self._module.addresses(buffers, out)

    def hash_many(self, buffers: Sequence[Buffer] | np.ndarray, got: np.ndarray) -> None:
        """`got[k]` (uint64) = xxh3 of the bytes of `buffers[k]` (C-contiguous; `ValueError` otherwise)."""
        self._module.hash_many(self._xxh3, buffers, got)


_PROBE_LENGTHS = (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 8191, 8192, 65537)
"""Lengths that take each of XXH3's code paths (short inputs, mid-size, the long loop, its stripes and tail)."""


def _agrees(kernels: Kernels) -> bool:
    """Whether `kernels` hash (one call per block and copied in pieces) and locate exactly as the binding."""
    probe = np.frombuffer(_PROBE, dtype=np.uint8)
    bufs = [probe[:n] for n in _PROBE_LENGTHS] + [probe]
    want = [xxhash.xxh3_64_intdigest(b.tobytes()) for b in bufs]
    got = np.zeros(len(bufs), dtype=np.uint64)
    kernels.hash_many(bufs, got)
    if got.tolist() != want:
        return False
    where = np.zeros(1, dtype=np.int64)
    kernels.addresses([probe], where)
    dsts = [np.zeros(b.nbytes, dtype=np.uint8) for b in bufs]
    offsets = np.zeros(len(bufs), dtype=np.int64)
    got[:] = 0
    kernels.copy_verify(probe.ctypes.data, probe.nbytes, offsets, dsts, got, np.zeros(1, dtype=np.uint8))
    copied = all(d.tobytes() == b.tobytes() for d, b in zip(dsts, bufs, strict=True))
    return int(where[0]) == probe.ctypes.data and got.tolist() == want and copied


def _load_kernels() -> Kernels | None:
    if _EXT is None:
        return None
    try:
        module = importlib.import_module("transfer._kernels")
        for avx2 in (True, False):  # the AVX2 build only where it agrees with the binding
            kernels = Kernels(module, _EXT, avx2=avx2)
            if _agrees(kernels):
                return kernels
            log.warning(
                "transfer kernels (%s XXH3) disagree with xxhash's binding; not using them", kernels.simd
            )
            if kernels.simd == "binding":
                break
    except (ImportError, AttributeError, ValueError, TypeError) as exc:
        log.info("transfer kernels not built (%s): copies and checksums loop in Python", exc)
    return None


KERNELS = _load_kernels()
"""The batch copy/hash loops, or None (no C compiler at install: `checksum` per block instead)."""
SIMD = KERNELS.simd if KERNELS is not None else "binding"
"""Which XXH3 build hashes batches: "avx2" (the extension's, `transfer/_xxh3_avx2.h`) or "binding"."""
if KERNELS is not None and KERNELS.simd == "avx2":  # large single buffers too (checked by `_agrees`)
    _XXH3 = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)(KERNELS.xxh3_address)

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


def addresses_of(views: Sequence[memoryview]) -> list[int]:
    """`address_of` of each view: one C call where `KERNELS` is built (~0.1 us a view instead of ~1-2).
    Raises `ValueError` for a view that is not C-contiguous."""
    if KERNELS is None or len(views) < 4:
        return [address_of(as_bytes_view(v)) for v in views]
    out = np.zeros(len(views), dtype=np.int64)
    KERNELS.addresses(views, out)
    return out.tolist()


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
        return checksum_many(views)
    bounds = [n * k // parts for k in range(parts + 1)]
    futs = [HASH_POOL.submit(checksum_many, views[bounds[k] : bounds[k + 1]]) for k in range(parts)]
    return [cs for f in futs for cs in f.result()]


def checksum_many(views: Sequence[Buffer] | np.ndarray) -> list[int]:
    """`checksum` of each buffer, in this thread: one GIL-free call for all of them where `KERNELS` is
    built (a per-buffer call takes the GIL back each time, and threads hashing small blocks then spend
    their time handing it to each other). Raises `ValueError` for a non-contiguous buffer."""
    if KERNELS is None or len(views) < 2:
        return [checksum(v) for v in views]
    got = np.zeros(len(views), dtype=np.uint64)
    KERNELS.hash_many(views, got)
    return got.tolist()
