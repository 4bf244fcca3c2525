"""Same-host reads by one copy: a store's segment in a sealed memfd that local readers map read-only.

UCX moves shared-memory rendezvous data through its sysv FIFO when error handling is on (two copies in
8 KiB fragments; raw ucxx reaches a quarter to a third of memcpy here), and its single-copy CMA transport
needs `UCX_CMA_MEMORY_INVALIDATE`, which UCX documents as unsupported. kvpool's same-host path is its own:

- the store allocates its segment as a `memfd` (sealed against shrinking and growing, so a mapping never
  faults with SIGBUS) and advertises `SegmentDescriptor` (pid, fd, inode, size, boot id) in its ping reply;
- a reader on the same host (same boot id and pid namespace, allowed to open `/proc/<pid>/fd/<fd>`: the
  access that also reads the store's `/proc/<pid>/environ`, see Trust) maps it read-only once per store;
- a reader that also maps the store's slot state (transfer/slot_state.py) copies first and checks the
  slot's generation before and after, without a message; any block that fails that, or every block when
  the slot state is not mapped, goes through the store over UCX (`mread`): it checks generations and
  capabilities and pins the slots (`begin_read`), answers their offsets and checksums, and unpins
  (`end_read`) when the reader says it has copied them (or its endpoint dies, or the pin timeout passes);
  the reader copies and verifies the xxh3 of what it copied, so even a pin that expired under it can
  only give a checksum error.

Like UCX's xpmem/knem single-copy transports, but under generation checks or the store's pins: blocks
are read, never written, through the mapping (writes stay two-sided messages the store checks). Linux
only; anything missing
(another host, another pid namespace, no permission, a replaced fd) leaves the reader on UCX.

Trust: a mapping shows the whole segment, so a process that maps it could read slots it holds no read
capability for. Capabilities guard the UCX port against network peers; a process that can open the
memfd (the store's uid, mode 0400, or CAP_SYS_PTRACE) can equally read the cluster secret file and sign
its own capabilities, so the trust boundary is unchanged; still, a store that checks capabilities does
not share its slot state, so every read shows its capability to it. `kvpool store --no-share-segment`
turns sharing off.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from transfer.coalesce import span
from transfer.xxh3 import KERNELS, address_of, addresses_of, checksum

log = logging.getLogger(__name__)

_SEALS = sum(getattr(fcntl, n, 0) for n in ("F_SEAL_SHRINK", "F_SEAL_GROW", "F_SEAL_SEAL"))  # 0 off Linux
RUN_MAX_BYTES = 2 << 20
"""Without the C loops (`KERNELS`): adjacent blocks are copied together up to this many bytes, then hashed."""
_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def boot_id() -> str:
    """This host's boot id (`/proc/sys/kernel/random/boot_id`); empty when unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class SegmentDescriptor:
    """How a same-host reader finds a store's segment: `/proc/<pid>/fd/<fd>`, checked by inode and size."""

    pid: int
    fd: int
    dev: int
    ino: int
    nbytes: int
    boot: str

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, value: Any) -> SegmentDescriptor:
        """Raises `ValueError` for anything but a well-formed descriptor."""
        if not isinstance(value, dict) or set(value) != {"pid", "fd", "dev", "ino", "nbytes", "boot"}:
            raise ValueError("malformed segment descriptor")
        ints = {k: value[k] for k in ("pid", "fd", "dev", "ino", "nbytes")}
        if not all(isinstance(v, int) and v >= 0 for v in ints.values()) or not isinstance(
            value["boot"], str
        ):
            raise ValueError("malformed segment descriptor")
        return cls(**ints, boot=value["boot"])


