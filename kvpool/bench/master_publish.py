"""Publishing without bytes for `kvpool bench master`: Reserve + Commit through the master's gRPC service
against `kvpool store --metadata-only` stores (a commit needs no write there; reads and writes are
refused), from several client processes.

Each client is lean (as `master_load`'s): it sends serialized `ReserveRequest`s on a raw unary call and
answers each reservation with a `CommitRequest` naming every reserved location as written, so what bounds
the rate is the master (and its store orders), not the client library. A client publishes its work in
order (a chain's parent is committed before the chain is reserved): `TreeWork` (the trace's tree in some
namespaces, puts cut into chains of at most `chain_blocks`) or `ChainWork` (fresh root chains).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.bench.master_scale_work import TreePuts, block_hash, replica_puts

_RESERVE = "/kvpool.v1.Master/Reserve"
_COMMIT = "/kvpool.v1.Master/Commit"


@dataclass(frozen=True)
class TreeWork:
    """Namespace `ns`'s first `limit` blocks of the tree of `trace`, for each (ns, limit) of `jobs`."""

    trace: Path
    jobs: Sequence[tuple[bytes, int]]

    def chains(self, chain_blocks: int) -> Iterator[tuple[bytes, bytes, list[bytes]]]:
        tree = TreePuts.from_trace(self.trace)
        for ns, limit in self.jobs:
            for put in replica_puts(tree, ns, limit):
                parent = put.parent or b""
                for s in range(0, len(put.hashes), chain_blocks):
                    part = put.hashes[s : s + chain_blocks]
                    yield ns, parent, part
                    parent = part[-1]


@dataclass(frozen=True)
class ChainWork:
    """`num` fresh chains in namespace `ns` (trace ids from `tag` << 40: no trace has them), at the root."""

    ns: bytes
    tag: int
    num: int

    def chains(self, chain_blocks: int) -> Iterator[tuple[bytes, bytes, list[bytes]]]:
        base = self.tag << 40
        for c in range(self.num):
            yield (
                self.ns,
                b"",
                [block_hash(self.ns, base + c * chain_blocks + b) for b in range(chain_blocks)],
            )


@dataclass(frozen=True)
class PublishJob:
    address: str
    work: TreeWork | ChainWork
    chain_blocks: int
    replicas: int = 0  # 0: the master's default


def publish_client(job: PublishJob, ready: Any, go: Any, out: Any) -> None:
    """One client process: builds its requests, waits for `go`, publishes them; puts (blocks committed,
    Reserve+Commit pairs, seconds) or an error line."""
    import grpc

    from kvpool.v1 import kvpool_pb2 as pb

    try:
        reqs: Any = (
            pb.ReserveRequest(
                namespace=ns, parent_hash=parent, block_hashes=hashes, num_replicas=job.replicas
            ).SerializeToString()
            for ns, parent, hashes in job.work.chains(job.chain_blocks)
        )
        if isinstance(job.work, ChainWork):  # a measurement: built before the clock starts
            reqs = list(reqs)  # (a fill's work is built as it goes: millions of blocks)
        with grpc.insecure_channel(job.address) as ch:
            reserve = ch.unary_unary(_RESERVE, request_serializer=None, response_deserializer=None)
            commit = ch.unary_unary(_COMMIT, request_serializer=None, response_deserializer=None)
            ready.release()
            go.wait()
            t0 = time.perf_counter()
            committed = calls = 0
            for raw in reqs:
                calls += 1
                r = pb.ReserveResponse.FromString(reserve(raw, timeout=60))
                want = sum(not b.already_present for b in r.blocks)
                if r.reservation_id == 0:
                    continue
                req = pb.CommitRequest(reservation_id=r.reservation_id)
                for b in r.blocks:
                    if not b.already_present:
                        req.blocks.add(block_hash=b.block_hash, written=b.locations)
                done = pb.CommitResponse.FromString(commit(req.SerializeToString(), timeout=60))
                if done.num_committed + done.num_existing < want:
                    raise RuntimeError(f"a commit of {want} blocks committed {done.num_committed}")
                committed += done.num_committed
            out.put((committed, calls, time.perf_counter() - t0))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises
        ready.release()
        out.put(f"error: {type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Published:
    """What `publish` did: `blocks` committed in `calls` Reserve+Commit pairs, `seconds` from the common
    start until the last client finished."""

    blocks: int
    calls: int
    seconds: float

    @property
    def blocks_per_s(self) -> float:
        return round(self.blocks / max(self.seconds, 1e-9), 1)


def publish(
    address: str,
    works: Sequence[TreeWork | ChainWork],
    *,
    chain_blocks: int = 64,
    replicas: int = 0,
    progress: bool = False,
) -> Published:
    """One client process per entry of `works`, all started together. Raises `RuntimeError` when a client
    failed or died."""
    ctx = mp.get_context("spawn")  # no fork: the parent holds gRPC channels
    ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(
            target=publish_client, args=(PublishJob(address, w, chain_blocks, replicas), ready, go, out)
        )
        for w in works
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if not ready.acquire(timeout=600):
                raise RuntimeError("a publish client did not start")
        go.set()
        t0 = time.perf_counter()
        results: list[Any] = []
        while len(results) < len(procs):
            try:
                results.append(out.get(timeout=5.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):  # died without a word (a crash)
                    raise RuntimeError("a publish client died") from None
                continue
            if progress:
                print(f"  publisher done after {time.perf_counter() - t0:.0f} s: {results[-1]}", flush=True)
        seconds = time.perf_counter() - t0
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"publish failed: {errors[0]}")
    return Published(sum(r[0] for r in results), sum(r[1] for r in results), seconds)
