"""The next-token sampler (greedy at temperature 0, seeded otherwise); `SamplingParams` lives in
`kvpool.sampling` (re-exported here).

Sampling runs on CPU in fp32 whatever the model's device, so a seeded request draws the same tokens on
every node and device given the same logits. Sampling parameters are never part of a block key.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from kvpool.errors import InvalidArgument
from kvpool.sampling import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["SamplingParams", "make_generator", "sample_next"]


def make_generator(params: SamplingParams) -> torch.Generator:
    """A CPU `torch.Generator` seeded from `params.seed` (random entropy when None)."""
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(params.seed if params.seed is not None else random.SystemRandom().getrandbits(63))
    return gen


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """Pick the next token from `logits` (`[vocab]`, any float dtype/device).

    Greedy (`temperature == 0`): `argmax`, deterministic, generator unused. Otherwise temperature, then
    top-k, then top-p filtering, then one draw from `generator` (required; a CPU generator, see
    `make_generator`). Raises `InvalidArgument` for non-1-D logits or a missing generator.
    """
    import torch

    if logits.dim() != 1:
        raise InvalidArgument(f"logits must be [vocab], got shape {tuple(logits.shape)}")
    x = logits.detach().to("cpu", torch.float32)
    if params.greedy:
        return int(torch.argmax(x).item())
    if generator is None:
        raise InvalidArgument("sampling at temperature > 0 needs a generator (see make_generator)")
    x = x / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs >= params.top_p  # keep the smallest prefix with mass >= top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
