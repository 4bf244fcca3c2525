"""One UCX read or write message of `UcxTransport` (protocol: transfer/ucx.py): the request naming its runs of
adjacent buffers, the bytes moving as tagged messages, and for reads the checksums verified as they land
(large messages at once on a hashing thread, small ones together at the end)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transfer.base import BlockRead, BlockWrite, TransferTimedOut
from transfer.coalesce import adjacent_groups, client_plan
from transfer.ucx_conn import Conn, PeerRefused
from transfer.ucx_deadline import Expiry, drain_reply_soon, drain_soon, until
from transfer.ucx_runtime import _err, _tag, send_msg
from transfer.ucx_wait import ProgressWaker, cancel_recv, post_tag_recv, tag_recv, tag_send
from transfer.xxh3 import HASH_POOL, INLINE_MAX_BYTES, checksum_many


def _verify(
    views: Sequence[memoryview], got: Sequence[tuple[int, int]]
) -> list[tuple[int, tuple[bool, int, str]]]:
    """Per received block: (index, result) after comparing its xxh3 with the checksum the peer sent."""
    out = []
    for (i, sent), cs in zip(got, checksum_many([views[i] for i, _ in got]), strict=True):
        ok = cs == sent
        out.append((i, (ok, cs, "" if ok else f"checksum mismatch: got {cs:#x}, peer sent {sent:#x}")))
    return out


_VERIFY_EARLY_BYTES = 1 << 20
"""A received message at least this large is verified as soon as it lands (smaller ones together)."""


def _covered(views: Sequence[memoryview], first: int, nbytes: int) -> list[int]:
    """Indices of the consecutive `views` from `first` that a message of `nbytes` bytes fills."""
    out: list[int] = []
    n = 0
    while n < nbytes and first + len(out) < len(views):
        out.append(first + len(out))
        n += views[out[-1]].nbytes
    return out


async def _request_runs(
    conn: Conn, msg: dict[str, Any], views: Sequence[memoryview]
) -> tuple[list[Any], list[tuple[int, memoryview]]]:
    """Send a read or write request naming its runs of adjacent buffers; (the per-block header of the
    reply, one (tag index, buffer) per message to post: `transfer.coalesce`)."""
    groups = adjacent_groups(views)
    if len(groups) < len(views):  # some buffers adjacent: runs may move as one message each
        msg["g"] = groups
    return _plan(await conn.request(msg), views, groups)


@dataclass
class Late:
    """How a read behaves at its deadline (`transfer.ucx_deadline`): `expiry` fires then; a peer silent for
    `stall_s` while a drain waits is lost (`on_stall(why)`)."""

    expiry: Expiry
    stall_s: float
    on_stall: Callable[[str], None]


async def read_message(
    conn: Conn,
    rid: int,
    reads: Sequence[BlockRead],
    views: Sequence[memoryview],
    idxs: list[int],
    results: list[tuple[bool, int, str]],
    waker: ProgressWaker,
    late: Late | None = None,
) -> None:
    """Read blocks `idxs` of `reads` into their `views` as request `rid` over `conn`; each one's
    (ok, checksum, error) into `results`.

    `late`: when its expiry fires, the receives no message matched yet are withdrawn and their blocks
    fail with `TransferTimedOut` (their messages are drained); the others land and count. Raises
    `TransferTimedOut` when the store had not answered by then, `PeerRefused` when it refused."""
    msg: dict[str, Any] = {
        "op": "read",
        "id": rid,
        "b": [[reads[i].slot, reads[i].generation, reads[i].nbytes] for i in idxs],
    }
    if any(reads[i].capability for i in idxs):
        msg["c"] = [[reads[i].expiry_ms, bytes(reads[i].capability)] for i in idxs]
    local = [views[i] for i in idxs]
    if late is None or not waker.installed:
        header, plan = await _request_runs(conn, msg, local)
        await _land_all(conn, rid, views, idxs, results, waker, header, plan, {})
        return
    groups = adjacent_groups(local)
    if len(groups) < len(local):
        msg["g"] = groups
    fut = conn.expect(rid, 0)
    await send_msg(conn.ep, msg)
    answered, reply = await until(fut, late.expiry)
    if not answered:  # what the store sends once it answers is drained

        def messages_of(reply: dict[str, Any]) -> list[tuple[int, int]]:
            _, plan = _plan(reply, local, groups)
            return [(_tag(rid, j), buf.nbytes) for j, buf in plan]

        drain_reply_soon(conn, fut, messages_of, waker, late.stall_s, late.on_stall)
        raise TransferTimedOut("deadline passed before the store answered")
    if "error" in reply:
        raise PeerRefused(f"peer refused the request: {reply['error']}")
    header, plan = _plan(reply, local, groups)
    posted = {j: post_tag_recv(conn.ep, buf, _tag(rid, j)) for j, buf in plan}
    withdrawn: set[int] = set()

    def withdraw() -> None:
        withdrawn.update(j for j, req in posted.items() if cancel_recv(req))
        drain_soon(
            conn,
            [(_tag(rid, j), buf.nbytes) for j, buf in plan if j in withdrawn],
            waker,
            late.stall_s,
            late.on_stall,
        )

    late.expiry.on_fire(withdraw)
    await _land_all(conn, rid, views, idxs, results, waker, header, plan, posted, withdrawn)


def _plan(
    reply: dict[str, Any], local: Sequence[memoryview], groups: list[int]
) -> tuple[list[Any], list[tuple[int, memoryview]]]:
    header: list[Any] = reply["r"]
    try:
        return header, client_plan(reply.get("m"), [bool(h[0]) for h in header], local, groups)
    except ValueError as exc:  # the peer moves what it planned: the connection cannot be reused
        raise PeerRefused(f"bad reply: {exc}", in_flight=True) from None


async def _land_all(
    conn: Conn,
    rid: int,
    views: Sequence[memoryview],
    idxs: list[int],
    results: list[tuple[bool, int, str]],
    waker: ProgressWaker,
    header: list[Any],
    plan: list[tuple[int, memoryview]],
    posted: dict[int, Any],
    withdrawn: set[int] | None = None,
) -> None:
    """Wait for the messages of `plan` (posted receives, else received here), verifying their blocks
    against the checksums of `header`; a withdrawn message's blocks fail as timed out."""
    local = [views[i] for i in idxs]
    sent: dict[int, int] = {}  # local index -> checksum the peer sent
    for j, (ok, cs, err) in enumerate(header):
        results[idxs[j]] = (bool(ok), int(cs), str(err))
        if ok:
            sent[j] = int(cs)
    small: list[tuple[int, int]] = []

    async def land(j: int, buf: memoryview) -> list[tuple[int, tuple[bool, int, str]]]:
        covered = _covered(local, j, buf.nbytes)
        req = posted.get(j)
        if req is None:
            await tag_recv(conn.ep, buf, _tag(rid, j), waker)
        else:
            try:
                await waker.wait(req)
            except Exception:
                if withdrawn is None or j not in withdrawn:
                    raise
                why = _err(TransferTimedOut("deadline passed while the store was answering"))
                return [(idxs[k], (False, 0, why)) for k in covered if k in sent]
            finally:
                conn.ep._finished_recv_count += 1  # noqa: SLF001 - ucxx's counters (see ucx_wait)
        conn.heard()
        got = [(idxs[k], sent[k]) for k in covered if k in sent]
        if buf.nbytes < _VERIFY_EARLY_BYTES:  # not worth a job of its own: verified at the end
            small.extend(got)
            return []
        # Verify a large message's blocks on a hashing thread (GIL released: transfer.xxh3) as soon as
        # it lands, while later ones still move; shielded: a deadline never leaves it half-done.
        return await asyncio.shield(asyncio.wrap_future(HASH_POOL.submit(_verify, views, got)))

    landed = await asyncio.gather(*(land(j, buf) for j, buf in plan))
    if small:
        if sum(views[i].nbytes for i, _ in small) <= INLINE_MAX_BYTES:  # in place: no thread hop
            landed.append(_verify(views, small))
        else:
            landed.append(await asyncio.shield(asyncio.wrap_future(HASH_POOL.submit(_verify, views, small))))
    for verified in landed:
        for i, res in verified:
            results[i] = res


async def write_message(
    conn: Conn,
    rid: int,
    writes: Sequence[BlockWrite],
    views: Sequence[memoryview],
    idxs: list[int],
    results: list[tuple[bool, int, str]],
    waker: ProgressWaker,
) -> None:
    """Write blocks `idxs` of `writes` from their `views` as request `rid` over `conn`; each one's
    (ok, checksum, error) into `results` once the peer ended the writes."""
    final = conn.expect(rid, 1)
    msg = {
        "op": "write",
        "id": rid,
        "b": [[writes[i].slot, writes[i].generation, views[i].nbytes, writes[i].checksum] for i in idxs],
    }
    if any(writes[i].capability for i in idxs):
        msg["c"] = [[writes[i].expiry_ms, bytes(writes[i].capability)] for i in idxs]
    try:
        _, plan = await _request_runs(conn, msg, [views[i] for i in idxs])
    except PeerRefused:
        conn.forget(rid, 1)  # no final answer comes for a refused write
        raise
    await asyncio.gather(*(tag_send(conn.ep, buf, _tag(rid, j), waker) for j, buf in plan))
    for j, (ok, cs, err) in enumerate((await final)["r"]):
        results[idxs[j]] = (bool(ok), int(cs), str(err))
