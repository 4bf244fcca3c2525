"""Fault suite, processes (slow): 200 greedy requests through the router while processes are killed.

Every answer is checked against an in-process cold reference of the same model: a fault may cost time
(recompute), never a wrong token or a lost request. Prints requests, failures, wrong tokens and the
recovery time per fault (`pytest -m slow -s tests/faults`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from kvpool.cluster.local import LocalCluster  # noqa: E402
from tests.faults.common import BLOCK, Api, Tally, fault_cluster_spec, references, start_router, workload  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
NUM_REQUESTS = 200


@pytest.fixture(scope="module")
def cluster(runner) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    with LocalCluster(fault_cluster_spec(runner, heartbeat_timeout_ms=2000)) as c:
        yield c


def test_store_kill_and_master_restart_lose_nothing(cluster: LocalCluster, runner) -> None:  # type: ignore[no-untyped-def]
    from kvpool.client import MasterClient
    from kvpool.hashing import hash_blocks

    prompts = workload(NUM_REQUESTS)
    refs = references(runner, prompts)
    eos = runner.eos_token_id
    api = Api(start_router(cluster))
    report: list[Tally] = []
    try:
        # phase 1: healthy
        t = api.serve(Tally("healthy"), prompts[:60], refs[:60], eos)
        report.append(t)
        assert (t.failed, t.wrong) == (0, 0), t.notes
        # phase 2: kill -9 a store node; replicas=2 keeps every block readable
        cluster.stores[0].kill()
        t0 = time.perf_counter()
        t = api.serve(Tally("store kill -9 (replicas=2)"), prompts[60:120], refs[60:120], eos)
        t.recovery_s = time.perf_counter() - t0
        report.append(t)
        assert (t.failed, t.wrong) == (0, 0), t.notes
        assert t.hits > 0  # the surviving replicas still served hits
        # phase 3: kill -9 the master and restart it from nothing on the same address
        ns = runner.namespace().digest()
        probe = hash_blocks(ns, prompts[119], BLOCK)[:6]
        t0 = time.perf_counter()
        cluster.restart_master(kill=True)
        rebuild_s = None
        with MasterClient(cluster.master_address, timeout_s=2.0) as m:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if m.match(ns, probe).num_matched == 6:
                        rebuild_s = time.perf_counter() - t0
                        break
                except Exception:  # noqa: BLE001 - the master is still starting
                    pass
                time.sleep(0.1)
        assert rebuild_s is not None, "the index was not rebuilt from the store inventories"
        t = api.serve(Tally("master kill -9 + restart"), prompts[120:], refs[120:], eos)
        t.recovery_s = rebuild_s
        report.append(t)
        assert (t.failed, t.wrong) == (0, 0), t.notes
        assert t.hits > 0
    finally:
        api.close()
        print("\nfault                              requests failed wrong hits recovery_s")
        for t in report:
            print(t.row())


def test_store_kill_with_one_replica_gives_no_wrong_token(runner) -> None:  # type: ignore[no-untyped-def]
    """replica_num=1: a killed store takes its blocks with it; requests may recompute, never answer wrong."""
    prompts = workload(80, seed=5, num_docs=8)
    refs = references(runner, prompts)
    eos = runner.eos_token_id
    with LocalCluster(fault_cluster_spec(runner, heartbeat_timeout_ms=2000, num_replicas=1)) as cluster:
        api = Api(start_router(cluster))
        try:
            t = api.serve(Tally("healthy (replicas=1)"), prompts[:40], refs[:40], eos)
            assert (t.failed, t.wrong) == (0, 0), t.notes
            cluster.stores[0].kill()
            t0 = time.perf_counter()
            t = api.serve(Tally("store kill -9 (replicas=1)"), prompts[40:], refs[40:], eos)
            t.recovery_s = time.perf_counter() - t0
            print(f"\n{t.row()}")
            assert t.wrong == 0, t.notes
            assert t.failed == 0, t.notes  # the lost blocks are recomputed (and re-published on store1)
        finally:
            api.close()
