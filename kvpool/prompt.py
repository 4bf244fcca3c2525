"""A prompt's limits and the last-token rule: one module for every node, the router, the vLLM connector,
the cost model and the benchmarks.

- Limits: a prompt is at most `prompt_token_limit` tokens (the configured `max_prompt_tokens`, and one
  position short of the model's context), every id in the vocabulary (`validate_tokens`), and the prompt
  plus `max_tokens` fit the model's context (`check_context`).
- The last prompt token is always computed, never taken from cache (field case B06): its logits sample the
  first output token. So at most `reusable_tokens` of a prompt come from cache, which is at most
  `max_reusable_blocks` full blocks; the partial tail is never reused.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import InvalidArgument

DEFAULT_MAX_PROMPT_TOKENS = 32_768
"""A node's `max_prompt_tokens` by default (the router's default is the same number)."""


def prompt_token_limit(max_prompt_tokens: int, max_model_len: int) -> int:
    """The longest prompt accepted: at most `max_prompt_tokens`, and one position short of the model's
    context (the first generated token needs it). The one rule of the prefill and decode nodes, the
    router's `_check_prompt` and `kvpool bench ttft`'s check before it starts."""
    return min(max_prompt_tokens, max_model_len - 1)


def validate_tokens(token_ids: Sequence[int], *, vocab_size: int, max_tokens: int) -> list[int]:
    """A prompt's token ids as a list; `InvalidArgument` when empty, longer than `max_tokens` (see
    `prompt_token_limit`) or out of the vocabulary."""
    tokens = list(token_ids)
    if not tokens:
        raise InvalidArgument("token_ids must not be empty")
    if len(tokens) > max_tokens:
        raise InvalidArgument(f"the prompt has {len(tokens)} tokens; the limit is {max_tokens} tokens")
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token id {bad} is outside the model's vocabulary of {vocab_size}")
    return tokens


def check_context(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """`InvalidArgument` when a prompt of `num_prompt_tokens` plus `max_tokens` generated tokens exceeds
    the model's context of `max_model_len` tokens."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidArgument(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceed the model's "
            f"context of {max_model_len} tokens"
        )


def reusable_tokens(num_cached_tokens: int, num_prompt_tokens: int) -> int:
    """Of `num_cached_tokens` cached leading tokens, how many a prompt of `num_prompt_tokens` (>= 1) takes
    from cache: all but its last token at most."""
    return min(num_cached_tokens, num_prompt_tokens - 1)


def max_reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks of `block_size` tokens a prompt of `num_prompt_tokens` may take from cache:
    `(num_prompt_tokens - 1) // block_size` (0 for an empty prompt)."""
    return max(0, (num_prompt_tokens - 1) // block_size)
