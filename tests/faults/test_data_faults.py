"""Fault suite, data plane (slow): corrupt committed bytes, a slow reader past its lease, requests cancelled
during publish; greedy requests through the router, each checked against a cold reference.

- corrupt: committed blocks are overwritten in the store processes' memory (/proc/<pid>/mem, as a RAM
  fault would); every read of them must fail its checksum (100 % detected), the replica is dropped from
  the index, the request recomputes: 0 wrong tokens, 0 failed requests.
- slow reader: a reader's lease ends (its read capabilities still valid) while the blocks are evicted and
  their slots reused; its late read must be refused by the generation check (`StaleGeneration`), never
  answered with the bytes now in the slot.
- cancel during publish: clients hang up right after their first token, while the prefill node
  publishes; no reservation leaks (all reclaimed within the write lease) and later answers are right.

Root (or ptrace rights over child processes) is needed to write another process's memory.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("torch")

from kvpool.cluster.local import LocalCluster  # noqa: E402
from tests.capabilities import mark, root_missing  # noqa: E402
from tests.faults.common import (  # noqa: E402
    BLOCK,
    DOC_BLOCKS,
    Api,
    Tally,
    corrupt,
    fault_cluster_spec,
    references,
    start_router,
    workload,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def cluster(runner) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    with LocalCluster(fault_cluster_spec(runner, heartbeat_timeout_ms=5000)) as c:
        yield c


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> Iterator[Api]:
    a = Api(start_router(cluster))
    yield a
    a.close()


def _doc_locations(cluster: LocalCluster, runner, prompt: list[int]) -> list[tuple[bytes, object]]:  # type: ignore[no-untyped-def]
    """(block hash, location) of every replica of the prompt's document blocks."""
    from kvpool.client import MasterClient
    from kvpool.hashing import hash_blocks

    ns = runner.namespace().digest()
    hashes = hash_blocks(ns, prompt, BLOCK)[:DOC_BLOCKS]
    with MasterClient(cluster.master_address, timeout_s=5.0) as m:
        match = m.match(ns, hashes)
    return [(hashes[i], loc) for i in range(match.num_matched) for loc in match.replicas[i] if not loc.local]


@mark("root", root_missing())  # writing another process's memory
def test_corrupt_bytes_are_detected_dropped_and_recomputed(cluster: LocalCluster, runner, api: Api) -> None:  # type: ignore[no-untyped-def]
    prompts = workload(60, seed=7, num_docs=6)
    refs = references(runner, prompts)
    eos = runner.eos_token_id
    healthy = api.serve(Tally("healthy"), prompts[:20], refs[:20], eos)
    assert (healthy.failed, healthy.wrong) == (0, 0), healthy.notes
    # corrupt EVERY replica of blocks 2..5 of three documents: no intact copy is left to hit
    stores = {p.name: p for p in cluster.stores}
    corrupted = set()
    for d in range(3):
        for h, loc in _doc_locations(cluster, runner, prompts[d]):
            if h in _doc_hashes(runner, prompts[d])[2:]:
                corrupt(stores[loc.node_id], loc.slot, seed=loc.slot)
                corrupted.add((loc.node_id, loc.slot, loc.generation))
    assert len(corrupted) >= 3 * 4  # 3 docs x 4 blocks x every replica
    t0 = time.perf_counter()
    tally = api.serve(Tally("corrupt bytes (all replicas)"), prompts[20:60], refs[20:60], eos)
    tally.recovery_s = time.perf_counter() - t0
    print(f"\n{tally.row()}")
    assert (tally.failed, tally.wrong) == (0, 0), tally.notes
    # 100 % detected: none of the corrupted replicas is offered any more (the blocks were re-published
    # in fresh slots by the recomputing requests)
    for d in range(3):
        live = {
            (loc.node_id, loc.slot, loc.generation) for _, loc in _doc_locations(cluster, runner, prompts[d])
        }
        assert not (live & corrupted), f"doc {d}: a corrupted replica is still in the index"
    assert tally.hits > 0


def _doc_hashes(runner, prompt: list[int]) -> list[bytes]:  # type: ignore[no-untyped-def]
    from kvpool.hashing import hash_blocks

    return hash_blocks(runner.namespace().digest(), prompt, BLOCK)[:DOC_BLOCKS]


