"""Tenant isolation on the node-local tier (B09, issue #12): one prefill node serves two cache salts.

The first tenant's blocks sit in the prefill node's local tier (and the pool); the second tenant's
identical prompt on the same node reuses 0 tokens from either tier; the first tenant's repeat is served
from the node-local tier (the paired positive, so the test cannot pass vacuously).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch")
transfer = pytest.importorskip("transfer")

from kvpool.cluster.local import LocalCluster, LocalClusterSpec  # noqa: E402
from kvpool.demo.orchestrator import Orchestrator  # noqa: E402
from tests.capabilities import require_ucx  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def orch() -> Iterator[Orchestrator]:
    require_ucx()
    from kvpool.model import ModelRunner

    layout = ModelRunner.load(None, block_size=BLOCK).layout.fingerprint()
    spec = LocalClusterSpec(layout=layout, num_stores=1, block_size=BLOCK, segment_size="64MiB")
    with LocalCluster(spec) as cluster:
        o = Orchestrator(cluster.prefill_addresses[0], cluster.decode_addresses[0], timeout_s=120)
        yield o
        o.close()


def test_node_local_tier_never_serves_another_tenant(orch: Orchestrator) -> None:
    prompt = [(7 * i) % 200 + 3 for i in range(6 * BLOCK + 5)]
    first = orch.run(prompt, cache_salt="tenant-one")
    assert first.publish_status == "committed"
    other = orch.run(prompt, cache_salt="tenant-two")
    for key in ("num_matched_tokens", "num_reused_tokens", "num_local_tokens", "num_pulled_tokens"):
        assert other.prefill[key] == 0, (key, other.prefill)
    again = orch.run(prompt, cache_salt="tenant-one")
    assert again.prefill["num_local_tokens"] >= 5 * BLOCK, again.prefill
    assert again.tokens == first.tokens
