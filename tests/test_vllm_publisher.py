"""`kvpool.vllm.publisher.Publisher` over a fake connector: order, the memory bound, broken chains, drain."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest

from kvpool.connector.connector import KVConnector
from kvpool.errors import TransferError
from kvpool.vllm.publisher import Publisher, PublishJob

ROW = 64  # bytes of one fake block


@dataclass
class Call:
    request_id: str
    ns: bytes
    hashes: list[bytes]
    blocks: list[np.ndarray]
    start_block: int
    flush_epoch: int | None


@dataclass
class FakeConnector:
    """Records every `publish`; a (request_id, start_block) in `fail` raises, one in `gates` waits on its
    Event first (and sets `entered[...]` when it starts waiting)."""

    calls: list[Call] = field(default_factory=list)
    fail: set[tuple[str, int]] = field(default_factory=set)
    gates: dict[tuple[str, int], threading.Event] = field(default_factory=dict)
    entered: dict[tuple[str, int], threading.Event] = field(default_factory=dict)

    def gate(self, request_id: str, start_block: int) -> tuple[threading.Event, threading.Event]:
        key = (request_id, start_block)
        self.gates[key], self.entered[key] = threading.Event(), threading.Event()
        return self.gates[key], self.entered[key]

    def publish(
        self,
        ns: bytes,
        hashes: list[bytes],
        blocks: list[np.ndarray],
        *,
        start_block: int,
        request_id: str,
        flush_epoch: int | None,
    ) -> tuple[int, int]:
        key = (request_id, start_block)
        if key in self.gates:
            self.entered[key].set()
            assert self.gates[key].wait(10), f"gate {key} never opened"
        self.calls.append(Call(request_id, ns, list(hashes), list(blocks), start_block, flush_epoch))
        if key in self.fail:
            raise TransferError(f"publish of {key} failed")
        return len(blocks) - 1, 1  # the first block of each job "already present", the rest committed

    def published(self) -> list[tuple[str, int]]:
        return [(c.request_id, c.start_block) for c in self.calls]


def job(request_id: str, start_block: int, n: int = 2, *, fill: int = 0, epoch: int | None = 3) -> PublishJob:
    hashes = [bytes([i]) * 16 for i in range(start_block + n)]
    blocks = np.full((n, ROW), fill, dtype=np.uint8)
    blocks[:, 0] = np.arange(n, dtype=np.uint8)
    return PublishJob(
        request_id=request_id,
        ns=b"ns-" + request_id.encode(),
        hashes=hashes,
        start_block=start_block,
        blocks=blocks,
        flush_epoch=epoch,
    )


@pytest.fixture
def fake() -> FakeConnector:
    return FakeConnector()


@pytest.fixture
def make(fake: FakeConnector) -> Iterator[Any]:
    made: list[Publisher] = []

    def _make(max_bytes: int = 1 << 20) -> Publisher:
        p = Publisher(cast(KVConnector, fake), max_bytes=max_bytes)
        made.append(p)
        return p

    yield _make
    for gate in fake.gates.values():
        gate.set()
    for p in made:
        p.close(timeout_s=5.0)


def test_jobs_are_published_in_submission_order(fake: FakeConnector, make: Any) -> None:
    pub = make()
    jobs = [job("a", 0, fill=1), job("b", 0, fill=2), job("a", 2, fill=3), job("b", 2, 3), job("a", 4, 1)]
    assert all(pub.submit(j) for j in jobs)
    assert pub.flush(10.0)
    assert fake.published() == [("a", 0), ("b", 0), ("a", 2), ("b", 2), ("a", 4)]
    for j, c in zip(jobs, fake.calls, strict=True):
        assert (c.ns, c.hashes, c.flush_epoch) == (j.ns, j.hashes, j.flush_epoch)
        assert len(c.blocks) == len(j.blocks)  # one row per block, the job's bytes
        assert all(np.array_equal(got, want) for got, want in zip(c.blocks, j.blocks, strict=True))
    c = pub.counters
    assert (c.num_jobs, c.num_committed_blocks, c.num_existing_blocks) == (5, 1 + 1 + 1 + 2 + 0, 5)
    assert (c.num_failed_jobs, c.num_dropped_jobs) == (0, 0)
    assert pub.pending_bytes == 0


def test_the_memory_bound_drops_a_job_and_counts_it(fake: FakeConnector, make: Any) -> None:
    pub = make(max_bytes=3 * 2 * ROW)  # three 2-block jobs
    gate, entered = fake.gate("a", 0)
    assert pub.submit(job("a", 0))
    assert entered.wait(10)  # in flight: its bytes still count
    assert pub.submit(job("b", 0))
    assert pub.submit(job("c", 0))
    assert pub.pending_bytes == 3 * 2 * ROW
    assert not pub.submit(job("d", 0, n=1))  # one more block does not fit
    assert pub.counters.num_dropped_jobs == 1
    assert pub.pending_bytes == 3 * 2 * ROW

    gate.set()
    assert pub.flush(10.0)
    assert fake.published() == [("a", 0), ("b", 0), ("c", 0)]
    assert pub.pending_bytes == 0
    assert pub.submit(job("e", 0))  # room again
    assert pub.flush(10.0)
    assert fake.published()[-1] == ("e", 0)


def test_a_job_larger_than_the_bound_is_dropped(fake: FakeConnector, make: Any) -> None:
    pub = make(max_bytes=ROW)
    assert not pub.submit(job("a", 0, n=2))
    assert pub.submit(job("b", 0, n=1))
    assert pub.flush(10.0)
    assert fake.published() == [("b", 0)]
    assert pub.counters.num_dropped_jobs == 1


def test_after_a_dropped_job_the_requests_later_jobs_are_dropped(fake: FakeConnector, make: Any) -> None:
    pub = make(max_bytes=2 * ROW)
    gate, entered = fake.gate("other", 0)
    assert pub.submit(job("other", 0))
    assert entered.wait(10)
    assert not pub.submit(job("a", 0))  # memory: dropped
    gate.set()
    assert pub.flush(10.0)

    assert not pub.submit(job("a", 2))  # room now, but its parent block 1 was never published
    assert not pub.submit(job("a", 4))
    assert pub.submit(job("b", 0))  # other requests are not affected
    assert pub.flush(10.0)
    assert fake.published() == [("other", 0), ("b", 0)]
    assert pub.counters.num_dropped_jobs == 3

    pub.forget("a")  # the request is gone: a new request with the same id starts clean
    assert pub.submit(job("a", 0))
    assert pub.flush(10.0)
    assert fake.published()[-1] == ("a", 0)


def test_after_a_failed_job_the_requests_later_jobs_are_dropped(fake: FakeConnector, make: Any) -> None:
    pub = make()
    fake.fail.add(("a", 0))
    assert pub.submit(job("a", 0))
    assert pub.submit(job("b", 0))
    assert pub.flush(10.0)
    assert pub.counters.num_failed_jobs == 1
    assert pub.counters.num_jobs == 1  # b's
    assert pub.pending_bytes == 0

    assert not pub.submit(job("a", 2))
    assert pub.submit(job("b", 2))
    assert pub.flush(10.0)
    assert fake.published() == [("a", 0), ("b", 0), ("b", 2)]
    assert pub.counters.num_dropped_jobs == 1


def test_a_job_queued_behind_a_failing_one_of_its_request_is_not_published(
    fake: FakeConnector, make: Any
) -> None:
    pub = make()
    fake.fail.add(("a", 0))
    gate, entered = fake.gate("a", 0)
    assert pub.submit(job("a", 0))
    assert entered.wait(10)
    assert pub.submit(job("a", 2))  # queued while its parent is still being published
    assert pub.submit(job("b", 0))
    gate.set()  # the parent's publish fails
    assert pub.flush(10.0)
    assert fake.published() == [("a", 0), ("b", 0)]


def test_flush_waits_for_queued_jobs_and_times_out(fake: FakeConnector, make: Any) -> None:
    pub = make()
    gate, entered = fake.gate("a", 0)
    for k in range(3):
        assert pub.submit(job("a", 2 * k))
    assert entered.wait(10)
    t0 = time.monotonic()
    assert not pub.flush(0.2)
    assert 0.15 < time.monotonic() - t0 < 5
    assert fake.published() == []
    gate.set()
    assert pub.flush(10.0)
    assert fake.published() == [("a", 0), ("a", 2), ("a", 4)]
    assert pub.flush(0.0)  # nothing waiting


def test_close_drains_the_queue_then_stops(fake: FakeConnector, make: Any) -> None:
    pub = make()
    gate, entered = fake.gate("a", 0)
    for k in range(4):
        assert pub.submit(job("a", 2 * k))
    assert entered.wait(10)
    threading.Timer(0.3, gate.set).start()
    pub.close(timeout_s=10.0)
    assert fake.published() == [("a", 0), ("a", 2), ("a", 4), ("a", 6)]
    assert pub.counters.num_jobs == 4
    assert pub.pending_bytes == 0
    assert not pub._thread.is_alive()


def test_close_is_bounded_when_a_publish_hangs(fake: FakeConnector, make: Any) -> None:
    pub = make()
    gate, entered = fake.gate("a", 0)
    assert pub.submit(job("a", 0))
    assert pub.submit(job("a", 2))
    assert entered.wait(10)
    t0 = time.monotonic()
    pub.close(timeout_s=0.3)  # flush for 0.3 s, then at most 1 s for the thread
    assert time.monotonic() - t0 < 6.5  # 5x those 1.3 s; a close that waits for the hung publish never ends
    gate.set()