class SharedSegment:
    """`nbytes` of zeroed memory in a sealed memfd, mapped read-write here (the store's side).

    `array` is the uint8 view of the whole segment; `descriptor` tells same-host readers how to map it.
    Lives as long as the process (the fd must stay open for readers to find it). Raises `OSError` where
    memfd or sealing is unavailable (off Linux)."""

    def __init__(self, nbytes: int, name: str = "kvpool-segment") -> None:
        self.nbytes = nbytes
        if not _SEALS or not hasattr(os, "memfd_create"):
            raise OSError("memfd with seals is Linux only")
        self._fd = os.memfd_create(f"{name}-{secrets.token_hex(8)}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, nbytes)
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, _SEALS)
            os.fchmod(self._fd, 0o400)  # reopened through /proc: read-only, owner only
            self._map = mmap.mmap(self._fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self._fd)
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.base_address = int(self.array.ctypes.data)
        st = os.fstat(self._fd)
        self.descriptor = SegmentDescriptor(os.getpid(), self._fd, st.st_dev, st.st_ino, nbytes, boot_id())

    def offset_of(self, view: memoryview) -> int:
        """Offset of `view` in the segment; raises `ValueError` when it is not inside it."""
        off = address_of(view) - self.base_address
        if off < 0 or off + view.nbytes > self.nbytes:
            raise ValueError("buffer is not in the shared segment")
        return off

    def offsets_of(self, views: Sequence[memoryview]) -> list[int]:
        """`offset_of` of each view; raises `ValueError` when one is not inside the segment."""
        out = [a - self.base_address for a in addresses_of(views)]
        if any(off < 0 or off + view.nbytes > self.nbytes for off, view in zip(out, views, strict=True)):
            raise ValueError("buffer is not in the shared segment")
        return out


def _verdict(cs: int, sent: int) -> tuple[bool, int, str]:
    ok = cs == sent
    return ok, cs, "" if ok else f"checksum mismatch: got {cs:#x}, store sent {sent:#x}"


class StopFlag:
    """Like `threading.Event` without waiting: set once, seen by Python code and by the C copy loop
    (which reads `byte[0]` between blocks)."""

    def __init__(self) -> None:
        self.byte = np.zeros(1, dtype=np.uint8)

    def set(self) -> None:
        self.byte[0] = 1

    def is_set(self) -> bool:
        return bool(self.byte[0])


