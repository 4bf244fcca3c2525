"""`kvpool.client.MasterLink`, the one link every role keeps to the master: against real masters on
127.0.0.1 (in-process gRPC servers), a master restarted from nothing on its address hears the node register
again with its namespaces; with "a,b" and `a` down the link joins `b`; a heartbeat that failed gives its
report back; a graceful stop deregisters; a link started before its master registers when it answers, and
a registration refused for good stops it (`on_fatal`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import pytest

from kvpool.client import HeartbeatReport, MasterClient, MasterLink, NodeInfo
from kvpool.client.master_link import new_epoch
from kvpool.errors import FailedPrecondition, Unavailable
from kvpool.hashing import Namespace
from kvpool.master.server import MasterServer, serve
from kvpool.master.settings import MasterSettings
from kvpool.types import DEFAULT_LAYOUT, KVLayout

OTHER_LAYOUT = "kv1:float32:b16:l2:h2:d16"


def _master(port: int = 0) -> MasterServer:
    return serve(MasterSettings(port=port, bind_host="127.0.0.1", metrics=False, heartbeat_interval_ms=100))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _alive(address: str) -> dict[str, bool]:
    """Node id -> alive, as the master at `address` lists them ({} while it cannot be reached)."""
    try:
        with MasterClient(address) as mc:
            return {n.node.node_id: n.alive for n in mc.list_nodes()}
    except Unavailable:  # a master just started: the channel may still be backing off
        return {}


def test_a_restarted_master_hears_the_node_and_its_namespaces_again() -> None:
    master = _master()
    address, port = master.address, int(master.address.rsplit(":", 1)[1])
    reconnects = threading.Event()
    client = MasterClient(address, timeout_s=2.0)
    link = MasterLink(
        client,
        NodeInfo("p-link", "prefill", "127.0.0.1:9", "", new_epoch()),
        layout_fingerprint=DEFAULT_LAYOUT,
        report=lambda: HeartbeatReport(),
        on_reconnect=reconnects.set,
    )
    ns = Namespace(model_id="m-link", weights_version="v1", layout=KVLayout.from_fingerprint(DEFAULT_LAYOUT))
    try:
        link.start()
        digest = link.namespaces.namespace(ns)
        assert link.registered and link.heartbeat_interval_s == 0.1 and _alive(address) == {"p-link": True}
        master.stop()  # a master restarted from nothing on its address knows neither the node nor `ns`
        master = _master(port)
        assert _wait(lambda: _alive(address).get("p-link", False)), "the node never registered again"
        assert reconnects.wait(5)
        assert _wait(lambda: master.master.namespaces.is_known(digest)), "its namespace never came back"
    finally:
        link.stop()
        client.close()
    assert _alive(address) == {"p-link": False}  # deregistered on stop, not left to time out
    master.stop()


def test_a_link_to_masters_a_and_b_joins_b_when_a_is_down_and_gives_back_unsent_reports() -> None:
    master = _master()
    down = f"127.0.0.1:{_free_port()}"
    unsent: list[HeartbeatReport] = []
    report = HeartbeatReport(num_used_slots=0)
    client = MasterClient(f"{down},{master.address}", timeout_s=2.0)
    link = MasterLink(
        client,
        NodeInfo("d-link", "decode", "127.0.0.1:9", "", new_epoch()),
        layout_fingerprint=DEFAULT_LAYOUT,
        report=lambda: report,
        on_unsent=unsent.append,
    )
    try:
        link.start()
        assert link.address == master.address and _alive(master.address) == {"d-link": True}
        assert _wait(lambda: link.num_heartbeats >= 2) and not unsent
        master.stop()  # the heartbeats fail now: each gives its report back
        assert _wait(lambda: len(unsent) >= 1) and unsent[0] is report
    finally:
        link.stop()
        client.close()


def test_a_link_started_before_its_master_registers_when_it_answers_and_a_refusal_is_fatal() -> None:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    fatal: list[str] = []
    client = MasterClient(address, timeout_s=2.0)
    node = NodeInfo("e-link", "vllm", "", "", new_epoch(), "http://127.0.0.1:8100")
    early = MasterLink(client, node, layout_fingerprint=DEFAULT_LAYOUT)
    with pytest.raises(Unavailable):  # a serving node needs its master at start
        early.start()
    link = MasterLink(client, node, layout_fingerprint=DEFAULT_LAYOUT, on_fatal=fatal.append)
    master = None
    try:
        link.start(require_master=False)  # an engine or a store starts first and registers later
        assert not link.registered
        master = _master(port)
        assert _wait(lambda: _alive(address).get("e-link", False)) and link.registered
        master.stop()  # a master of another layout: registering again is refused for good
        master = serve(MasterSettings(port=port, bind_host="127.0.0.1", metrics=False, layout=OTHER_LAYOUT))
        assert _wait(lambda: bool(fatal)), "a refused registration never reached on_fatal"
        assert fatal[0].startswith("FailedPrecondition") and isinstance(link.refusal, FailedPrecondition)
        assert "e-link" not in _alive(address)
    finally:
        link.stop()
        client.close()
        if master is not None:
            master.stop()
