"""The demo's in-process orchestrator (the router issue replaces it with the real router).

For one request: call Prefill and take the first token from its stream (TTFT = time until the caller
holds it), wait for `committed` (or `publish_failed`), then hand off to Decode and collect its tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvpool.client import convert
from kvpool.rpc.server import channel
from kvpool.rpc.status import raise_from_rpc_error
from kvpool.sampling import SamplingParams
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc


@dataclass(slots=True)
class RequestResult:
    request_id: str
    num_prompt_tokens: int
    ttft_s: float
    e2e_s: float
    tokens: list[int]
    prefill: dict[str, Any] = field(default_factory=dict)
    publish_status: str = ""
    decode: dict[str, Any] = field(default_factory=dict)


def _fields(msg: Any) -> dict[str, Any]:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


class Orchestrator:
    """Prefill → (committed) → Decode over gRPC, against one prefill and one decode node."""

    def __init__(self, prefill_address: str, decode_address: str, *, timeout_s: float = 300.0) -> None:
        self._pch = channel(prefill_address)
        self._dch = channel(decode_address)
        self.prefill = pb_grpc.PrefillStub(self._pch)
        self.decode = pb_grpc.DecodeStub(self._dch)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self._pch.close()
        self._dch.close()

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
        req = pb.PrefillRequest(
            request_id=rid,
            token_ids=list(token_ids),
            sampling=convert.sampling_pb(sampling),
            cache_salt=cache_salt,
            publish=publish,
            use_cache=use_cache,
        )
        t0 = time.perf_counter()
        first: pb.PrefillFirstToken | None = None
        published: pb.PrefillPublished | None = None
        ttft_s = 0.0
        try:
            for event in self.prefill.Prefill(req, timeout=self.timeout_s):
                if event.HasField("first_token"):
                    ttft_s = time.perf_counter() - t0
                    first = event.first_token
                elif event.HasField("published"):
                    published = event.published
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"Prefill {rid}")
        if first is None:
            raise RuntimeError(f"Prefill {rid} ended without a first token")
        status = published.status if published is not None else "publish_failed"
        dreq = pb.DecodeRequest(
            request_id=rid,
            token_ids=list(token_ids),
            first_token=first.token_id,
            block_hashes=list(first.block_hashes),
            sampling=convert.sampling_pb(sampling),
            cache_salt=cache_salt,
            prompt_committed=status == "committed",
            publish=publish,
            use_cache=use_cache,
        )
        tokens = [first.token_id]
        dstats: dict[str, Any] = {}
        try:
            for devent in self.decode.Decode(dreq, timeout=self.timeout_s):
                tokens.extend(devent.token_ids)
                if devent.finished:
                    dstats = _fields(devent.stats)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, f"Decode {rid}")
        stop = set(sampling.stop_token_ids)
        if tokens and tokens[0] in stop:
            tokens = []
        return RequestResult(
            request_id=rid,
            num_prompt_tokens=len(token_ids),
            ttft_s=ttft_s,
            e2e_s=time.perf_counter() - t0,
            tokens=tokens,
            prefill=_fields(first.stats),
            publish_status=status,
            decode=dstats,
        )
