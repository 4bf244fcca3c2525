"""The prompt rules (`kvpool.prompt`) and the one sampling converter (`kvpool.client.convert`)."""

from __future__ import annotations

import pytest

from kvpool.client import convert
from kvpool.errors import InvalidArgument
from kvpool.prompt import (
    check_context,
    max_reusable_blocks,
    prompt_token_limit,
    reusable_tokens,
    validate_tokens,
)
from kvpool.sampling import SamplingParams
from kvpool.v1 import kvpool_pb2 as pb


@pytest.mark.parametrize(("num_tokens", "expected"), [(0, 0), (1, 0), (16, 0), (17, 1), (32, 1), (33, 2)])
def test_the_last_token_is_never_reused(num_tokens: int, expected: int) -> None:
    assert max_reusable_blocks(num_tokens, 16) == expected
    if num_tokens:
        assert reusable_tokens(num_tokens, num_tokens) == num_tokens - 1  # fully cached: one computed
        assert reusable_tokens(expected * 16, num_tokens) == expected * 16


def test_limits() -> None:
    assert prompt_token_limit(32_768, 32_768) == 32_767
    assert prompt_token_limit(100, 32_768) == 100
    assert validate_tokens((1, 2, 3), vocab_size=4, max_tokens=3) == [1, 2, 3]
    for tokens, match in (([], "empty"), ([1] * 4, "limit is 3"), ([1, 4], "vocabulary of 4")):
        with pytest.raises(InvalidArgument, match=match):
            validate_tokens(tokens, vocab_size=4, max_tokens=3)
    check_context(10, 6, 16)
    with pytest.raises(InvalidArgument, match="context of 16 tokens"):
        check_context(10, 7, 16)


def test_sampling_round_trips_the_wire() -> None:
    for params in (
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=0, max_tokens=3, stop_token_ids=(1, 2)),
    ):
        assert convert.sampling(convert.sampling_pb(params)) == params
    unset = convert.sampling(pb.SamplingParams())  # proto3 zeros: top_p 1, 16 tokens, unseeded
    assert unset == SamplingParams(top_p=1.0, max_tokens=16, seed=None)
    with pytest.raises(InvalidArgument, match="top_p"):
        convert.sampling(pb.SamplingParams(top_p=1.5))
