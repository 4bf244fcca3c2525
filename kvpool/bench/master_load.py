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
from typing import Any

_STREAM = "/kvpool.v1.Master/MatchPrefixStream"
_UNARY = "/kvpool.v1.Master/MatchPrefix"


def lean_client(
    address: str,
    requests: Sequence[bytes],
    want: int,
    k: int,
    clients: int,
    unary: bool,
    depth: int,
    ready: Any,
    go: Any,
    duration_s: float,
    out: Any,
) -> None:
    """One client process: matches `requests` round-robin (starting at `k`, step `clients`) for
    `duration_s` after `go`; puts (k, latencies in s, number of answers that did not match `want` blocks)."""
    out.put(asyncio.run(_run(address, requests, want, k, clients, unary, depth, ready, go, duration_s)))


async def _run(
    address: str,
    requests: Sequence[bytes],
    want: int,
    k: int,
    clients: int,
    unary: bool,
    depth: int,
    ready: Any,
    go: Any,
    duration_s: float,
) -> tuple[int, list[float], int]:
    import grpc

    from kvpool.v1 import kvpool_pb2 as pb

    lat: list[float] = []
    short = 0
    async with grpc.aio.insecure_channel(address) as ch:
        if unary:
            call = ch.unary_unary(_UNARY, request_serializer=None, response_deserializer=None)
            await call(requests[0])
        else:
            stream = ch.stream_stream(_STREAM, request_serializer=None, response_deserializer=None)()
            await stream.write(requests[0])
            await stream.read()
        ready.release()
        while not go.is_set():
            await asyncio.sleep(0.001)
        stop_at = time.perf_counter() + duration_s
        i = k
        sent: deque[float] = deque()
        while True:
            more = time.perf_counter() < stop_at
            if not more and not sent:
                break
            if unary:
                t0 = time.perf_counter()
                raw = await call(requests[i % len(requests)])
                lat.append(time.perf_counter() - t0)
                i += clients
            else:
                while more and len(sent) < depth:
                    sent.append(time.perf_counter())
                    await stream.write(requests[i % len(requests)])
                    i += clients
                raw = await stream.read()
                lat.append(time.perf_counter() - sent.popleft())
            short += pb.MatchPrefixResponse.FromString(raw).num_matched != want
        if not unary:
            await stream.done_writing()
    return k, lat, short
