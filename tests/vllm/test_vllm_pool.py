"""Engine A computes and publishes; a fresh engine B in another process loads from the pool; a cold engine C
computes the same prompts with no cache anywhere. B's greedy tokens equal C's on every prompt (RAG and
multi-turn chat), B's `num_cached_tokens` shows the pooled prefix, decode-filled blocks hit the next chat
turn, vLLM's own prefix cache supplies what it holds (the connector loads nothing then), and pooled bytes
corrupted inside a store are detected and recomputed with the tokens still equal.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.client import MasterClient
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.hashing import hash_blocks
from tests.faults.common import corrupt
from tests.vllm.harness import BLOCK, FP32_LAYOUT, requests, run_engine, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

NUM_DOCS, DOC_TOKENS, Q_TOKENS = 5, 700, 36
SYSTEM_TOKENS, USER_TOKENS, REPLY_TOKENS = 330, 40, 16  # turn 1 + 15 reply tokens crosses block 6 (384)
NUM_CHATS = 4
CORRUPT_DOC = 4


def doc(d: int) -> list[int]:
    return tokens(100 + d, DOC_TOKENS)


def question(d: int, q: int) -> list[int]:
    return tokens(1000 + 10 * d + q, Q_TOKENS)


def chat_turn1(c: int) -> list[int]:
    return tokens(200 + c, SYSTEM_TOKENS) + tokens(300 + c, USER_TOKENS)


def user(c: int, t: int) -> list[int]:
    return tokens(400 + 10 * c + t, USER_TOKENS)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    spec = LocalClusterSpec(layout=FP32_LAYOUT, num_stores=2, num_prefill=0, num_decode=0)
    with LocalCluster(spec) as cluster:
        master = cluster.master_address
        # A: one question per document and the first turn of each conversation (its reply fills a block)
        a_prompts = [doc(d) + question(d, 0) for d in range(NUM_DOCS)] + [
            chat_turn1(c) for c in range(NUM_CHATS)
        ]
        a = run_engine(
            {"master": master, "phases": [requests(a_prompts, max_tokens=REPLY_TOKENS)], "settle_s": 1.0}
        )
        corrupted = _corrupt_doc(cluster, doc(CORRUPT_DOC))
        # B (fresh process, vLLM's prefix cache on): two new questions per document, then turns 2-4
        rag = [doc(d) + question(d, q) for d in range(NUM_DOCS) for q in (1, 2)]
        chats = [
            {
                "chat": True,
                "start": chat_turn1(c) + a["phases"][0][NUM_DOCS + c]["tokens"] + user(c, 2),
                "users": [user(c, 3), user(c, 4)],
                "max_tokens": REPLY_TOKENS,
            }
            for c in range(NUM_CHATS)
        ]
        b = run_engine(
            {
                "master": master,
                "prefix_caching": True,
                "phases": [requests(rag, max_tokens=REPLY_TOKENS), *chats],
            },
            exact_hits=True,
        )
        b_results = [r | {"prompt_token_ids": p} for r, p in zip(b["phases"][0], rag, strict=True)]
        b_results += [r for phase in b["phases"][1:] for r in phase]
        offered_after = set(_replicas(cluster, doc(CORRUPT_DOC)))
        # C: the same prompts, cold (no connector, no prefix cache)
        c = run_engine(
            {"phases": [requests([r["prompt_token_ids"] for r in b_results], max_tokens=REPLY_TOKENS)]}
        )
        return {
            "a": a,
            "b": b_results,
            "cold": c["phases"][0],
            "corrupted": corrupted,
            "offered_after": offered_after,
        }


def _replicas(cluster: LocalCluster, prompt: list[int]) -> list[tuple[str, int, int]]:
    """(store, slot, generation) of every replica of the document's blocks 3..9 the master offers."""
    with MasterClient(cluster.master_address, timeout_s=5.0) as m:
        namespaces = [n.namespace for n in m.stats().namespaces]
        assert len(namespaces) == 1, namespaces
        hashes = hash_blocks(namespaces[0], prompt, BLOCK)[:10]
        match = m.match(namespaces[0], hashes)
    return [(loc.node_id, loc.slot, loc.generation) for reps in match.replicas[3:10] for loc in reps]


