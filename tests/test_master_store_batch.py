"""`kvpool.master.store_batch.Coalescer`: concurrent store orders to one store go as one call, each caller
gets its own answer, and one caller's refused orders never fail another's."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpool.errors import FailedPrecondition, Unavailable
from kvpool.master.store_batch import Coalescer


class _Store:
    """Records each call; the first blocks until released (so others queue behind it)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Hashable, list[int]]] = []
        self.gate = threading.Event()
        self.first = threading.Event()

    def send(self, key: Hashable, items: list[int]) -> dict[int, str]:
        self.calls.append((key, list(items)))
        if not self.first.is_set():
            self.first.set()
            self.gate.wait(10)
        if key == "down":
            raise Unavailable("store down")
        if -1 in items:
            raise FailedPrecondition("slot -1 refused")
        return {i: "" for i in items}


def _run(c: Coalescer[int, dict[int, str]], store: _Store, key: Hashable, batches: list[list[int]]) -> list:
    out: list = [None] * len(batches)

    def one(k: int) -> None:
        try:
            out[k] = c.call(key, batches[k])
        except Exception as exc:  # noqa: BLE001 - the caller's answer
            out[k] = exc

    with ThreadPoolExecutor(len(batches)) as pool:
        pool.submit(one, 0)
        assert store.first.wait(10)
        rest = [pool.submit(one, k) for k in range(1, len(batches))]
        while sum(len(q.waiting) for q in c._queues.values()) < len(batches) - 1:
            threading.Event().wait(0.005)
        store.gate.set()
        for f in rest:
            f.result(10)
    return out


def test_queued_orders_go_as_one_call_and_each_caller_gets_its_answer() -> None:
    store = _Store()
    c: Coalescer[int, dict[int, str]] = Coalescer(store.send)
    out = _run(c, store, "s0", [[1, 2], [3], [4, 5], [6]])
    assert [call[1] for call in store.calls] == [[1, 2], [3, 4, 5, 6]]  # the queue: one call
    assert all(set(b) <= set(r) for b, r in zip([[1, 2], [3], [4, 5], [6]], out, strict=True))
    assert (c.calls, c.batched_calls) == (2, 1)
    assert c.call("s0", [7]) == {7: ""} and store.calls[-1][1] == [7]  # idle again: sent at once, alone


def test_a_refused_combined_call_is_sent_again_per_caller() -> None:
    store = _Store()
    c: Coalescer[int, dict[int, str]] = Coalescer(
        store.send, alone=lambda exc: not isinstance(exc, Unavailable)
    )
    out = _run(c, store, "s0", [[1], [2], [-1], [3]])
    assert out[1] == {2: ""} and out[3] == {3: ""}
    assert isinstance(out[2], FailedPrecondition) and out[0] == {1: ""}
    assert [call[1] for call in store.calls] == [[1], [2, -1, 3], [2], [-1], [3]]


def test_a_store_failure_fails_every_caller_in_the_call() -> None:
    store = _Store()
    c: Coalescer[int, dict[int, str]] = Coalescer(
        store.send, alone=lambda exc: not isinstance(exc, Unavailable)
    )
    out = _run(c, store, "down", [[1], [2], [3]])
    assert all(isinstance(r, Unavailable) for r in out)
    assert len(store.calls) == 2  # no call per caller after the store failed


def test_a_call_carries_at_most_max_items() -> None:
    store = _Store()
    c: Coalescer[int, dict[int, str]] = Coalescer(store.send, max_items=3)
    _run(c, store, "s0", [[1], [2, 3], [4, 5], [6]])
    assert [call[1] for call in store.calls] == [[1], [2, 3], [4, 5, 6]]
    with pytest.raises(FailedPrecondition):
        c.call("s0", [-1])
