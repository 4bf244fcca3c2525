"""The prefill node's gRPC service: `Prefill(request) → stream (first_token, published)`.

Per request (docs/design.md "How a request flows", steps 1-2): hash the prompt's full blocks → load the reusable prefix
(match with a counted hit and a read lease, node-local tier first, pull when the cost model says so) →
compute only the rest (at least the last prompt token) → sample the first token and send it at once →
then publish the new full blocks two-phase and send `committed` (or `publish_failed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from kvpool.client import convert
from kvpool.hashing import hash_blocks
from kvpool.prompt import prompt_token_limit, validate_tokens
from kvpool.rpc.status import rpc_errors
from kvpool.serving.runtime import NodeRuntime
from kvpool.serving.sampling import make_step_generator
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import torch

    from kvpool.connector.plan import LoadedPrefix
    from kvpool.model import KVPrefix
    from kvpool.sampling import SamplingParams

log = logging.getLogger(__name__)


class PrefillService(pb_grpc.PrefillServicer):
    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt
        self._queue_len = 0
        self._queue_lock = threading.Lock()
        self.num_requests = 0

    @property
    def queue_len(self) -> int:
        return self._queue_len

    @rpc_errors
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.GetInfoResponse:  # noqa: N802
        """Who this node is (id, role, address, epoch): the master asks before another process may take
        over its node id."""
        return self.rt.info()

    @rpc_errors
    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext) -> Iterator[pb.PrefillEvent]:  # noqa: N802
        rt = self.rt
        t_start = time.perf_counter()
        rid = request.request_id or f"req-{id(request):x}"
        limit = prompt_token_limit(rt.settings.max_prompt_tokens, rt.runner.max_model_len)
        tokens = validate_tokens(request.token_ids, vocab_size=rt.runner.vocab_size, max_tokens=limit)
        params = convert.sampling(request.sampling)
        ns = rt.namespace(request.cache_salt)
        block_size = rt.runner.layout.block_size
        hashes = hash_blocks(ns, tokens, block_size)
        with self._queue_lock:
            self._queue_len += 1
        try:
            # the load runs outside the model lock: a pull overlaps the forwards of the requests ahead
            loaded = rt.connector.load_prefix(
                ns, tokens, hashes, count_hit=True, request_id=rid, use_cache=request.use_cache
            )
            stats = loaded.stats
            with rt.model_lock:
                t_compute = time.perf_counter()
                logits, full = rt.compute_prompt(tokens, loaded)
                first = _sample(logits, params)
                compute_s = time.perf_counter() - t_compute
        finally:
            with self._queue_lock:
                self._queue_len -= 1
        self.num_requests += 1
        ttft_s = time.perf_counter() - t_start
        rt.metrics.observe_request(
            num_prompt_tokens=len(tokens),
            num_reused_tokens=stats.num_reused_tokens,
            num_pulled_tokens=stats.num_pulled_tokens,
            decision=stats.decision,
            pulled_bytes=stats.pulled_bytes,
            pull_s=stats.pull_s,
            latency_s=ttft_s,
        )
        log.info(
            "[%s] prompt=%d reused=%d (%s) ttft=%.3fs",
            rid,
            len(tokens),
            stats.num_reused_tokens,
            stats.decision,
            ttft_s,
        )
        yield pb.PrefillEvent(
            first_token=pb.PrefillFirstToken(
                token_id=first,
                block_hashes=list(hashes),
                stats=pb.PrefillStats(
                    num_prompt_tokens=len(tokens),
                    num_matched_tokens=stats.num_matched_tokens,
                    num_reused_tokens=stats.num_reused_tokens,
                    num_pulled_tokens=stats.num_pulled_tokens,
                    num_local_tokens=stats.num_local_tokens,
                    pulled_bytes=stats.pulled_bytes,
                    decision=stats.decision,
                    match_s=stats.match_s,
                    pull_s=stats.pull_s,
                    compute_s=compute_s,
                    ttft_s=ttft_s,
                    predicted_pull_s=stats.predicted_pull_s,
                    predicted_recompute_s=stats.predicted_recompute_s,
                    predicted_compute_s=stats.predicted_compute_s,
                    num_failed_blocks=stats.num_failed_blocks,
                ),
            )
        )
        rt.connector.keep_pulled(ns, loaded)
        yield pb.PrefillEvent(published=self._publish(request, ns, hashes, full, loaded, rid))

    def _publish(
        self,
        request: pb.PrefillRequest,
        ns: bytes,
        hashes: Sequence[bytes],
        full: KVPrefix,
        loaded: LoadedPrefix,
        rid: str,
    ) -> pb.PrefillPublished:
        """Publish the full blocks the pool does not hold yet (off the TTFT path), under the flush epoch
        the load began with."""
        stats, flush_epoch = loaded.stats, loaded.flush_epoch
        if not request.publish or not hashes:
            return pb.PrefillPublished(status="skipped")
        rt = self.rt
        start = stats.num_pool_blocks if request.use_cache else 0
        t0 = time.perf_counter()
        try:
            blocks = rt.runner.blocks_from_prefix(full, start, len(hashes))
            bs = rt.runner.layout.block_size
            cost = [rt.recompute.t_recompute_s(bs, i * bs) for i in range(start, len(hashes))]
            committed, existing = rt.connector.publish(
                ns,
                hashes,
                blocks,
                start_block=start,
                recompute_cost_s=cost,
                request_id=rid,
                flush_epoch=flush_epoch,
            )
        except Exception as exc:  # noqa: BLE001 - publish failure never fails the request
            log.warning("[%s] publish failed: %s", rid, exc)
            return pb.PrefillPublished(
                status="publish_failed", error=str(exc), publish_s=time.perf_counter() - t0
            )
        return pb.PrefillPublished(
            status="committed",
            num_blocks=committed,
            num_existing=existing + start,
            publish_s=time.perf_counter() - t0,
        )


def _sample(logits: torch.Tensor, params: SamplingParams) -> int:
    from kvpool.model import sample_next

    return sample_next(logits, params, make_step_generator(params, 0))
