"""The demo's real input: RAG over shipped documents, and multi-turn chats replayed from a Mooncake trace.

RAG: a shared system prompt + one of the shipped English documents + a question (kvpool/data/rag).
Chat: whole conversations from `conversation_trace.jsonl` (Mooncake FAST'25, Apache-2.0). A request
whose `hash_ids` extend an earlier request's beyond the shared block 0 continues that conversation.
Each trace hash id (a 512-token block) maps to a deterministic pseudo-random block of
`trace_block_tokens` tokens, so shared ids share tokens (Mooncake issue #1266's suggestion).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpool.errors import InvalidArgument
from kvpool.trace import TRACE_BLOCK_TOKENS, Trace, TraceRequest, load_trace

DATA_DIR = Path(__file__).resolve().parents[1] / "data"


@dataclass(frozen=True, slots=True)
class DemoRequest:
    scenario: str  # "rag" | "chat"
    request_id: str
    token_ids: tuple[int, ...]
    label: str


def rag_requests(
    encode: Callable[[str], list[int]], *, max_docs: int = 4, questions_per_doc: int = 5
) -> list[DemoRequest]:
    """System prompt + document + question for each shipped document (documents in order)."""
    spec = json.loads((DATA_DIR / "rag" / "questions.json").read_text())
    out = []
    for d, doc in enumerate(spec["documents"][:max_docs]):
        text = (DATA_DIR / "rag" / doc["file"]).read_text()
        for q, question in enumerate(doc["questions"][:questions_per_doc]):
            prompt = f"{spec['system_prompt']}\n\nDocument: {doc['title']}\n\n{text}\n\nQuestion: {question}\nAnswer:"
            out.append(
                DemoRequest("rag", f"rag-d{d}-q{q}", tuple(encode(prompt)), f"{doc['title']} / Q{q + 1}")
            )
    return out


def default_chat_trace() -> Path:
    shared = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "conversation_trace.jsonl"
    return shared if shared.is_file() else DATA_DIR / "traces" / "conversation_small.jsonl"


def block_tokens(hash_id: int, num_tokens: int, vocab_size: int) -> np.ndarray:
    """Deterministic pseudo-random tokens for one trace hash id (same id, same tokens, any process)."""
    rng = np.random.default_rng(np.random.SeedSequence([0x6B76, hash_id]))
    return rng.integers(0, vocab_size, size=num_tokens, dtype=np.int64)


def find_conversations(records: Sequence[TraceRequest], *, min_turns: int) -> list[list[int]]:
    """Chains of record indices where each turn's hash_ids extend the previous turn's full blocks (beyond
    block 0; the previous turn's last, possibly partial, block may differ)."""
    chains: dict[int, list[int]] = {}
    for i, rec in enumerate(records):
        ids = rec.hash_ids
        if len(ids) < 2:
            continue
        chain = chains.setdefault(ids[1], [])
        if chain:
            prev = records[chain[-1]].hash_ids
            # the previous turn's last block may be partial: its id need not recur
            if len(ids) < len(prev) or ids[: len(prev) - 1] != prev[:-1]:
                continue
        chain.append(i)
    return [c for c in chains.values() if len(c) >= min_turns]


def chat_requests(
    trace: Path | Trace,
    *,
    vocab_size: int,
    num_conversations: int = 4,
    max_turns: int = 4,
    trace_block_tokens: int = 64,
    max_prompt_tokens: int = 3000,
) -> list[DemoRequest]:
    """Whole conversations from the trace, turn by turn, in trace order (turns of chains interleaved).

    A path is read with `kvpool.trace.load_trace`: `InvalidArgument` naming the file and line of a
    malformed record (the CLI loads it before it starts anything).
    """
    if trace_block_tokens < 1:
        raise InvalidArgument(f"trace_block_tokens must be >= 1, got {trace_block_tokens}")
    records = (load_trace(trace) if isinstance(trace, Path) else trace).requests
    scale = trace_block_tokens / TRACE_BLOCK_TOKENS
    chosen: list[list[int]] = []
    for chain in find_conversations(records, min_turns=3):
        turns = [i for i in chain if math.ceil(records[i].input_length * scale) <= max_prompt_tokens][
            :max_turns
        ]
        if len(turns) >= 3:
            chosen.append(turns)
        if len(chosen) == num_conversations:
            break
    order = sorted((i, c) for c, turns in enumerate(chosen) for i in turns)
    out = []
    turn_of: dict[int, int] = {}
    for i, c in order:
        rec = records[i]
        n = math.ceil(rec.input_length * scale)
        tokens = np.concatenate([block_tokens(h, trace_block_tokens, vocab_size) for h in rec.hash_ids])[:n]
        turn_of[c] = turn_of.get(c, 0) + 1
        out.append(
            DemoRequest(
                "chat",
                f"chat-c{c}-t{turn_of[c]}",
                tuple(int(t) for t in tokens),
                f"conv {c} turn {turn_of[c]}",
            )
        )
    return out