class SegmentMapping:
    """A read-only mapping of a same-host store's segment (the reader's side); `attach` makes one.

    `copy_verify` may run on several threads at once; `close` unmaps once no copy is running."""

    def __init__(self, desc: SegmentDescriptor, address: int) -> None:
        self.descriptor = desc
        self.address = address
        self._words = np.ctypeslib.as_array((ctypes.c_uint64 * (desc.nbytes // 8)).from_address(address))
        self._lock = threading.Lock()
        self._users = 0
        self._closed = False

    @classmethod
    def attach(cls, desc: SegmentDescriptor) -> SegmentMapping:
        """Map `desc` read-only. Raises `OSError` (another host, no access, a different file: the inode,
        size or seals do not match)."""
        if not desc.boot or desc.boot != boot_id():
            raise OSError("the store runs on another host")
        fd = os.open(f"/proc/{desc.pid}/fd/{desc.fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (desc.dev, desc.ino) or st.st_size < desc.nbytes:
                raise OSError("the store's segment file is not the one it advertised")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise OSError("the store's segment is not sealed against resizing")
            addr = _mmap(None, desc.nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), "mmap of the store's segment failed")
        finally:
            os.close(fd)
        return cls(desc, int(addr))

    def copy_verify(
        self, parts: Sequence[tuple[memoryview, int, int]], stop: StopFlag | None = None
    ) -> list[tuple[bool, int, str]]:
        """For each (destination, segment offset, expected xxh3): copy the block into the destination
        (`destination.nbytes` bytes) and compare the xxh3 of the copy. One (ok, checksum, error) each.

        Once `stop` is set no further block is copied (those parts fail). The GIL is released while
        bytes move and are hashed: where `KERNELS` is built, one C loop copies each block in cache-sized
        pieces and hashes each piece right after it lands; else runs of parts adjacent on both sides are
        copied by numpy as one and then hashed block by block."""
        with self.hold() as live:
            if not live:
                return [(False, 0, "segment mapping closed")] * len(parts)
            out: list[tuple[bool, int, str]] = [(False, 0, "read abandoned")] * len(parts)
            if KERNELS is not None:
                self._copy_kernel(parts, out, stop or StopFlag())
                return out
            for lo, hi in self._runs(parts, out):
                if stop is not None and stop.is_set():
                    break
                self._copy_run(parts[lo][0], parts[lo][1], sum(p[0].nbytes for p in parts[lo:hi]))
                for k in range(lo, hi):
                    out[k] = _verdict(checksum(parts[k][0]), parts[k][2])
            return out

    def owner_alive(self) -> bool:
        """The store process still holds the segment (its fd still names that inode): ~5 us. A reader
        that copies without asking checks it, since the mapping outlives a killed store."""
        d = self.descriptor
        try:
            st = os.stat(f"/proc/{d.pid}/fd/{d.fd}")
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == (d.dev, d.ino)

    @contextlib.contextmanager
    def hold(self) -> Iterator[bool]:
        """Keep the mapping mapped inside the `with` block (a `close` meanwhile unmaps at its end); yields
        False, and nothing may be read through `address`, when it is closed already."""
        with self._lock:
            live = not self._closed
            self._users += live
        try:
            yield live
        finally:
            if live:
                with self._lock:
                    self._users -= 1
                    if self._closed and self._users == 0:
                        self._unmap()

    def _copy_kernel(
        self, parts: Sequence[tuple[memoryview, int, int]], out: list[tuple[bool, int, str]], stop: StopFlag
    ) -> None:
        where = [
            k for k, (dst, off, _) in enumerate(parts) if 0 <= off <= self.descriptor.nbytes - dst.nbytes
        ]
        for k in set(range(len(parts))).difference(where):
            out[k] = (False, 0, f"offset {parts[k][1]} outside the store's segment")
        if not where:
            return
        got = np.zeros(len(where), dtype=np.uint64)
        assert KERNELS is not None
        done = KERNELS.copy_verify(
            self.address,
            self.descriptor.nbytes,
            np.array([parts[k][1] for k in where], dtype=np.int64),
            [parts[k][0] for k in where],
            got,
            stop.byte,
        )
        for k, cs in zip(where[:done], got[:done].tolist(), strict=True):
            out[k] = _verdict(cs, parts[k][2])

    def _runs(
        self, parts: Sequence[tuple[memoryview, int, int]], out: list[tuple[bool, int, str]]
    ) -> list[tuple[int, int]]:
        """[lo, hi) ranges of in-bounds parts whose destinations and sources both follow on, at most
        `RUN_MAX_BYTES` each; out-of-bounds parts get their error in `out` and are in no range."""
        runs: list[tuple[int, int]] = []
        end_dst = end_off = -1
        run_bytes = 0
        for k, (dst, off, _) in enumerate(parts):
            if off < 0 or off + dst.nbytes > self.descriptor.nbytes:
                out[k] = (False, 0, f"offset {off} outside the store's segment")
                end_dst = -1
                continue
            addr = address_of(dst)
            if runs and addr == end_dst and off == end_off and run_bytes + dst.nbytes <= RUN_MAX_BYTES:
                runs[-1] = (runs[-1][0], k + 1)
                run_bytes += dst.nbytes
            else:
                runs.append((k, k + 1))
                run_bytes = dst.nbytes
            end_dst, end_off = addr + dst.nbytes, off + dst.nbytes
        return runs

    def _copy_run(self, first: memoryview, off: int, nbytes: int) -> None:
        """Copy `nbytes` from segment offset `off` to where `first` starts (the run's buffers are adjacent).

        Whole 8-byte words move through a numpy loop (`np.positive` on uint64 is the identity): glibc's
        memcpy uses `rep movsb` for 2 KiB-1 MiB copies, measured 4x slower here (2.4 vs 9-10 GB/s, 64 KiB
        blocks) when the source is a shmem mapping's 4 KiB pages."""
        dst = span(first, nbytes)
        if off % 8 == 0 and nbytes % 8 == 0:
            np.positive(self._words[off // 8 : (off + nbytes) // 8], out=np.frombuffer(dst, dtype=np.uint64))
        else:
            ctypes.memmove(address_of(dst), self.address + off, nbytes)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._users == 0:
                self._unmap()

    def _unmap(self) -> None:
        self._words = np.zeros(0, dtype=np.uint64)
        _munmap(self.address, self.descriptor.nbytes)
        self.address = 0
