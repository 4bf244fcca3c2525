"""A segment: one preallocated CPU buffer cut into fixed-size slots (pinned host memory under CUDA)."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import numpy as np

from kvpool.errors import InvalidArgument
from transfer.shared_segment import SharedSegment

log = logging.getLogger(__name__)


def _cuda_present() -> bool:
    """True when torch is installed and sees a GPU (torch is imported only when a GPU device exists)."""
    if importlib.util.find_spec("torch") is None or not os.path.exists("/dev/nvidiactl"):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _shared(nbytes: int) -> SharedSegment | None:
    try:
        return SharedSegment(nbytes)
    except OSError as exc:
        log.warning("segment not shared with same-host readers (memfd unavailable: %s)", exc)
        return None


class Segment:
    """`num_slots` slots of `block_nbytes` bytes in one contiguous buffer. The caller owns the segment.

    `share`: allocate it as a sealed memfd that same-host readers map read-only (`transfer.shared_segment`;
    `shared` is then set); not with pinned memory, and silently private where memfd is unavailable."""

    def __init__(
        self, size_bytes: int, block_nbytes: int, *, pin_memory: str = "auto", share: bool = False
    ) -> None:
        if block_nbytes <= 0 or size_bytes < block_nbytes:
            raise InvalidArgument(f"segment of {size_bytes} B cannot hold one {block_nbytes} B block")
        self.block_nbytes = block_nbytes
        self.num_slots = size_bytes // block_nbytes
        self.nbytes = self.num_slots * block_nbytes
        self.pinned = False
        self._keepalive: Any = None
        self.shared: SharedSegment | None = None
        pin = pin_memory == "on" or (pin_memory == "auto" and _cuda_present())
        if pin:
            import torch

            tensor = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
            self._keepalive = tensor
            self.array = tensor.numpy()
            self.pinned = True
            if share:
                log.info(
                    "segment pinned for CUDA: not shared, same-host readers use UCX (--pin-memory off shares)"
                )
        elif share and (shared := _shared(self.nbytes)) is not None:
            self.shared = shared
            self.array = shared.array
        else:
            self.array = np.zeros(self.nbytes, dtype=np.uint8)  # pages are mapped on first touch
        self._view = memoryview(self.array)  # type: ignore[arg-type]
        # The base address is logged for fault injection (tests/faults corrupt committed bytes through
        # /proc/<pid>/mem, as a bit flip in RAM would, to check every read detects it).
        log.info(
            "segment: %d slots x %d B = %d MiB%s at %#x",
            self.num_slots,
            block_nbytes,
            self.nbytes >> 20,
            " (pinned)" if self.pinned else " (shared with same-host readers)" if self.shared else "",
            self.array.ctypes.data,
        )

    @property
    def buffer(self) -> memoryview:
        """All slots' bytes, writable (slot k starts at k * `block_nbytes`)."""
        return self._view

    def slot_view(self, slot: int) -> memoryview:
        """The writable bytes of `slot` (no copy); the caller checked the range."""
        start = slot * self.block_nbytes
        return self._view[start : start + self.block_nbytes]
