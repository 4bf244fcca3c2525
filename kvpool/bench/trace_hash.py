"""Hash the prompts of a Mooncake-format trace with real token blocks (the scaffold's `kvpool demo`).

Each trace hash id stands for one 512-token block; it is mapped to a deterministic pseudo-random token
block (seeded by the id), so shared ids share tokens, as Mooncake's maintainers suggest (issue #1266).
The chained hashes of kvpool must then reproduce the trace's own prefix sharing exactly.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvpool.bench.report import write_report
from kvpool.hashing import Namespace, hash_blocks
from kvpool.types import KVLayout

TRACE_BLOCK_TOKENS = 512


def default_trace() -> Path:
    """`../shared/traces/conversation_trace.jsonl` when present, else the fixture shipped in the package."""
    shared = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "conversation_trace.jsonl"
    if shared.is_file():
        return shared
    return Path(__file__).resolve().parents[1] / "data" / "traces" / "conversation_small.jsonl"


def trace_block_tokens(hash_id: int, num_tokens: int = TRACE_BLOCK_TOKENS, vocab: int = 32000) -> np.ndarray:
    """Deterministic pseudo-random tokens for one trace hash id (same id, same tokens, every process)."""
    rng = np.random.default_rng(np.random.SeedSequence([0x6B76, hash_id]))
    return rng.integers(0, vocab, size=num_tokens, dtype=np.int64)


def run_trace_hash(trace: Path | None, json_out: Path | None, max_requests: int = 2000) -> dict:
    path = trace or default_trace()
    layout = KVLayout(
        dtype="float32", block_size=TRACE_BLOCK_TOKENS, num_layers=4, num_kv_heads=2, head_dim=64
    )
    ns = Namespace(model_id="trace-replay", weights_version="none", layout=layout).digest()
    seen: set[bytes] = set()
    requests = blocks = reused = agree = 0
    t0 = time.perf_counter()
    with path.open() as fh:
        for line in fh:
            if requests >= max_requests:
                break
            rec = json.loads(line)
            ids = rec["hash_ids"]
            full = ids[:-1] if rec["input_length"] % TRACE_BLOCK_TOKENS else ids
            if not full:
                continue
            tokens = np.concatenate([trace_block_tokens(i) for i in full])
            hashes = hash_blocks(ns, tokens, TRACE_BLOCK_TOKENS)
            requests += 1
            blocks += len(hashes)
            reused += sum(1 for h in hashes if h in seen)
            seen.update(hashes)
    elapsed_s = time.perf_counter() - t0
    agree = len(seen)
    summary = {
        "trace": path.name,
        "requests": requests,
        "full_blocks": blocks,
        "unique_block_hashes": agree,
        "reused_blocks": reused,
        "block_reuse_rate": reused / blocks if blocks else 0.0,
        "hash_blocks_per_s": blocks / elapsed_s if elapsed_s else 0.0,
    }
    table = Table(title=f"kvpool: hashed {requests} prompts of {path.name}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(table)
    write_report(json_out, "trace_hash", [], summary)
    return summary
