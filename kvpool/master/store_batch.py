"""Store orders of concurrent publishes coalesced into one call per store (`StoreCalls.reserve` / `commit`).

Each publish (Reserve, Commit) orders its slots on a few stores. With many writers at once, their orders to
the same store are sent as one `ReserveSlots` / `CommitSlots` call: a caller that finds no call of its
kind in flight to that store sends at once (alone: no added latency when idle); callers that arrive while
one is in flight queue, and when it returns the first of them sends everything queued as one call (group
commit). Each caller gets its own answer: a combined reserve that the store refuses (all or none) is sent
again per caller, so one publish's bad slot never fails another's; a call that fails for the store
(`Unavailable`, a deadline) fails every caller in it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")  # one caller's orders (a sequence)
R = TypeVar("R")  # one call's answer


@dataclass
class _Entry(Generic[T]):
    items: Sequence[T]
    done: threading.Event = field(default_factory=threading.Event)
    lead: bool = False  # woken to send the queue, not with an answer
    result: Any = None
    error: BaseException | None = None


@dataclass
class _Queue(Generic[T]):
    waiting: list[_Entry[T]] = field(default_factory=list)
    busy: bool = False


class Coalescer(Generic[T, R]):
    """`call(key, items)` = `send(key, items)`, with concurrent calls of the same key sent as one:
    `send(key, a + b + ...)`, whose answer each of them gets. `alone(exc)`: whether a combined call that raised `exc` is sent again per caller (it may
    have been one caller's items that failed it). Thread-safe."""

    def __init__(
        self,
        send: Callable[[Hashable, list[T]], R],
        *,
        alone: Callable[[BaseException], bool] = lambda _exc: False,
        max_items: int = 8192,
    ) -> None:
        self._send = send
        self._alone = alone
        self._max_items = max_items
        self._lock = threading.Lock()
        self._queues: dict[Hashable, _Queue[T]] = {}
        self.calls = 0
        self.batched_calls = 0  # calls that carried more than one caller's orders

    def call(self, key: Hashable, items: Sequence[T]) -> R:
        me: _Entry[T] = _Entry(items)
        with self._lock:
            q = self._queues.setdefault(key, _Queue())
            if q.busy:
                q.waiting.append(me)
                batch = None
            else:
                q.busy = True
                batch = [me]
        if batch is None:
            me.done.wait()
            if not me.lead:
                return self._answer(me)
            batch = self._take(key, me)
        try:
            self._run(key, batch)
        finally:
            self._hand_off(key)
        return self._answer(me)

    def _take(self, key: Hashable, me: _Entry[T]) -> list[_Entry[T]]:
        """The queue's entries up to `max_items` items (`me` first), as the sender's next batch."""
        me.lead = False
        me.done.clear()
        with self._lock:
            q = self._queues[key]
            batch, n = [me], len(me.items)
            rest = [e for e in q.waiting if e is not me]
            i = 0
            while i < len(rest) and n + len(rest[i].items) <= self._max_items:
                n += len(rest[i].items)
                batch.append(rest[i])
                i += 1
            q.waiting = rest[i:]
        return batch

    def _hand_off(self, key: Hashable) -> None:
        """After a send: wake the first queued caller to send the rest, or mark the store idle."""
        with self._lock:
            q = self._queues[key]
            if not q.waiting:
                q.busy = False
                return
            nxt = q.waiting[0]
        nxt.lead = True
        nxt.done.set()

    def _run(self, key: Hashable, batch: list[_Entry[T]]) -> None:
        with self._lock:  # senders of different keys run at once
            self.calls += 1
            self.batched_calls += len(batch) > 1
        if len(batch) == 1:
            self._one(key, batch[0])
            return
        combined = [x for e in batch for x in e.items]
        try:
            result = self._send(key, combined)
        except BaseException as exc:  # noqa: BLE001 - handed to each caller, or each sent alone
            if self._alone(exc):
                for e in batch:
                    self._one(key, e)
                return
            for e in batch:
                e.error, e.result = exc, None
                e.done.set()
            return
        for e in batch:
            e.error, e.result = None, result
            e.done.set()

    def _one(self, key: Hashable, e: _Entry[T]) -> None:
        try:
            e.result, e.error = self._send(key, list(e.items)), None
        except BaseException as exc:  # noqa: BLE001 - raised in its caller's thread
            e.result, e.error = None, exc
        e.done.set()

    @staticmethod
    def _answer(e: _Entry[T]) -> Any:
        if e.error is not None:
            raise e.error
        return e.result
