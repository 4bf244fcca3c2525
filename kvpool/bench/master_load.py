"""The lean load generator of `kvpool bench master` (`--client lean`, the default).

Clients share this machine's two cores with the master, so every microsecond a client spends per call is
taken from the master being measured. The library client (`--client api`: `MasterClient`, typed results,
a request queue feeding a gRPC thread) costs ~650-800 us of CPU per 64-block match here, more than the
master's own ~350 us. This generator does what a load tool such as ghz does: each request is serialized
once before the run, sent as raw bytes on a `grpc.aio` stream (or unary call), and each answer is parsed
only to check that it matched every block. The master side is unchanged and sees the same requests.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.rpc.loop import run

_STREAM = "/kvpool.v1.Master/MatchPrefixStream"
_UNARY = "/kvpool.v1.Master/MatchPrefix"


@dataclass(frozen=True)
class LeanJob:
    """One client's work: match `requests` (serialized `MatchPrefixRequest`s) round-robin from index `k`
    in steps of `clients`, each answer expected to match `want` blocks (one count for all, or one per
    request), for `duration_s` seconds."""

    address: str
    requests: Sequence[bytes]
    want: int | Sequence[int]
    k: int
    clients: int
    unary: bool
    depth: int
    duration_s: float


def lean_client(job: LeanJob, ready: Any, go: Any, out: Any) -> None:
    """One client process: after `go`, runs `job`; puts (k, latencies in s, answers short of `want`,
    blocks matched in all)."""
    out.put(run(_run(job, ready, go)))


async def _run(job: LeanJob, ready: Any, go: Any) -> tuple[int, list[float], int, int]:
    import grpc

    from kvpool.v1 import kvpool_pb2 as pb

    lat: list[float] = []
    short = matched = 0
    n = len(job.requests)
    want = [job.want] * n if isinstance(job.want, int) else list(job.want)
    async with grpc.aio.insecure_channel(job.address) as ch:
        if job.unary:
            call = ch.unary_unary(_UNARY, request_serializer=None, response_deserializer=None)
            await call(job.requests[0])
        else:
            stream = ch.stream_stream(_STREAM, request_serializer=None, response_deserializer=None)()
            await stream.write(job.requests[0])
            await stream.read()
        ready.release()
        while not go.is_set():
            await asyncio.sleep(0.001)
        stop_at = time.perf_counter() + job.duration_s
        i = job.k
        sent: deque[float] = deque()
        sent_idx: deque[int] = deque()  # the request of each answer awaited, oldest first
        while True:
            more = time.perf_counter() < stop_at
            if not more and not sent:
                break
            if job.unary:
                t0 = time.perf_counter()
                j = i % n
                raw = await call(job.requests[j])
                lat.append(time.perf_counter() - t0)
                i += job.clients
                sent_idx.append(j)
            else:
                while more and len(sent) < job.depth:
                    sent.append(time.perf_counter())
                    sent_idx.append(i % n)
                    await stream.write(job.requests[i % n])
                    i += job.clients
                raw = await stream.read()
                lat.append(time.perf_counter() - sent.popleft())
            got = pb.MatchPrefixResponse.FromString(raw).num_matched
            matched += got
            short += got != want[sent_idx.popleft()]
        if not job.unary:
            await stream.done_writing()
    return job.k, lat, short, matched
