"""A Reserve that arrives while a just-registered store's inventory is being adopted waits for it (a fresh
cluster's first publish was refused RESOURCE_EXHAUSTED when it came in that window: a CI flake)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvpool.master import MasterSettings, serve
from kvpool.master.nodes import NodeRecord
from kvpool.master.publish import ADOPTION_WAIT_S


@pytest.fixture()
def master() -> Iterator[object]:
    server = serve(MasterSettings(port=0, tick_ms=60_000))  # no maintenance tick during the test
    try:
        yield server.master
    finally:
        server.stop()


def _store(m: object, node_id: str, *, ready: bool, failures: int = 0) -> NodeRecord:
    now = m.clock.now_ms()  # type: ignore[attr-defined]
    rec = NodeRecord(node_id, "store", "127.0.0.1:1", "127.0.0.1:2", 1, 16, 1 << 18, now)
    rec.ready, rec.registered_ms, rec.adopt_failures = ready, now, failures
    with m.lock:  # type: ignore[attr-defined]
        m.st.nodes[node_id] = rec  # type: ignore[attr-defined]
    return rec


def _timed_wait(m: object) -> float:
    t0 = time.monotonic()
    m.publisher._await_adoption()  # type: ignore[attr-defined]  # noqa: SLF001
    return time.monotonic() - t0


def test_reserve_waits_for_a_store_being_adopted(master: object) -> None:
    assert _timed_wait(master) < 0.1  # no store at all: nothing to wait for
    rec = _store(master, "s1", ready=False)
    threading.Timer(0.3, lambda: setattr(rec, "ready", True)).start()
    waited = _timed_wait(master)
    assert 0.25 <= waited < ADOPTION_WAIT_S, waited
    assert _timed_wait(master) < 0.1  # a placeable store: no wait


def test_no_wait_for_a_store_whose_inventory_failed_or_that_registered_long_ago(master: object) -> None:
    _store(master, "s1", ready=False, failures=1)
    assert _timed_wait(master) < 0.1
    rec = _store(master, "s2", ready=False)
    rec.registered_ms -= int(ADOPTION_WAIT_S * 1000) + 1
    assert _timed_wait(master) < 0.1


def test_a_dead_node_is_listed_for_its_retention_then_forgotten() -> None:
    """Found by a new-user pass: dead nodes stayed in `admin nodes` (and in `status` counts) forever, and
    stores started with default ids (one per pid) piled up across restarts."""
    server = serve(MasterSettings(port=0, tick_ms=60_000, dead_node_retention_ms=5_000))
    try:
        m = server.master
        now = m.clock.now_ms()
        rec = NodeRecord("p-gone", "prefill", "127.0.0.1:1", "", 1, 0, 1 << 18, now)
        with m.lock:
            m.st.nodes["p-gone"] = rec
        rec.last_seen_ms = now - m.settings.heartbeat_timeout_ms - 1
        server.maintenance.tick()
        assert not m.st.nodes["p-gone"].alive  # dead: still listed, alive=false
        rec.last_seen_ms = m.clock.now_ms() - 4_000
        server.maintenance.tick()
        assert "p-gone" in m.st.nodes  # within the retention
        rec.last_seen_ms = m.clock.now_ms() - 5_001
        server.maintenance.tick()
        assert "p-gone" not in m.st.nodes
    finally:
        server.stop()
