"""The workload of `kvpool bench master --blocks N`: the conversation trace's prefix tree, replicated under
salted namespaces until N blocks are resident.

A trace request's `hash_ids` is a root-to-leaf path of the tree (a prefix-chained block list). Publishing
the trace means, per request in trace order, one `put` of the part of its path not yet published (below the
last block already published). `TreePuts` holds those puts once, as index columns into one array of trace
ids; `Replica` k names namespace k's blocks: 16-byte hashes derived from the namespace digest and the trace
id (distinct per namespace, as real chained hashes are). The fill walks replicas 0, 1, ... until N blocks
are in; the last one is cut short.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.trace import load_trace

_COUNT = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kKmMgG]?)\s*")
_SCALE = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_count(text: str | int) -> int:
    """A block count from `1M`, `20M`, `500K`, `2.5M` or `4096` (decimal: K = 1,000, M = 1,000,000).
    Raises `InvalidArgument` for anything else or a count below 1."""
    if isinstance(text, int):
        value = text
    else:
        m = _COUNT.fullmatch(text)
        if m is None:
            raise InvalidArgument(f"{text!r} is not a block count (examples: 4096, 500K, 1M, 20M)")
        value = round(float(m.group(1)) * _SCALE[m.group(2).lower()])
    if value < 1:
        raise InvalidArgument(f"block count must be >= 1, got {text!r}")
    return value


@dataclass(frozen=True)
class TreePuts:
    """The trace's tree as puts: put i publishes `ids[starts[i]:ends[i]]` below `parents[i]` (a trace id,
    -1: the namespace root). `paths` holds each request's full path as (start, end) into `path_ids`."""

    ids: np.ndarray  # int64 trace ids, concatenated new parts of every put
    starts: np.ndarray  # int64
    ends: np.ndarray  # int64
    parents: np.ndarray  # int64, -1: root
    path_ids: np.ndarray  # int64, every request's full path concatenated
    path_bounds: np.ndarray  # int64 (num_requests, 2)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks of one replica of the tree."""
        return int(self.ids.size)

    @property
    def num_puts(self) -> int:
        return int(self.starts.size)

    @classmethod
    def from_trace(cls, path: Path) -> TreePuts:
        """Load a Mooncake-format JSONL trace. A request whose path contradicts the tree (an id seen below
        another parent) is cut at that id; repeated requests add no put."""
        trace = load_trace(path)
        parent_of: dict[int, int] = {}
        ids: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        parents: list[int] = []
        path_ids: list[int] = []
        bounds: list[tuple[int, int]] = []
        for req in trace.requests:
            parent, new_start, put_parent = -1, -1, -1
            path_start = len(path_ids)
            for h in req.hash_ids:
                if h not in parent_of:
                    parent_of[h] = parent
                    ids.append(h)
                    if new_start < 0:
                        new_start, put_parent = len(ids) - 1, parent
                elif parent_of[h] != parent or new_start >= 0:
                    break  # not a prefix tree here: keep the consistent part
                path_ids.append(h)
                parent = h
            if new_start >= 0:
                starts.append(new_start)
                ends.append(len(ids))
                parents.append(put_parent)
            bounds.append((path_start, len(path_ids)))
        return cls(
            np.asarray(ids, dtype=np.int64),
            np.asarray(starts, dtype=np.int64),
            np.asarray(ends, dtype=np.int64),
            np.asarray(parents, dtype=np.int64),
            np.asarray(path_ids, dtype=np.int64),
            np.asarray(bounds, dtype=np.int64).reshape(-1, 2),
        )


def block_hash(ns: bytes, trace_id: int) -> bytes:
    """Namespace `ns`'s 16-byte hash of trace block `trace_id` (blake2b of the two; distinct per namespace)."""
    return hashlib.blake2b(ns + trace_id.to_bytes(8, "little", signed=True), digest_size=16).digest()


@dataclass(frozen=True)
class Put:
    """One publish: `hashes` (16 bytes each) below `parent` (None: the namespace root)."""

    ns: bytes
    parent: bytes | None
    hashes: list[bytes]


def replica_puts(tree: TreePuts, ns: bytes, limit: int) -> Iterator[Put]:
    """Namespace `ns`'s puts of the tree, stopping after `limit` blocks (the last put cut short)."""
    left = limit
    for i in range(tree.num_puts):
        if left <= 0:
            return
        s, e = int(tree.starts[i]), int(tree.ends[i])
        e = min(e, s + left)
        p = int(tree.parents[i])
        yield Put(ns, None if p < 0 else block_hash(ns, p), [block_hash(ns, int(h)) for h in tree.ids[s:e]])
        left -= e - s


def prompts(
    tree: TreePuts, namespaces: list[bytes], resident: list[int], num: int, prompt_blocks: int, seed: int = 0
) -> tuple[list[tuple[bytes, list[bytes]]], list[int]]:
    """`num` prompts of `prompt_blocks` blocks drawn uniformly from every resident chain (a request's path
    in a namespace), each padded past its path with blocks no one published. Returns ((namespace, hashes)
    per prompt, the blocks each must match). `resident[k]`: blocks resident in namespace k (a replica cut
    short holds the first ones of `tree.ids`: only paths wholly inside it are drawn)."""
    rng = np.random.default_rng(seed)
    order = {int(h): i for i, h in enumerate(tree.ids)}
    depth = np.array([order.get(int(tree.path_ids[e - 1]), -1) if e > s else -1 for s, e in tree.path_bounds])
    choices: list[tuple[int, int]] = []  # (namespace k, request i)
    for k, n in enumerate(resident):
        ok = np.nonzero((depth >= 0) & (depth < n))[0]
        choices.extend((k, int(i)) for i in ok)
    if not choices:
        raise InvalidArgument("no resident chain to draw prompts from")
    out: list[tuple[bytes, list[bytes]]] = []
    want: list[int] = []
    for j in rng.integers(0, len(choices), size=num):
        k, i = choices[int(j)]
        s, e = (int(x) for x in tree.path_bounds[i])
        path = [int(h) for h in tree.path_ids[s:e]][:prompt_blocks]
        ns = namespaces[k]
        hashes = [block_hash(ns, h) for h in path]
        hashes += [block_hash(ns, -1 - t) for t in range(prompt_blocks - len(path))]  # never published
        out.append((ns, hashes))
        want.append(len(path))
    return out, want
