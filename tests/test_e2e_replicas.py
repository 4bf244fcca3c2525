"""A failed pull retried on the other replica, end to end (field case B18): real processes (master with
`--replicas 2`, two store nodes, a prefill and a decode node on 127.0.0.1).

Every block of a published prompt has a replica on each store. The store holding the first replica the
pull tries is killed (-9; the master still lists it: its heartbeat timeout has not passed), so every read
from it fails and is retried once on the other store: the prompt is reused in full, and the answer equals
a cold run of the same model in this process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from kvpool.cluster.local import LocalCluster  # noqa: E402
from kvpool.demo.orchestrator import Orchestrator  # noqa: E402
from kvpool.sampling import SamplingParams  # noqa: E402
from tests.test_e2e_serving import BLOCK, e2e_spec  # noqa: E402


@pytest.fixture(scope="module")
def runner():  # type: ignore[no-untyped-def]
    from kvpool.model import ModelRunner

    return ModelRunner.load(None, block_size=BLOCK)


@pytest.fixture(scope="module")
def cluster(runner) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    # two replicas of every block; the killed store stays listed: its replicas are offered and fail
    with LocalCluster(e2e_spec(runner, num_replicas=2)) as c:
        yield c


@pytest.mark.slow  # its own cluster: ~40 s to start on a loaded 2-core host (the case itself takes ~3 s)
def test_a_killed_replica_is_read_from_the_other_one_in_full(cluster: LocalCluster, runner) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from kvpool.client import MasterClient
    from kvpool.hashing import hash_blocks

    n = 10
    prompt = [int(t) for t in np.random.default_rng(12).integers(3, 256, size=n * BLOCK + 2)]
    sampling = SamplingParams(max_tokens=5)
    reference = runner.generate(prompt, params=sampling)
    orch = Orchestrator(cluster.prefill_addresses[0], cluster.decode_addresses[0], timeout_s=120)
    try:
        first = orch.run(prompt, sampling=sampling, request_id="r-publish")
        assert first.publish_status == "committed"
        ns = runner.namespace().digest()
        with MasterClient(cluster.master_address) as master:
            match = master.match(ns, hash_blocks(ns, prompt, BLOCK), count_hit=False, lease_ttl_ms=0)
        assert match.num_matched == n
        assert all(len({loc.node_id for loc in reps}) == 2 for reps in match.replicas)  # one on each store
        victim = match.replicas[0][0].node_id  # the replica a pull tries first
        next(p for p in cluster.stores if p.info["node_id"] == victim).kill()
        result = orch.run(prompt, sampling=sampling, request_id="r-after-kill")  # (all present: no write)
    finally:
        orch.close()
    assert result.prefill["num_failed_blocks"] >= 1  # the first tries went to the killed store ...
    assert result.prefill["num_reused_tokens"] == n * BLOCK  # ... and every block came from the other
    assert result.decode["num_reused_tokens"] == n * BLOCK
    assert result.tokens == reference
