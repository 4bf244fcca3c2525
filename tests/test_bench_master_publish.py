"""The fill and publish figures of `kvpool bench master` at a tiny N: Reserve + Commit through a real
master on `--metadata-only` stores makes exactly N blocks resident in the trace's tree shape, and the
publish phase reports its figures with the replicas it asked for."""

from __future__ import annotations

import time

import pytest

from kvpool.bench import master_scale_work as work
from kvpool.bench.master_scale import ScaleCluster, fill_without_bytes
from kvpool.bench.master_scale_phases import publish_rates
from kvpool.bench.routing import BUNDLED_TRACE
from kvpool.client import MasterClient
from tests.capabilities import require_ucx

pytest.importorskip("transfer")


@pytest.mark.slow  # a fill of 20 K blocks, two publish passes and a second cluster: ~30 s
def test_fill_without_bytes_makes_n_blocks_resident_and_publish_reports_its_figures() -> None:
    require_ucx()
    n = 20_000  # the bundled tree holds 9,821 blocks: three namespaces, the last cut short
    clients, chains = 2, 3
    with ScaleCluster(
        n, num_stores=2, extra_blocks=4 * clients * chains * 64, store_args=("--metadata-only",)
    ) as cl:
        time.sleep(0.5)
        f = fill_without_bytes(cl, BUNDLED_TRACE, n, clients=3)
        assert f.num_blocks == n and len(f.namespaces) == 3 and f.calls > 0
        with MasterClient(cl.address) as c:
            assert c.stats().num_blocks == n
            assert sum(x.num_blocks for x in c.list_nodes() if x.node.role == "store") == n  # one replica
            picks, want = work.prompts(f.tree, f.namespaces, f.resident, 64, 128, seed=3)
            assert max(want) > 64  # paths longer than one 64-block chain: chained below each other
            for (ns, prompt), w in zip(picks, want, strict=True):
                assert c.match(ns, prompt).num_matched == w
        pub = publish_rates(cl, clients=clients, chains=chains, chain_blocks=64)
        per_pass = clients * chains * 64
        with MasterClient(cl.address) as c:
            assert c.stats().num_blocks == n + 2 * per_pass
            stored = sum(x.num_blocks for x in c.list_nodes() if x.node.role == "store")
            assert stored == n + per_pass + 2 * per_pass  # the second pass: two replicas each
    assert pub["publish_chains"] == clients * chains and pub["publish_chain_blocks"] == 64
    assert pub["publish_blocks_per_s"] > 0 and pub["publish_e2e_blocks_per_s"] > 0
    assert pub["publish_two_replicas_blocks_per_s"] > 0
    assert isinstance(pub["bytes_per_extra_replica"], float)
