"""Same-host reads of a store's blocks (`mread`, wire: transfer/mread_wire.py), the `UcxBlockServer` side.

A reader that mapped the store's shared segment asks for blocks by slot: the server pins them, answers
their offsets in the segment and their stored checksums, and unpins them on the reader's `mdone` (or its
endpoint's end, or the pin timeout); the reader copies the bytes itself.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import numpy as np

from transfer.base import BlockHandler
from transfer.mread_wire import decode_request, encode_reply
from transfer.shared_segment import SharedSegment
from transfer.ucx_runtime import MAX_BLOCKS_PER_MESSAGE, _err, _Runtime, send_msg


def _offset_or_error(shared: SharedSegment, view: memoryview) -> int | str:
    try:
        return shared.offset_of(view)
    except ValueError as exc:
        return str(exc)


class MappedReads:
    """`UcxBlockServer`'s `mread` requests (a mixin over the server's handler, segment and counters)."""

    _handler: BlockHandler
    _shared: SharedSegment | None
    _pin_timeout_s: float
    _copying: dict[tuple[int, int], asyncio.Future[None]]
    inflight: int

    if TYPE_CHECKING:  # the server's own checks and handler calls

        def _check_caps(self, caps: Any, n: int) -> str: ...

        def _grant(self, blocks: list[list[int]], caps: Any) -> list[Any]: ...

        def _end_reads(self, slots: list[int]) -> None: ...

    def _offsets(self, views: list[memoryview]) -> list[int | str]:
        """Each view's offset in the shared segment, or why it has none (a handler's block elsewhere)."""
        assert self._shared is not None
        try:
            return list(self._shared.offsets_of(views))
        except ValueError:
            return [_offset_or_error(self._shared, v) for v in views]

    def _pin_mapped(
        self, rows: np.ndarray, caps: Any, began: list[int]
    ) -> tuple[np.ndarray, np.ndarray, list[list[Any]]]:
        """`begin_reads` of `rows` (uint64 (n, 3): slot, generation, nbytes), each slot begun appended to
        `began` at once (the caller ends them): (stored checksums, offsets in the shared segment, [[index,
        error], ...] of the blocks that cannot be read); checksum and offset are 0 where a block failed.

        Without capabilities a handler's `begin_reads_array` (optional, see `transfer.BlockHandler`) pins
        a batch that passes every check in a few array operations; otherwise (or when any block would
        fail) `begin_reads` says why per block."""
        assert self._shared is not None
        fast = getattr(self._handler, "begin_reads_array", None)
        got = fast(rows) if caps is None and fast is not None else None
        if got is not None:
            buffer, starts, stored = got
            began.extend(rows[:, 0].tolist())
            with contextlib.suppress(ValueError):  # not inside the segment: the loop below says so per block
                return stored, starts + np.uint64(self._shared.offset_of(buffer)), []
            grants: list[Any] = [
                (buffer[s : s + n], c)
                for s, n, c in zip(starts.tolist(), rows[:, 2].tolist(), stored.tolist(), strict=True)
            ]
        else:
            grants = self._grant(rows.tolist(), caps)
            began.extend(
                s for (s, _, _), g in zip(rows.tolist(), grants, strict=True) if not isinstance(g, Exception)
            )
        n = len(rows)
        stored, offsets, errors = np.zeros(n, np.uint64), np.zeros(n, np.uint64), []
        offs = iter(self._offsets([g[0] for g in grants if not isinstance(g, Exception)]))
        for i, ((_, _, nbytes), grant) in enumerate(zip(rows.tolist(), grants, strict=True)):
            if isinstance(grant, Exception):  # per-block result
                errors.append([i, _err(grant)])
                continue
            view, checksum = grant
            off = next(offs)
            if isinstance(off, str):
                errors.append([i, off])
            elif view.nbytes != nbytes:
                errors.append([i, f"block is {view.nbytes} B, request names {nbytes} B"])
            else:
                stored[i], offsets[i] = checksum, off
        return stored, offsets, errors

    async def _serve_mapped_read(self, ep: Any, rid: int, msg: dict[str, Any]) -> None:
        """`mread` (wire: transfer/mread_wire.py): pin the blocks, answer their offsets and checksums, unpin
        on `mdone`."""
        key = (id(ep), rid)
        caps = msg.get("c")
        try:
            rows = decode_request(msg.get("b"), MAX_BLOCKS_PER_MESSAGE)
            problem = self._check_caps(caps, len(rows))
        except ValueError as exc:
            problem = str(exc)
        if not problem and key in self._copying:
            problem = f"request id {rid} is already in flight on this endpoint"
        if problem:
            await send_msg(ep, {"id": rid, "ph": 0, "error": problem})
            return
        began: list[int] = []
        counted = 0
        self._copying[key] = asyncio.get_running_loop().create_future()
        try:
            stored, offsets, errors = self._pin_mapped(rows, caps, began)
            counted = len(began)
            self.inflight += counted
            ok = np.ones(len(rows), dtype=bool)
            ok[[i for i, _ in errors]] = False
            with _Runtime.get().waker.busy():
                await send_msg(ep, encode_reply(rid, ok, stored, offsets, errors))
            if began:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._copying[key], self._pin_timeout_s)
        finally:
            self._copying.pop(key, None)
            self.inflight -= counted
            self._end_reads(began)
