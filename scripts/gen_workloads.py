"""Generate the eviction research workloads as Mooncake-format JSONL traces, deterministically.

    .venv/bin/python scripts/gen_workloads.py --out /tmp/workloads [--seed 7] [--scale 1.0]

Writes `rag.jsonl`, `agent.jsonl` and `scan.jsonl` (`timestamp` ms, `input_length`, `output_length`,
`hash_ids`; 512-token blocks, each hash id naming its whole prefix, the last block possibly partial, as
in Mooncake's traces: the format is in `kvpool/trace.py`). A partial block is a different block from the full block that later
extends it, as in Mooncake's traces.

- `rag`: a 1-block system prompt, then one or two documents drawn Zipf(1.1) from 2,000 (4-24 blocks
  each), then a fresh question (100-900 tokens). Poisson arrivals, 4 requests/s.
- `agent`: tool-using agent sessions whose context grows turn by turn: a shared 3-block tool spec, then
  each turn appends a tool result and a thought (200-3,000 tokens); 3-30 turns 1-15 s apart; about 25
  sessions live at once.
- `scan`: multi-turn chats (as `agent`, 2-12 turns, 10-120 s apart, a 1-block system prompt) mixed
  with one-off long scans (30-150 blocks, never repeated): 25 % of requests are scans.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path

BLOCK_TOKENS = 512
Record = dict[str, object]


class _Hasher:
    """Prefix-chained block ids: a block is named by its parent's id and its own content label."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, object], int] = {}

    def chain(self, labels: list[object]) -> list[int]:
        out, parent = [], -1
        for label in labels:
            parent = self._ids.setdefault((parent, label), len(self._ids))
            out.append(parent)
        return out


def _blocks(segments: list[tuple[object, int]]) -> tuple[list[object], int]:
    """Labels of the 512-token blocks covering `segments` (label, tokens), and the token count. A
    block's label names every segment piece in it, so a partial tail differs from its completion."""
    labels: list[object] = []
    current: list[tuple[object, int, int]] = []
    fill = total = 0
    for label, tokens in segments:
        offset = 0
        while offset < tokens:
            take = min(tokens - offset, BLOCK_TOKENS - fill)
            current.append((label, offset, take))
            offset, fill, total = offset + take, fill + take, total + take
            if fill == BLOCK_TOKENS:
                labels.append(tuple(current))
                current, fill = [], 0
    if current:
        labels.append(tuple(current))
    return labels, total


def _zipf_sampler(rng: random.Random, n: int, s: float) -> list[float]:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    total, acc, cdf = sum(weights), 0.0, []
    for w in weights:
        acc += w / total
        cdf.append(acc)
    return cdf


def _record(hasher: _Hasher, ts: float, segments: list[tuple[object, int]], out_tokens: int) -> Record:
    labels, tokens = _blocks(segments)
    return {
        "timestamp": int(ts),
        "input_length": tokens,
        "output_length": out_tokens,
        "hash_ids": hasher.chain(labels),
    }


def rag(seed: int, n: int) -> Iterator[Record]:
    rng, hasher = random.Random(seed), _Hasher()
    num_docs = 2000
    doc_tokens = [rng.randint(4, 24) * BLOCK_TOKENS - rng.randint(0, 300) for _ in range(num_docs)]
    order = list(range(num_docs))
    rng.shuffle(order)  # popularity rank -> document
    cdf = _zipf_sampler(rng, num_docs, 1.1)
    ts = 0.0
    for i in range(n):
        ts += rng.expovariate(4.0) * 1000.0
        docs = [order[min(_bisect(cdf, rng.random()), num_docs - 1)] for _ in range(rng.choice((1, 1, 2)))]
        segments: list[tuple[object, int]] = [("system", BLOCK_TOKENS)]
        segments += [(("doc", d), doc_tokens[d]) for d in dict.fromkeys(docs)]
        segments.append((("question", i), rng.randint(100, 900)))
        yield _record(hasher, ts, segments, rng.randint(50, 400))


def _bisect(cdf: list[float], x: float) -> int:
    lo, hi = 0, len(cdf)
    while lo < hi:
        mid = (lo + hi) // 2
        if cdf[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _sessions(
    rng: random.Random,
    hasher: _Hasher,
    n: int,
    *,
    prefix: tuple[str, int],
    turns: tuple[int, int],
    gap_s: tuple[float, float],
    step_tokens: tuple[int, int],
    start_rate_per_s: float,
    first_id: int,
) -> list[tuple[float, int, Record]]:
    """Multi-turn sessions whose context grows turn by turn, until `n` requests are made."""
    out: list[tuple[float, int, Record]] = []
    start, sid = 0.0, first_id
    while len(out) < n:
        start += rng.expovariate(start_rate_per_s) * 1000.0
        segments: list[tuple[object, int]] = [prefix]
        ts = start
        for turn in range(rng.randint(*turns)):
            segments.append((("s", sid, turn), rng.randint(*step_tokens)))
            out.append((ts, len(out), _record(hasher, ts, list(segments), rng.randint(20, 600))))
            ts += rng.uniform(*gap_s) * 1000.0
            if len(out) >= n:
                break
        sid += 1
    return out


def agent(seed: int, n: int) -> Iterator[Record]:
    rng, hasher = random.Random(seed), _Hasher()
    reqs = _sessions(
        rng,
        hasher,
        n,
        prefix=("tools", 3 * BLOCK_TOKENS),
        turns=(3, 30),
        gap_s=(1.0, 15.0),
        step_tokens=(200, 3000),
        start_rate_per_s=0.2,
        first_id=0,
    )
    yield from (rec for _, _, rec in sorted(reqs, key=lambda r: (r[0], r[1])))


def scan(seed: int, n: int) -> Iterator[Record]:
    rng, hasher = random.Random(seed), _Hasher()
    chats = _sessions(
        rng,
        hasher,
        n - n // 4,
        prefix=("system", BLOCK_TOKENS),
        turns=(2, 12),
        gap_s=(10.0, 120.0),
        step_tokens=(100, 1500),
        start_rate_per_s=0.3,
        first_id=0,
    )
    end = max(ts for ts, _, _ in chats)
    scans = []
    for k in range(n // 4):
        ts = rng.uniform(0.0, end)
        tokens = rng.randint(30, 150) * BLOCK_TOKENS - rng.randint(0, 400)
        scans.append((ts, len(chats) + k, _record(hasher, ts, [(("scan", k), tokens)], 100)))
    merged = heapq.merge(sorted(chats, key=lambda r: (r[0], r[1])), sorted(scans, key=lambda r: (r[0], r[1])))
    yield from (rec for _, _, rec in merged)


WORKLOADS = {"rag": (rag, 4000), "agent": (agent, 4000), "scan": (scan, 4000)}


def write(out_dir: Path, *, seed: int = 7, scale: float = 1.0) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (gen, n) in WORKLOADS.items():
        path = out_dir / f"{name}.jsonl"
        with path.open("w") as fh:
            for rec in gen(seed, max(1, math.ceil(n * scale))):
                fh.write(json.dumps(rec) + "\n")
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every workload's request count")
    args = ap.parse_args()
    for path in write(args.out, seed=args.seed, scale=args.scale):
        print(path)


if __name__ == "__main__":
    main()
