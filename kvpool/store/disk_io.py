"""The disk tier's data file I/O: page-aligned, batched, off the caller's thread.

`DataFile` holds `blocks.data` open with `O_DIRECT` where the file system allows it (the page cache is
bypassed: a disk tier that filled the page cache would evict the memory the pool exists to use), else
buffered (one log line). Every transfer is a list of jobs `(offset, buffers)`: one `os.pwritev` /
`os.preadv` per job, run on a small thread pool (the calls release the GIL), so a batch of consecutive
slots is one system call per `CHUNK_NBYTES` (reads) or `WRITE_CHUNK_NBYTES` (writes) and several of them are in flight at once. Buffers are
page-aligned (`aligned_empty`: anonymous `mmap`, page-aligned by construction) and whole pages long.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

PAGE_NBYTES = mmap.PAGESIZE
CHUNK_NBYTES = 2 << 20
"""The most bytes one read moves: a 4 MiB batch of consecutive slots is 2 reads in flight at once, each
hashed on its thread while the other's I/O goes on (1 MiB pieces measured 0.64–0.84 of dd's 4 MiB reads
here, 2 MiB ones 0.84–0.87)."""
WRITE_CHUNK_NBYTES = 4 << 20
"""The most bytes one write moves (allocating direct writes to one file serialise on its inode: in
parallel they only add hand-offs)."""
IO_THREADS = 4
_IOV_MAX = 1024


def aligned_empty(nbytes: int) -> np.ndarray:
    """(nbytes,) uint8, page-aligned (an anonymous mapping; zero-filled), `nbytes` > 0."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def is_aligned(a: np.ndarray) -> bool:
    """Whether `a` starts on a page and each of its rows is whole pages (usable for direct I/O as is)."""
    row = a.strides[0] if a.ndim > 1 else a.nbytes
    return a.ctypes.data % PAGE_NBYTES == 0 and row % PAGE_NBYTES == 0 and a.flags.c_contiguous


def round_up(n: int, to: int = PAGE_NBYTES) -> int:
    return -(-n // to) * to


def chunk_runs(sorted_slots: np.ndarray, max_run: int) -> list[tuple[int, int]]:
    """[(a, b)]: positions of `sorted_slots` (int64, ascending, distinct) cut into runs of consecutive slot
    numbers, each at most `max_run` long."""
    n = len(sorted_slots)
    if n == 0:
        return []
    if int(sorted_slots[-1]) - int(sorted_slots[0]) == n - 1:  # one run (the common case)
        return [(x, min(x + max_run, n)) for x in range(0, n, max_run)]
    cuts = [0, *(np.flatnonzero(np.diff(sorted_slots) != 1) + 1).tolist(), n]
    out: list[tuple[int, int]] = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        out.extend((x, min(x + max_run, b)) for x in range(a, b, max_run))
    return out


Job = tuple[int, list[memoryview]]
"""(file offset in bytes, page-aligned buffers written or read back to back from it)."""


class DataFile:
    """`blocks.data` of `nbytes` bytes (sparse: the file system allocates on first write), created 0600.
    Raises `OSError` when it cannot be opened or sized."""

    def __init__(self, path: Path, nbytes: int, *, direct: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
        self.direct = False
        fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        self.fd = fd
        if os.fstat(fd).st_size < nbytes:
            os.ftruncate(fd, nbytes)
        if self.direct and not self._direct_works():
            os.close(fd)
            self.fd = os.open(path, flags, 0o600)
            self.direct = False
        if direct and not self.direct:
            log.warning("disk tier %s: the file system refuses O_DIRECT; using the page cache", path)
        self.pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvpool-disk")

    def _direct_works(self) -> bool:
        buf = aligned_empty(PAGE_NBYTES)
        try:
            os.preadv(self.fd, [buf.data], 0)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise
        return True

    def run(
        self, jobs: list[Job], *, write: bool, then: Callable[[int], None] | None = None
    ) -> list[OSError | None]:
        """Do every job (all writes or all reads), several at once; each job's error (None: done).
        `then(j)` runs on the job's thread after job j succeeded (e.g. hashing what it read, while the
        other jobs' I/O goes on); a single job runs on the caller's thread (no hand-off)."""
        fn = _write_all if write else _read_all

        def one(j: int) -> OSError | None:
            err = fn(self.fd, *jobs[j])
            if err is None and then is not None:
                then(j)
            return err

        if len(jobs) == 1:
            return [one(0)]
        return list(self.pool.map(one, range(len(jobs))))

    def sync(self) -> OSError | None:
        try:
            os.fdatasync(self.fd)
        except OSError as exc:
            return exc
        return None

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        os.close(self.fd)


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs = bufs[1:]
    return [bufs[0][n:], *bufs[1:]] if bufs and n else bufs


def _write_all(fd: int, offset: int, bufs: list[memoryview]) -> OSError | None:
    try:
        while bufs:
            n = os.pwritev(fd, bufs[:_IOV_MAX], offset)
            if n == 0:
                return OSError(errno.ENOSPC, "short write")
            bufs, offset = _advance(bufs, n), offset + n
    except OSError as exc:
        return exc
    return None


def _read_all(fd: int, offset: int, bufs: list[memoryview]) -> OSError | None:
    try:
        while bufs:
            n = os.preadv(fd, bufs[:_IOV_MAX], offset)
            if n == 0:
                return OSError(errno.EIO, "read past the end of the data file")
            bufs, offset = _advance(bufs, n), offset + n
    except OSError as exc:
        return exc
    return None


def probe_alpha_beta(directory: Path, *, direct: bool, nbytes: int = 16 << 20) -> tuple[float, float]:
    """(α seconds, β seconds per byte) of reads from `directory`'s file system: the median time of a
    one-page read is α, the median of `nbytes` reads gives β = (t - α) / bytes. Writes a scratch file
    (removed after; 0600). Raises `OSError`."""
    path = directory / "probe.tmp"
    f = DataFile(path, nbytes, direct=direct)
    try:
        buf = aligned_empty(nbytes)
        buf[:] = 0x5A
        jobs: list[Job] = [(a, [buf[a : a + CHUNK_NBYTES].data]) for a in range(0, nbytes, CHUNK_NBYTES)]
        for err in [*f.run(jobs, write=True), f.sync()]:
            if err is not None:
                raise err
        small, big = [], []
        for k in range(9):
            t0 = time.perf_counter()
            err = f.run(
                [((k * 97 % (nbytes // PAGE_NBYTES)) * PAGE_NBYTES, [buf[:PAGE_NBYTES].data])],
                write=False,
            )[0]
            small.append(time.perf_counter() - t0)
            if err is not None:
                raise err
        for _ in range(3):
            t0 = time.perf_counter()
            errs = f.run(jobs, write=False)
            big.append(time.perf_counter() - t0)
            if any(errs):
                raise next(e for e in errs if e is not None)
        alpha = statistics.median(small)
        return alpha, max(statistics.median(big) - alpha, 0.0) / nbytes
    finally:
        f.close()
        path.unlink(missing_ok=True)


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"{errno.errorcode.get(exc.errno, exc.errno)} ({os.strerror(exc.errno)})"
    return str(exc)


def lock_directory(path: Path, error: type[Exception]) -> int:
    """The directory's `lock` file, held with `flock` (the pid written in it) until the fd is closed.
    Raises `error` (one line with the path) when it cannot be created or another process holds it."""
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise error(f"disk tier {path}: not writable: {describe(exc)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise error(f"disk tier {path}: held by another live store (pid {holder})") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise error(f"disk tier {path}: not writable: {describe(exc)}") from None
    return fd
