"""`SamplingParams`: a request's sampling parameters, the one domain value every layer passes around.

The router and the demo build it from a request, `kvpool.client.convert` carries it over the wire
(`sampling_pb` / `sampling`), the nodes sample with it (`kvpool.model.sample_next`). Sampling parameters
are never part of a block key.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import InvalidArgument


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """OpenAI-style sampling parameters.

    - `temperature`: 0 = greedy (argmax, first index on ties); > 0 divides the logits.
    - `top_p`: nucleus mass in (0, 1]; `top_k`: keep the k largest logits (0 = all).
    - `seed`: seeds the request's `torch.Generator` (None = fresh entropy).
    - `max_tokens`: tokens to generate (>= 1); `stop_token_ids`: stop (the stop token is not returned).
    Raises `InvalidArgument` on out-of-range values.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k!r}")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