def test_slow_reader_past_its_lease_gets_an_error_not_reused_bytes(
    cluster: LocalCluster, runner, api: Api
) -> None:  # type: ignore[no-untyped-def]
    """The generation check alone (B17): the reader's lease ends (released: as if it expired) while the
    read capability it was granted stays valid for a minute, so the store's capability check passes and
    only the slot's generation stands between the late read and the bytes now in the slot."""
    import numpy as np

    from kvpool.client import MasterClient
    from transfer import BlockRead, UcxTransport

    prompts = workload(30, seed=11, num_docs=5)
    refs = references(runner, prompts)
    eos = runner.eos_token_id
    first = api.serve(Tally("publish"), prompts[:5], refs[:5], eos)
    assert (first.failed, first.wrong) == (0, 0), first.notes
    ns = runner.namespace().digest()
    hashes = _doc_hashes(runner, prompts[0])
    nbytes = runner.layout.block_nbytes
    transport = UcxTransport()
    try:
        with MasterClient(cluster.master_address, timeout_s=5.0) as m:
            match = m.match(ns, hashes, count_hit=False, lease_ttl_ms=60_000)  # capabilities valid 60 s
            assert match.num_matched == DOC_BLOCKS
            reads = [
                (match.data_address(loc.node_id),
                 BlockRead(loc.slot, loc.generation, nbytes, loc.capability, loc.capability_expiry_ms))
                for i in range(DOC_BLOCKS) for loc in match.replicas[i] if not loc.local
            ]  # fmt: skip
            before = []  # each replica's bytes while the lease holds
            for peer, read in reads:
                out = np.zeros(nbytes, dtype=np.uint8)
                res = transport.read_blocks(peer, [read], [memoryview(out)], timeout_s=10)
                assert res[0].ok, res[0].error
                before.append(out)
            m.release_lease(match.lease_id)  # the lease ends; the capabilities do not
            m.evict(1.0)  # every unleased block goes; the slots are freed (generation bumped) and reused
        tally = api.serve(
            Tally("slow reader past lease"), prompts[5:30], refs[5:30], eos
        )  # re-publish: slots reused
        print(f"\n{tally.row()}")
        assert (tally.failed, tally.wrong) == (0, 0), tally.notes
        for (peer, read), old in zip(reads, before, strict=True):
            assert read.expiry_ms > time.time() * 1000 + 10_000  # the capability is valid: not what refuses
            out = np.zeros(nbytes, dtype=np.uint8)
            res = transport.read_blocks(peer, [read], [memoryview(out)], timeout_s=10)
            assert not res[0].ok, f"a read past its lease returned slot {read.slot}'s bytes"
            assert res[0].error.split(":")[0] == "StaleGeneration", res[0].error  # the generation check
            assert not out.any() and old.any()  # not one byte moved
    finally:
        transport.close()


def test_cancel_during_publish_leaks_no_reservation(cluster: LocalCluster, runner, api: Api) -> None:  # type: ignore[no-untyped-def]
    """A store node is frozen (SIGSTOP) so the publishes of new documents hang mid-write; their clients
    hang up after the first token; the store thaws only after the writers gave up (transfer timeout) and
    missed heartbeats. Its late writes must land nowhere visible, reservations must not leak, and every
    later answer must be right."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from kvpool.client import MasterClient

    prompts = workload(44, seed=23, num_docs=11)
    refs = references(runner, prompts)
    eos = runner.eos_token_id

    def hang_up_after_first_chunk(prompt: list[int]) -> int:
        body = {"model": api.model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        with (
            httpx.Client(base_url=api.http.base_url, timeout=60) as h,
            h.stream("POST", "/v1/completions", json=body) as r,
        ):
            assert r.status_code == 200
            for _line in r.iter_lines():
                return 1  # leaving the block closes the connection mid-stream
        return 0

    frozen = cluster.stores[-1]
    frozen.proc.send_signal(signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(4) as pool:
            cancelled = sum(pool.map(hang_up_after_first_chunk, prompts[:4]))
        time.sleep(12.0)  # writers time out (10 s); the frozen node misses its heartbeats
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
    assert cancelled == 4
    t0 = time.perf_counter()
    with MasterClient(cluster.master_address, timeout_s=5.0) as m:
        deadline = time.monotonic() + 90
        while m.stats().num_reserved_blocks and time.monotonic() < deadline:
            time.sleep(0.2)
        assert m.stats().num_reserved_blocks == 0, "reservations of cancelled publishes leaked"
    drained_s = time.perf_counter() - t0
    tally = api.serve(Tally("frozen store + cancel in publish"), prompts[4:], refs[4:], eos)
    tally.recovery_s = drained_s
    print(f"\n{tally.row()}")
    assert (tally.failed, tally.wrong) == (0, 0), tally.notes
    assert tally.hits > 0
    with httpx.Client(base_url=api.http.base_url, timeout=10) as h:
        assert h.get("/health").status_code == 200
