"""Sampling on the serving nodes: the seed and generator of each output position, shared by prefill (the
first token) and decode (the rest), so a seeded request draws the same tokens wherever it runs.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from kvpool.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


def step_seed(seed: int, step: int) -> int:
    """The sampling seed for output position `step` of a request seeded with `seed`.

    Position-derived, so the same request samples the same tokens whether its prompt KV was reused or
    recomputed and wherever its first token was sampled (prefill) or the rest (decode).
    """
    return (seed * 1_000_003 + step * 7_919 + 1) % (2**63 - 1)


def make_step_generator(params: SamplingParams, step: int) -> torch.Generator | None:
    """A CPU generator for output position `step` (None for greedy); see `step_seed`."""
    if params.greedy:
        return None
    import torch

    seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
    return torch.Generator(device="cpu").manual_seed(step_seed(seed, step))
