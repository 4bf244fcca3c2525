"""The decode node's gRPC service: `Decode(handoff) → stream of tokens`, batched per decode step."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from decode_node.scheduler import DecodeJob, DecodeScheduler, is_done
from kvpool.client import convert
from kvpool.errors import InvalidArgument
from kvpool.hashing import hash_blocks
from kvpool.prompt import check_context, prompt_token_limit, validate_tokens
from kvpool.rpc.status import rpc_errors
from kvpool.serving.runtime import NodeRuntime
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DecodeService(pb_grpc.DecodeServicer):
    def __init__(self, rt: NodeRuntime, scheduler: DecodeScheduler) -> None:
        self.rt = rt
        self.scheduler = scheduler

    @rpc_errors
    def GetInfo(self, request: pb.GetInfoRequest, context: grpc.ServicerContext) -> pb.GetInfoResponse:  # noqa: N802
        """Who this node is (id, role, address, epoch): the master asks before another process may take
        over its node id."""
        return self.rt.info()

    @rpc_errors
    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext) -> Iterator[pb.DecodeEvent]:  # noqa: N802
        rt = self.rt
        prompt = validate_tokens(
            request.token_ids,
            vocab_size=rt.runner.vocab_size,
            max_tokens=prompt_token_limit(rt.settings.max_prompt_tokens, rt.runner.max_model_len),
        )
        if request.first_token >= rt.runner.vocab_size:
            raise InvalidArgument(f"first_token {request.first_token} is outside the vocabulary")
        params = convert.sampling(request.sampling)
        check_context(len(prompt), params.max_tokens, rt.runner.max_model_len)
        ns = rt.namespace(request.cache_salt)
        hashes = hash_blocks(ns, prompt, rt.runner.layout.block_size)  # once: the scheduler loads with them
        if request.block_hashes and list(request.block_hashes) != hashes:
            raise InvalidArgument("block_hashes do not match the prompt under this node's namespace")
        job = DecodeJob(
            request_id=request.request_id or f"dec-{id(request):x}",
            ns=ns,
            prompt=prompt,
            hashes=hashes,
            first_token=int(request.first_token),
            params=params,
            prompt_committed=request.prompt_committed,
            publish=request.publish,
            use_cache=request.use_cache,
        )
        context.add_callback(job.cancelled.set)  # the caller hung up or the deadline passed
        self.scheduler.submit(job)
        while True:
            item = job.out.get()
            if is_done(item):
                break
            if not context.is_active():
                job.cancelled.set()
                break
            yield pb.DecodeEvent(token_ids=item)
        if job.error is not None:
            raise job.error
        s = job.stats
        rt.metrics.observe_request(
            num_prompt_tokens=len(prompt),
            num_reused_tokens=s.num_reused_tokens,
            num_pulled_tokens=s.num_pulled_tokens,
            decision=s.decision,
            pulled_bytes=s.pulled_bytes,
            pull_s=s.pull_s,
            latency_s=s.tpot_s,
        )
        yield pb.DecodeEvent(
            finished=True,
            stats=pb.DecodeStats(
                num_prompt_tokens=len(prompt),
                num_reused_tokens=s.num_reused_tokens,
                num_pulled_tokens=s.num_pulled_tokens,
                pulled_bytes=s.pulled_bytes,
                decision=s.decision,
                load_s=s.load_s,
                decode_s=s.decode_s,
                num_generated=s.num_generated,
                finish_reason=s.finish_reason,
            ),
        )
