"""Coalescing adjacent blocks into one UCX message.

A batch read names blocks that often sit in consecutive store slots (a chain published together gets
consecutive free slots) and land in consecutive rows of one destination buffer (a pull fills one run
buffer). Each UCX message costs tens of microseconds of Python and progress work whatever its size, so
moving such a run as one message instead of one per block is the difference between 0.2 and 0.7 GB/s for
64 KiB blocks over tcp (`kvpool bench transfer`). Protocol (per read request):

- the client sends `g`: the lengths of the runs of blocks whose destinations are adjacent in memory;
- the server merges, within one such run, consecutive blocks it can serve whose slot bytes are adjacent in
  its segment, and answers `m`: `[first index, count]` per merged run; it sends each merged run as one
  message tagged with its first index, every other served block alone, as before;
- the client checks each merged run against its own groups and posts one receive spanning the run.

Checksums stay per block: the reply carries each block's stored checksum and the reader verifies every
block after the bytes land, merged or not.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from transfer.xxh3 import address_of, addresses_of

MAX_RUN_BYTES = 64 << 20
"""A merged run never spans more than this."""


def span(first: memoryview, nbytes: int) -> memoryview:
    """A writable byte view of `nbytes` starting where `first` starts. The caller guarantees that the
    memory is one live allocation (the views it covers are held for as long as the span is used)."""
    return memoryview((ctypes.c_char * nbytes).from_address(address_of(first))).cast("B")


def adjacent_groups(views: Sequence[memoryview]) -> list[int]:
    """Lengths of the maximal runs of `views` where each starts exactly where the previous one ends."""
    groups: list[int] = []
    end = -1
    for v, a in zip(views, addresses_of(views), strict=True):
        if groups and a == end:
            groups[-1] += 1
        else:
            groups.append(1)
        end = a + v.nbytes
    return groups


def valid_groups(groups: object, n: int) -> bool:
    return (
        isinstance(groups, list) and all(isinstance(g, int) and g > 0 for g in groups) and sum(groups) == n  # type: ignore[arg-type]
    )


def merge(
    served: Sequence[tuple[int, memoryview]], groups: Sequence[int]
) -> list[tuple[int, int, memoryview]]:
    """Server side: `served` = (request index, slot bytes) of the blocks it will send, in index order;
    returns (first index, count, bytes) per message: runs of >= 2 consecutive indices in one client group
    whose slot bytes are adjacent become one message, every other block stays alone."""
    group_of: list[int] = []
    for g, size in enumerate(groups):
        group_of.extend([g] * size)
    out: list[tuple[int, int, memoryview]] = []
    run: list[tuple[int, memoryview]] = []

    def flush() -> None:
        if len(run) == 1:
            out.append((run[0][0], 1, run[0][1]))
        elif run:
            out.append((run[0][0], len(run), span(run[0][1], sum(v.nbytes for _, v in run))))
        run.clear()

    end = -1
    nbytes = 0
    for (i, v), a in zip(served, addresses_of([v for _, v in served]), strict=True):
        joins = (
            run
            and i == run[-1][0] + 1
            and group_of[i] == group_of[run[-1][0]]
            and a == end
            and nbytes + v.nbytes <= MAX_RUN_BYTES
        )
        if not joins:
            flush()
            nbytes = 0
        run.append((i, v))
        end, nbytes = a + v.nbytes, nbytes + v.nbytes
    flush()
    return out


def check_merged(merged: object, ok: Sequence[bool], groups: Sequence[int]) -> list[tuple[int, int]]:
    """Client side: the server's `m` as (first index, count) runs, each of >= 2 served blocks inside one
    of the client's groups; raises `ValueError` for anything else (the request then fails as a whole)."""
    if merged is None:
        return []
    if not isinstance(merged, list):
        raise ValueError("malformed merged runs")
    group_of: list[int] = []
    for g, size in enumerate(groups):
        group_of.extend([g] * size)
    runs: list[tuple[int, int]] = []
    covered: set[int] = set()
    for item in merged:
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, int) for x in item)):
            raise ValueError("malformed merged run")
        first, count = item
        idx = range(first, first + count)
        if count < 2 or first < 0 or first + count > len(ok):
            raise ValueError(f"merged run {item} out of range")
        if not all(ok[i] for i in idx) or len({group_of[i] for i in idx}) != 1 or covered & set(idx):
            raise ValueError(f"merged run {item} covers a block it may not")
        covered.update(idx)
        runs.append((first, count))
    return runs


def client_plan(
    merged: object, ok: Sequence[bool], views: Sequence[memoryview], groups: Sequence[int]
) -> list[tuple[int, memoryview]]:
    """Client side: one (tag index, buffer) per message the peer moves for a request whose blocks are
    `views`: a span over each merged run (checked by `check_merged`, which raises `ValueError`), the block's
    own buffer for every other block the peer accepted (`ok`)."""
    out: list[tuple[int, memoryview]] = []
    in_run: set[int] = set()
    for first, count in check_merged(merged, ok, groups):
        run = views[first : first + count]
        out.append((first, span(run[0], sum(v.nbytes for v in run))))
        in_run.update(range(first, first + count))
    out += [(j, views[j]) for j, accepted in enumerate(ok) if accepted and j not in in_run]
    return out