def _corrupt_doc(cluster: LocalCluster, prompt: list[int]) -> set[tuple[str, int, int]]:
    """Overwrite blocks 3..9 of a document in every store replica (a RAM fault); returns the replicas."""
    replicas = _replicas(cluster, prompt)
    assert len(replicas) >= 7
    stores = {p.name: p for p in cluster.stores}
    for node_id, slot, _gen in replicas:
        corrupt(stores[node_id], slot, seed=slot)
    return set(replicas)


def test_tokens_equal_cold_on_every_prompt(runs: dict[str, Any]) -> None:
    assert len(runs["b"]) >= 20
    for i, (b, cold) in enumerate(zip(runs["b"], runs["cold"], strict=True)):
        assert b["tokens"] == cold["tokens"], f"prompt {i}: pool {b['tokens']} != cold {cold['tokens']}"


def test_b_loads_the_pooled_prefix_and_computes_only_the_rest(runs: dict[str, Any]) -> None:
    full = DOC_TOKENS // BLOCK * BLOCK  # 640: block 10 also holds A's question tokens
    for d in range(NUM_DOCS):
        first, second = runs["b"][2 * d], runs["b"][2 * d + 1]
        if d != CORRUPT_DOC:
            assert first["num_cached_tokens"] == full, (d, first["kvpool"])
            assert first["kvpool"]["num_loaded_tokens"] == full, first["kvpool"]
        # the second question finds the document in vLLM's own prefix cache: the connector loads nothing
        assert second["num_cached_tokens"] == full, (d, second["kvpool"])
        assert second["kvpool"].get("num_loaded_tokens", 0) == 0, second["kvpool"]
    for r in runs["cold"]:
        assert r["num_cached_tokens"] == 0


def test_decode_blocks_are_published_so_the_next_turn_hits(runs: dict[str, Any]) -> None:
    """Turn 2 = turn 1 (370 tokens) + A's 16-token reply + a user turn: A computed KV for 385 tokens, so
    block 6 (tokens 320-383) exists only because A published a block its decode filled."""
    turn2 = runs["b"][2 * NUM_DOCS :: 3]
    assert len(turn2) == NUM_CHATS
    for r in turn2:
        assert r["num_cached_tokens"] >= 6 * BLOCK, r["kvpool"]
    # later turns: the earlier turns of the same engine B are in vLLM's cache or the pool
    for c in range(NUM_CHATS):
        later = runs["b"][2 * NUM_DOCS + 3 * c + 1 : 2 * NUM_DOCS + 3 * c + 3]
        for r in later:
            assert (
                r["num_cached_tokens"]
                >= (len(r["prompt_token_ids"]) - USER_TOKENS - REPLY_TOKENS) // BLOCK * BLOCK
            )


def test_corrupted_pool_bytes_are_detected_and_recomputed(runs: dict[str, Any]) -> None:
    """The checksum catches every corrupted block: the load keeps the intact leading run, vLLM recomputes
    from there (the tokens are equal: see the first test), the bad replicas are dropped from the index and
    the recomputed blocks are published again in fresh slots."""
    first = runs["b"][2 * CORRUPT_DOC]
    assert first["kvpool"]["load_failed"] is True, first["kvpool"]
    assert first["kvpool"]["num_intact_tokens"] == 3 * BLOCK, first["kvpool"]  # blocks 0-2 arrived intact
    assert first["kvpool"]["num_saved_blocks"] >= DOC_TOKENS // BLOCK
    assert len(runs["offered_after"]) >= 7  # published again
    assert not runs["offered_after"] & runs["corrupted"]
