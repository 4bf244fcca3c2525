"""The trace side of `kvpool bench vllm-replay`: a seeded subset of whole sessions of the Mooncake
conversation trace, its compressed arrivals, and its prompts as token ids.

A record is `{timestamp (ms), input_length, output_length, hash_ids}` with 512-token, prefix-chained
blocks (the trace's own README). A session is the requests sharing `hash_ids[:2]` (every request
starts with the shared block 0). Each hash id becomes 512 seeded random byte tokens (0..255, the embedded
model's vocabulary), so equal hash ids give equal token blocks and different ones differ; a prompt is the
blocks of its hash ids, cut to `min(input_length, max_prompt_tokens)` tokens.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.trace import full_trace

TRACE_BLOCK_TOKENS = 512
BUCKET_MS = 3000  # the conversation trace's timestamps are quantised into ~3 s buckets
_WARMUP_KEY = 1 << 40  # a block key no trace hash id takes


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayRequest:
    """One request of the subset. `arrival_s`: seconds after the first request, already compressed."""

    index: int  # arrival order in the subset (0, 1, ...)
    session: int  # the session's number in the subset
    turn: int  # 0, 1, ... within its session (the trace's order)
    trace_index: int  # line number in the trace
    arrival_s: float
    hash_ids: tuple[int, ...]  # the trace's hash ids, cut to the capped prompt's blocks
    num_prompt_tokens: int  # min(input_length, max_prompt_tokens)
    trace_input_length: int


def default_trace() -> Path:
    """The whole conversation trace `KVPOOL_TRACE` names, else the bundled excerpt."""
    return full_trace()


def load_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's records, in file order; `InvalidArgument` for a missing or malformed file."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidArgument(f"--trace {path}: {exc.strerror or exc}") from None
    out: list[dict[str, Any]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(
                {
                    "timestamp": int(rec["timestamp"]),
                    "input_length": int(rec["input_length"]),
                    "hash_ids": [int(h) for h in rec["hash_ids"]],
                }
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"--trace {path}:{n}: not a trace record ({exc})") from None
        if not out[-1]["hash_ids"] or out[-1]["input_length"] < 1:
            raise InvalidArgument(f"--trace {path}:{n}: a record needs input_length >= 1 and hash ids")
    return out


def sessions(records: list[dict[str, Any]]) -> list[list[int]]:
    """Record indices grouped by `hash_ids[:2]`, each in trace order; sessions ordered by first request."""
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, rec in enumerate(records):
        groups[tuple(rec["hash_ids"][:2])].append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def select_subset(
    records: list[dict[str, Any]],
    *,
    max_requests: int = 300,
    max_prompt_tokens: int = 8192,
    speedup: float = 20.0,
    seed: int = 2026,
) -> list[ReplayRequest]:
    """Whole sessions drawn in a seeded order while they fit in `max_requests` (a session that does not
    fit is skipped), their requests in arrival order. Requests sharing a timestamp bucket are spread
    evenly over it (trace order kept); arrivals are then divided by `speedup`."""
    if max_requests < 1 or max_prompt_tokens < 1 or speedup <= 0:
        raise InvalidArgument("--max-requests and --max-prompt-tokens must be >= 1, --speedup > 0")
    groups = sessions(records)
    chosen: list[list[int]] = []
    total = 0
    for g in np.random.default_rng(seed).permutation(len(groups)):
        group = groups[int(g)]
        if total + len(group) <= max_requests:
            chosen.append(group)
            total += len(group)
        if total == max_requests:
            break
    by_ts: dict[int, list[int]] = defaultdict(list)
    for i in range(len(records)):
        by_ts[records[i]["timestamp"]].append(i)
    spread = {i: ts + k * BUCKET_MS / len(ids) for ts, ids in by_ts.items() for k, i in enumerate(ids)}
    session_of = {i: (s, t) for s, group in enumerate(chosen) for t, i in enumerate(group)}
    order = sorted(session_of, key=lambda i: (spread[i], i))
    t0 = spread[order[0]] if order else 0.0
    out: list[ReplayRequest] = []
    for n, i in enumerate(order):
        rec = records[i]
        tokens = min(rec["input_length"], max_prompt_tokens)
        num_blocks = -(-tokens // TRACE_BLOCK_TOKENS)
        s, t = session_of[i]
        out.append(
            ReplayRequest(
                index=n,
                session=s,
                turn=t,
                trace_index=i,
                arrival_s=(spread[i] - t0) / 1000.0 / speedup,
                hash_ids=tuple(rec["hash_ids"][:num_blocks]),
                num_prompt_tokens=tokens,
                trace_input_length=rec["input_length"],
            )
        )
    return out


class BlockTokens:
    """Hash id -> its 512 seeded byte tokens (memoised): equal ids, equal tokens."""

    def __init__(self, seed: int = 2026) -> None:
        self.seed = seed
        self._cache: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        tokens = self._cache.get(hash_id)
        if tokens is None:
            rng = np.random.default_rng([self.seed, hash_id])
            tokens = rng.integers(0, 256, size=TRACE_BLOCK_TOKENS).tolist()
            self._cache[hash_id] = tokens
        return tokens

    def prompt(self, req: ReplayRequest) -> list[int]:
        """The request's prompt token ids: its blocks, cut to `num_prompt_tokens`."""
        out: list[int] = []
        for h in req.hash_ids:
            out.extend(self.block(h))
        return out[: req.num_prompt_tokens]

    def warmup(self, num_tokens: int = TRACE_BLOCK_TOKENS) -> list[int]:
        """An unrelated prompt (no leading block shared with any trace prompt) to warm an engine."""
        out = list(self.block(_WARMUP_KEY))
        while len(out) < num_tokens:
            out.extend(self.block(_WARMUP_KEY + len(out)))
        return out[:num_tokens]
