"""The leading master partitioned from etcd with network namespaces (issue #30): it steps down, a standby
leads with a higher epoch, and — checked from the store's side — no store accepts an order from the old
epoch and no slot is allocated twice.

Namespaces (`NamespaceGroup`, bridged, pid-suffixed): 0 etcd; 1 master A (the first leader); 2 master B,
the store and the scenario's driver (`tests/ha_partition_driver.py`, run under `ip netns exec`). The
partition is a blackhole route to etcd's address inside A's namespace: A still reaches the store and B.
Root only, skipped with the reason otherwise (as tests/test_netns_cluster.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.bench.netns import NamespaceGroup
from tests.capabilities import require_etcd, require_netns, require_ucx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]
REPO = Path(__file__).resolve().parent.parent


def test_partitioned_leader_steps_down_and_the_store_refuses_its_epoch(tmp_path: Path) -> None:
    require_netns()
    require_etcd()
    require_ucx()
    with NamespaceGroup(3, prefix=f"kvhp{os.getpid() % 100000}") as g:
        done = subprocess.run(
            [
                *g.exec_args(2),
                *(sys.executable, "-m", "tests.ha_partition_driver"),
                *("--etcd-ns", g.names[0], "--etcd-ip", g.addresses[0]),
                *("--leader-ns", g.names[1], "--leader-ip", g.addresses[1]),
                *("--here-ip", g.addresses[2], "--workdir", str(tmp_path)),
            ],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=REPO,
            env=os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        )
    assert done.returncode == 0, done.stderr[-4000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    e0, e1 = r["epochs"]
    assert e1 > e0  # the standby leads with a higher epoch
    assert r["stepdown_s"] <= 3 + 1  # A deposed within its TTL (3 s) of losing etcd
    assert r["store_epoch_before"] == e0 and r["store_epoch_after"] == e1  # the store took B's orders
    # the deposed leader allocates nothing, and an order at its epoch is refused by the store itself
    assert "not the leader" in r["put_through_a"] or "Unavailable" in r["put_through_a"], r["put_through_a"]
    assert r["stale_order"].startswith("FAILED_PRECONDITION: fenced: epoch"), r["stale_order"]
    assert r["fenced_orders"] >= 1 and not r["stale_slot_in_inventory"]
    # the store's slot table: every committed block once, each in its own slot, bit-exact
    assert r["writer_committed"] >= 20
    assert r["inventory_slots_unique"] and r["inventory_hashes_unique"] and r["committed_in_inventory"]
    assert r["readback_exact"] == r["writer_committed"], r["readback_missed"]
    assert r["a_rejoins_s"] <= 15 and r["b_role_after"] == "leader"  # healed: A stands by
