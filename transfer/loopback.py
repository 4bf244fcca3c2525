"""In-process transport (memcpy through the same `BlockHandler` protocol). For unit tests only."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

from transfer.base import (
    BlockHandler,
    BlockRead,
    BlockResult,
    BlockWrite,
    LinkEstimate,
    validate_batch,
)
from transfer.xxh3 import as_bytes_view, checksum

_registry: dict[str, BlockHandler] = {}
_registry_lock = threading.Lock()
_ports = itertools.count(1)


class LoopbackBlockServer:
    """Registers `handler` under the peer address `loopback:PORT` in this process."""

    def __init__(self, handler: BlockHandler) -> None:
        self._handler = handler
        self.port = 0

    @property
    def address(self) -> str:
        return f"loopback:{self.port}"

    def start(self) -> int:
        with _registry_lock:
            self.port = next(_ports)
            _registry[self.address] = self._handler
        return self.port

    def stop(self) -> None:
        with _registry_lock:
            _registry.pop(self.address, None)


class LoopbackTransport:
    """`Transport` over `LoopbackBlockServer`s of this process: a plain memcpy per block."""

    def __init__(self) -> None:
        self._closed = False

    def _handler(self, peer: str) -> BlockHandler | None:
        with _registry_lock:
            return _registry.get(peer)

    def read_blocks(
        self, peer: str, reads: Sequence[BlockRead], out: Sequence[memoryview], *, timeout_s: float
    ) -> list[BlockResult]:
        validate_batch(len(reads), len(out))
        handler = self._handler(peer)
        if handler is None or self._closed:
            return [BlockResult(False, error=f"peer {peer} unreachable")] * len(reads)
        results = []
        for r, buf in zip(reads, out, strict=True):
            dst = as_bytes_view(buf)
            if dst.nbytes != r.nbytes:
                results.append(BlockResult(False, error=f"output buffer is {dst.nbytes} B, not {r.nbytes}"))
                continue
            try:
                src, stored = handler.begin_read(r.slot, r.generation, r.nbytes, r.capability, r.expiry_ms)
            except Exception as exc:  # noqa: BLE001 - per-block result
                results.append(BlockResult(False, error=f"{type(exc).__name__}: {exc}"))
                continue
            try:
                dst[:] = src
            finally:
                handler.end_read(r.slot)
            got = checksum(dst)
            if got != stored:
                results.append(
                    BlockResult(False, got, f"checksum mismatch: got {got:#x}, expected {stored:#x}")
                )
            else:
                results.append(BlockResult(True, got))
        return results

    def write_blocks(self, peer: str, writes: Sequence[BlockWrite], *, timeout_s: float) -> list[BlockResult]:
        handler = self._handler(peer)
        if handler is None or self._closed:
            return [BlockResult(False, error=f"peer {peer} unreachable")] * len(writes)
        results = []
        for w in writes:
            src = as_bytes_view(w.data)
            try:
                dst = handler.begin_write(w.slot, w.generation, src.nbytes, w.capability, w.expiry_ms)
            except Exception as exc:  # noqa: BLE001 - per-block result
                results.append(BlockResult(False, error=f"{type(exc).__name__}: {exc}"))
                continue
            ok = False
            try:
                dst[:] = src
                ok = True
            finally:
                try:
                    handler.end_write(w.slot, w.generation, w.checksum, ok)
                except Exception as exc:  # noqa: BLE001 - per-block result
                    results.append(BlockResult(False, error=f"{type(exc).__name__}: {exc}"))
                else:
                    results.append(BlockResult(True, w.checksum))
        return results

    def link(self, peer: str) -> LinkEstimate:
        return LinkEstimate(1e-6, 10e9, 1)

    def close(self) -> None:
        self._closed = True
