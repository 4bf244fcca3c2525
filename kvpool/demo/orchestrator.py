"""The demo's in-process orchestrator (the router issue replaces it with the real router).

For one request: prefill on one node and take the first token from its stream (TTFT = time until the
caller holds it), wait for `committed` (or `publish_failed`), then hand off to decode on the other and
collect its tokens (`kvpool.client.node_client.NodeClient.handoff`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.node_client import NodeClient
from kvpool.client.node_types import DecodeTokens, Finished, FirstToken, PrefillRequest, Published
from kvpool.sampling import SamplingParams


@dataclass(slots=True)
class RequestResult:
    """One request's outcome: `tokens` (the first token and decode's; [] when the first was a stop
    token), TTFT and end-to-end seconds, the nodes' stats as dicts (`PrefillStats`, `DecodeStats`
    fields) and the prefill's publish status."""

    request_id: str
    num_prompt_tokens: int
    ttft_s: float
    e2e_s: float
    tokens: list[int]
    prefill: dict[str, Any] = field(default_factory=dict)
    publish_status: str = ""
    decode: dict[str, Any] = field(default_factory=dict)


class Orchestrator:
    """Prefill → (committed) → Decode over gRPC, against one prefill and one decode node."""

    def __init__(self, prefill_address: str, decode_address: str, *, timeout_s: float = 300.0) -> None:
        self.prefill_address = prefill_address
        self.decode_address = decode_address
        self.nodes = NodeClient(timeout_s=timeout_s)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.nodes.close()

    def run(
        self,
        token_ids: Sequence[int],
        *,
        sampling: SamplingParams = SamplingParams(),
        use_cache: bool = True,
        publish: bool = True,
        cache_salt: str = "",
        request_id: str | None = None,
    ) -> RequestResult:
        """Serve one request end to end. Raises a `KVPoolError` for a failed RPC."""
        rid = request_id or uuid.uuid4().hex[:12]
        req = PrefillRequest(
            request_id=rid,
            token_ids=list(token_ids),
            sampling=sampling,
            cache_salt=cache_salt,
            publish=publish,
            use_cache=use_cache,
        )
        t0 = time.perf_counter()
        ttft_s = 0.0
        tokens: list[int] = []
        prefill: dict[str, Any] = {}
        status = ""
        dstats: dict[str, Any] = {}
        for ev in self.nodes.handoff(self.prefill_address, self.decode_address, req):
            if isinstance(ev, FirstToken):
                ttft_s = time.perf_counter() - t0
                tokens.append(ev.token_id)
                prefill = dataclasses.asdict(ev.stats)
            elif isinstance(ev, Published):
                status = ev.status
            elif isinstance(ev, DecodeTokens):
                tokens.extend(ev.token_ids)
            elif isinstance(ev, Finished):
                dstats = dataclasses.asdict(ev.stats)
        stop = set(sampling.stop_token_ids)
        if tokens and tokens[0] in stop:
            tokens = []
        return RequestResult(
            request_id=rid,
            num_prompt_tokens=len(token_ids),
            ttft_s=ttft_s,
            e2e_s=time.perf_counter() - t0,
            tokens=tokens,
            prefill=prefill,
            publish_status=status,
            decode=dstats,
        )
