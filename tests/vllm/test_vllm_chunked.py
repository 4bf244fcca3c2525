"""Chunked prefill (a prompt longer than one step's token budget) and preemption (a KV cache too small for
the batch): every full block is published exactly once, and a fresh engine, loading asynchronously, then
hits every one of them.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from tests.vllm.harness import BLOCK, FP32_LAYOUT, requests, run_engine, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

PROMPTS = [tokens(700 + i, 1200) for i in range(3)]
MAX_TOKENS = 100
_PUBLISHER = re.compile(
    r"kvpool publisher: (\d+) publishes, (\d+) blocks committed, (\d+) already present, (\d+) publishes failed"
)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    spec = LocalClusterSpec(layout=FP32_LAYOUT, num_stores=2, num_prefill=0, num_decode=0)
    with LocalCluster(spec) as cluster:
        m = cluster.master_address
        # 256-token steps: each prompt is prefilled in 5 chunks; 40 blocks: two requests admitted (2 x 19),
        # then their decodes need 2 x 21: one is preempted
        small = {
            "max_num_batched_tokens": 256,
            "num_gpu_blocks_override": 40,
            "max_num_seqs": 3,
            "max_model_len": 2048,
        }
        batch = {"batch": True, "requests": requests(PROMPTS, max_tokens=MAX_TOKENS)}
        a = run_engine({"master": m, **small, "phases": [batch], "settle_s": 1.0})
        # B loads between engine steps (load_async): the requests wait for their loads, the engine steps on
        b = run_engine(
            {
                "master": m,
                "extra": {"load_async": True},
                "phases": [requests(PROMPTS, max_tokens=MAX_TOKENS)],
            },
            exact_hits=True,
        )
        cold = run_engine({"phases": [requests(PROMPTS, max_tokens=MAX_TOKENS)]})
    return {"a": a, "b": b["phases"][0], "cold": cold["phases"][0]}


def test_chunked_and_preempted_requests_publish_every_block_once(runs: dict[str, Any]) -> None:
    results = runs["a"]["phases"][0]
    assert sum(r["kvpool"]["num_preemptions"] for r in results) >= 1, [r["kvpool"] for r in results]
    # KV exists for the prompt and every output token but the last sampled one (a request may stop at EOS)
    expected = [(len(p) + len(r["tokens"]) - 1) // BLOCK for p, r in zip(PROMPTS, results, strict=True)]
    assert [r["kvpool"]["num_saved_blocks"] for r in results] == expected
    m = _PUBLISHER.search(runs["a"]["stderr"])
    assert m is not None, runs["a"]["stderr"][-3000:]
    _jobs, committed, existing, failed = (int(x) for x in m.groups())
    assert (committed, existing, failed) == (sum(expected), 0, 0)


def test_a_fresh_engine_hits_every_published_block(runs: dict[str, Any]) -> None:
    for r, cold in zip(runs["b"], runs["cold"], strict=True):
        assert r["num_cached_tokens"] == (1200 - 1) // BLOCK * BLOCK, r["kvpool"]
        assert r["tokens"] == cold["tokens"]
    for r, a in zip(runs["b"], runs["a"]["phases"][0], strict=True):
        assert r["tokens"] == a["tokens"]  # chunked and preempted, the output is the same
