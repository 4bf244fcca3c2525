"""The prefill → committed → decode hand-off as domain values: requests to a serving node and its events.

A prefill node answers a `PrefillRequest` with a `FirstToken` (the first output token, the prompt's
full-block hashes and `PrefillStats`), then, unless the request does not publish, `Published` (its
publish ended `committed`, `publish_failed` or `skipped`). The decode node is handed the same prompt
with the first token (`DecodeRequest.handoff`): committed blocks are pulled from the pool, otherwise the
prompt is recomputed (`prompt_committed=False`). It answers `DecodeTokens`* and one `Finished` with
`DecodeStats`. `kvpool.client.convert` maps these to and from the wire; `kvpool.client.node_client`
makes the calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.sampling import SamplingParams

PUBLISH_FAILED = "publish_failed"
"""A prefill's publish status when it could not commit its blocks (or sent no `Published`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillRequest:
    """One prompt for a prefill node: `token_ids` (the prompt), `sampling` (its first token is sampled
    there), `cache_salt` (the tenant's namespace), `publish` (publish its blocks to the pool) and
    `use_cache` (False: compute everything, the cold reference)."""

    request_id: str
    token_ids: Sequence[int]
    sampling: SamplingParams
    cache_salt: str = ""
    publish: bool = True
    use_cache: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillStats:
    """What a prefill node did for one prompt (token counts; `pulled_bytes`; times in seconds, measured on
    the node; `decision`: "pull" | "recompute" | "local" | "none")."""

    num_prompt_tokens: int = 0
    num_matched_tokens: int = 0
    num_reused_tokens: int = 0
    num_pulled_tokens: int = 0
    num_local_tokens: int = 0
    pulled_bytes: int = 0
    decision: str = ""
    match_s: float = 0.0
    pull_s: float = 0.0
    compute_s: float = 0.0
    ttft_s: float = 0.0
    predicted_pull_s: float = 0.0
    predicted_recompute_s: float = 0.0
    num_failed_blocks: int = 0
    predicted_compute_s: float = 0.0


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A prefill's first output token, the prompt's full-block hashes (32 bytes each) and its stats."""

    token_id: int
    block_hashes: tuple[bytes, ...]
    stats: PrefillStats


@dataclass(frozen=True, slots=True, kw_only=True)
class Published:
    """How a prefill's publish ended: `status` "committed" | "publish_failed" | "skipped", the blocks
    published and already present, its time (s) and, when it failed, why."""

    status: str
    num_blocks: int = 0
    num_existing: int = 0
    publish_s: float = 0.0
    error: str = ""

    @property
    def committed(self) -> bool:
        return self.status == "committed"


PrefillEvent = FirstToken | Published


def publish_status(published: Published | None) -> str:
    """The publish status of a prefill stream (`PUBLISH_FAILED` when it sent no `Published`)."""
    return published.status if published is not None else PUBLISH_FAILED


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeRequest:
    """One request for a decode node: the prompt, its first token and block hashes from the prefill, and
    whether the prompt's blocks were committed (False: the decode node recomputes the prompt)."""

    request_id: str
    token_ids: Sequence[int]
    first_token: int
    block_hashes: Sequence[bytes]
    sampling: SamplingParams
    cache_salt: str = ""
    prompt_committed: bool = False
    publish: bool = True
    use_cache: bool = True

    @classmethod
    def handoff(cls, req: PrefillRequest, first: FirstToken, published: Published | None) -> DecodeRequest:
        """The decode request that continues `req` after its prefill answered `first` and `published`."""
        return cls(
            request_id=req.request_id,
            token_ids=req.token_ids,
            first_token=first.token_id,
            block_hashes=first.block_hashes,
            sampling=req.sampling,
            cache_salt=req.cache_salt,
            prompt_committed=publish_status(published) == "committed",
            publish=req.publish,
            use_cache=req.use_cache,
        )


@dataclass(frozen=True, slots=True)
class DecodeTokens:
    """Tokens a decode node generated (in order, after the first token)."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeStats:
    """What a decode node did for one request (token counts, `pulled_bytes`, times in seconds,
    `finish_reason`: "stop" | "length")."""

    num_prompt_tokens: int = 0
    num_reused_tokens: int = 0
    num_pulled_tokens: int = 0
    pulled_bytes: int = 0
    decision: str = ""
    load_s: float = 0.0
    decode_s: float = 0.0
    num_generated: int = 0
    finish_reason: str = ""
    num_published_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    """A decode stream's end, with its stats."""

    stats: DecodeStats


DecodeEvent = DecodeTokens | Finished
