"""Decode hashes a prompt once (its service) and extends that chain for what it publishes."""

from __future__ import annotations

import pytest

from decode_node.scheduler import DecodeJob, DecodeStats, _chain
from kvpool.hashing import hash_blocks
from kvpool.sampling import SamplingParams

NS = bytes(range(16))
BLOCK = 4


@pytest.mark.parametrize("prompt_len", [3, 4, 9])
@pytest.mark.parametrize("num_generated", [0, 1, 5, 12])
def test_the_published_chain_extends_the_prompts_hashes(prompt_len: int, num_generated: int) -> None:
    prompt = list(range(1, prompt_len + 1))
    job = DecodeJob(
        request_id="r",
        ns=NS,
        prompt=prompt,
        hashes=hash_blocks(NS, prompt, BLOCK),
        first_token=7,
        params=SamplingParams(),
        prompt_committed=False,
        publish=True,
        use_cache=True,
    )
    fed = prompt + [100 + i for i in range(num_generated)]
    assert _chain(job, fed, BLOCK) == hash_blocks(NS, fed, BLOCK)


def test_tpot_needs_two_tokens() -> None:
    assert DecodeStats(decode_s=1.0, num_generated=1).tpot_s is None
    assert DecodeStats(decode_s=1.0, num_generated=5).tpot_s == 0.25
