"""Sampling parameters as callers of the Prefill/Decode services send them (the router, the demo's
orchestrator, benchmarks). Validation happens on the nodes (`kvpool.model.SamplingParams`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.v1 import kvpool_pb2 as pb


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """temperature 0 = greedy; top_p in (0, 1]; top_k 0 = all; seed None = unseeded; max_tokens >= 1."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def to_proto(self) -> pb.SamplingParams:
        return pb.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed or 0,
            has_seed=self.seed is not None,
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids),
        )
