"""`kvpool admin` against a real master and real store processes, run as a user runs it: a subprocess whose
stdout is a pipe (no terminal)."""

from __future__ import annotations

import datetime as dt
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvpool.client import MasterClient
from kvpool.master.procs import LAYOUT, Proc, start_master, start_store
from tests.capabilities import mark, ucx_missing
from tests.test_master_cluster import wait_stores

transfer = pytest.importorskip("transfer")
pytestmark = mark("ucx", ucx_missing())

LONG_ID = "store-with-a-node-id-far-longer-than-an-80-column-table-cell-" + "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[Proc, dict[str, Proc]]]:
    """A master (60 s heartbeat timeout: nothing dies on its own here) and three stores; `gone` is stopped
    gracefully, so it is registered and dead."""
    master = start_master("--heartbeat-timeout-ms", "60000")
    stores: dict[str, Proc] = {}
    try:
        for node_id in ("s0", LONG_ID, "gone"):
            stores[node_id] = start_store(master.grpc_address, node_id)
        wait_stores(master.grpc_address, 3)
        stores["gone"].kill(signal.SIGTERM)  # deregisters: dead at once
        with MasterClient(master.grpc_address) as c:
            assert {n.node.node_id: n.alive for n in c.list_nodes()}["gone"] is False
        yield master, stores
    finally:
        for s in stores.values():
            s.kill()
        master.kill()


def admin(master: Proc, *args: str) -> str:
    """`kvpool admin ARGS` with stdout a pipe, as in `kvpool admin nodes | grep ...` or `> file`."""
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", master.grpc_address, *args],
        capture_output=True, stdin=subprocess.DEVNULL, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def table_values(text: str) -> dict[str, str]:
    """`key │ value` rows of a `_kv` table."""
    rows = (re.match(r"^│ (\S+)\s+│ (.*?)\s+│$", line) for line in text.splitlines())
    return {m[1]: m[2] for m in rows if m}


def test_admin_status_counts_live_stores_apart_from_dead_ones(pool) -> None:
    """Found by a new-user pass: `store_nodes` counted a deregistered store next to `nodes_alive` (and the
    capacity it sits by counts live stores only). `stores_alive` and `stores` (all registered) now, the
    same in the table and in --json."""
    master, stores = pool
    status = json.loads(admin(master, "status", "--json"))
    assert (status["nodes_alive"], status["nodes"]) == (2, 3)
    assert (status["stores_alive"], status["stores"]) == (2, 3)
    live = [stores["s0"], stores[LONG_ID]]
    assert status["capacity_bytes"] == sum(s.ready["num_slots"] * s.ready["block_nbytes"] for s in live)
    table = table_values(admin(master, "status"))
    keys = ("nodes_alive", "nodes", "stores_alive", "stores", "capacity_bytes")
    assert {k: table[k] for k in keys} == {k: str(status[k]) for k in keys}


def test_admin_tables_piped_keep_every_value_whole(pool) -> None:
    """Found by a new-user pass: piped or redirected, rich assumed 80 columns and cut cells with '…'
    (`kvpool admin nodes | cat` showed `store…` and `127.0…`)."""
    master, _ = pool
    out = admin(master, "nodes")
    assert "…" not in out
    with MasterClient(master.grpc_address) as c:
        nodes = c.list_nodes()
    assert len(nodes) == 3
    for n in nodes:  # each node's row holds its id and both its addresses, whole
        row = next(line for line in out.splitlines() if f"│ {n.node.node_id} " in line)
        assert f" {n.node.grpc_address} " in row and f" {n.node.data_address} " in row
    assert LONG_ID in out
    status = admin(master, "status")
    assert "…" not in status and table_values(status)["master"] == master.grpc_address


def test_admin_namespaces_lists_the_digests_to_invalidate(pool) -> None:
    """A new-user pass could not find the router's namespace for `admin invalidate --namespace HEX`: no log
    or admin command showed a digest."""
    master, _ = pool
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("listed-model", "v7", LAYOUT)
    rows = json.loads(admin(master, "namespaces", "--json"))
    mine = [r for r in rows if r["model_id"] == "listed-model"]
    assert mine == [
        {
            "namespace": ns.hex(),
            "model_id": "listed-model",
            "weights_version": "v7",
            "active": True,
            "num_blocks": 0,
        }
    ], rows
    assert ns.hex() in admin(master, "namespaces")  # the table (piped) shows the whole digest


def test_a_dead_store_shows_unknown_slots_and_status_names_it_degraded(pool) -> None:
    """Issue #29: `admin nodes` showed a dead store's last used/slots as if current. Now they are
    unknown (table) or null (--json), each node says how long ago the master last heard from it, and
    `admin status` is "degraded" naming the dead store and since when."""
    master, _ = pool
    rows = {r["node"]["node_id"]: r for r in json.loads(admin(master, "nodes", "--json"))}
    gone, live = rows["gone"], rows["s0"]
    assert gone["alive"] is False and gone["num_slots"] is None and gone["num_used_slots"] is None
    assert live["alive"] is True and live["num_slots"] > 0 and live["silent_s"] < 10
    table = admin(master, "nodes")
    row = next(line for line in table.splitlines() if "│ gone " in line)
    assert "unknown" in row and "/" not in row.split("│")[7], row  # the used/slots cell
    live_row = next(line for line in table.splitlines() if "│ s0 " in line)
    assert f"0/{live['num_slots']}" in live_row, live_row

    status = json.loads(admin(master, "status", "--json"))
    assert status["status"] == "degraded", status
    (part,) = status["degraded"]
    assert part["part"] == "store gone" and "dead" in part["reason"], part
    # as long as `admin nodes` said a moment ago (one admin call later), and since = now - for_s
    assert part["for_s"] == pytest.approx(gone["silent_s"], abs=5.0), (part, gone)
    since_s = dt.datetime.fromisoformat(part["since"].replace("Z", "+00:00")).timestamp()
    assert part["since"].endswith("Z") and abs(time.time() - part["for_s"] - since_s) < 5.0, part
    text = admin(master, "status")
    assert table_values(text)["status"] == "degraded" and "store gone" in text
