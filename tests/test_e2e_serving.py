"""End to end through real processes: master, 2 store nodes, a prefill and a decode node on 127.0.0.1.

Field cases: B06 (fully cached prompt), B18 (partial load failure), B27 (cold == warm for fp32 CPU).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from kvpool.cluster.local import LocalCluster, LocalClusterSpec  # noqa: E402
from kvpool.demo.orchestrator import Orchestrator  # noqa: E402
from kvpool.sampling import SamplingParams  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def runner():  # type: ignore[no-untyped-def]
    from kvpool.model import ModelRunner

    return ModelRunner.load(None, block_size=BLOCK)


def e2e_spec(runner, **overrides) -> LocalClusterSpec:  # type: ignore[no-untyped-def]
    """The serving tests' cluster: the embedded model's layout, 64 MiB stores, a killed store listed 30 s."""
    return LocalClusterSpec(
        layout=runner.layout.fingerprint(),
        block_size=BLOCK,
        segment_size="64MiB",
        heartbeat_timeout_ms=30_000,
        # no node-local tier: every hit is a real pull over UCX from the store nodes; pulls forced, since
        # these tests check the exactness of reuse, and with 128-token prefixes on a loaded 2-core host the
        # cost model (rightly, once it has learned the per-pull overhead) often prefers recomputing
        extra_env={"KVPOOL_LOCAL_TIER_BYTES": "0", "KVPOOL_FORCE_DECISION": "pull"},
        **overrides,
    )


@pytest.fixture(scope="module")
def cluster(runner) -> Iterator[LocalCluster]:  # type: ignore[no-untyped-def]
    spec = e2e_spec(runner)
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def orch(cluster: LocalCluster) -> Iterator[Orchestrator]:
    o = Orchestrator(cluster.prefill_addresses[0], cluster.decode_addresses[0], timeout_s=120)
    yield o
    o.close()


def _prompt(seed: int, n: int, vocab: int = 256) -> list[int]:
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=n)]


def test_greedy_with_hits_equals_without(orch: Orchestrator, runner) -> None:  # type: ignore[no-untyped-def]
    shared = _prompt(1, 8 * BLOCK)
    prompts = [shared + _prompt(100 + i, 5 + i) for i in range(20)]
    sampling = SamplingParams(max_tokens=6)
    num_hits = 0
    for i, prompt in enumerate(prompts):
        warm = orch.run(prompt, sampling=sampling, request_id=f"g{i}")
        cold = orch.run(prompt, sampling=sampling, use_cache=False, publish=False, request_id=f"g{i}-cold")
        assert warm.publish_status == "committed"
        assert cold.prefill["num_reused_tokens"] == 0
        assert warm.tokens == cold.tokens, f"prompt {i}"
        num_hits += warm.prefill["num_reused_tokens"] > 0
        # decode always reuses the committed prompt blocks (pulled: no local tier here)
        assert (
            warm.decode["num_reused_tokens"] == (len(prompt) - 1) // BLOCK * BLOCK
            or warm.decode["decision"] == "recompute"
        )
    assert num_hits >= 19  # every prompt after the first hits the shared prefix
    # a fully cached prompt still computes its last token (B06), and answers as a cold run of the same
    # model in this process (no pool anywhere)
    full = prompts[0][: 8 * BLOCK]
    again = orch.run(full, sampling=sampling, request_id="full")
    assert again.prefill["num_reused_tokens"] == 7 * BLOCK
    assert again.tokens == runner.generate(full, params=sampling)


def test_seeded_temperature_same_warm_and_cold(orch: Orchestrator) -> None:
    prompt = _prompt(7, 6 * BLOCK + 3)
    s = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=8)
    orch.run(prompt, sampling=s, request_id="t-publish")
    warm = orch.run(prompt, sampling=s, request_id="t-warm")
    cold = orch.run(prompt, sampling=s, use_cache=False, publish=False, request_id="t-cold")
    assert warm.prefill["num_reused_tokens"] == 6 * BLOCK
    assert warm.tokens == cold.tokens


def test_sampling_params_do_not_change_hits(orch: Orchestrator) -> None:
    prompt = _prompt(8, 5 * BLOCK + 1)
    orch.run(prompt, sampling=SamplingParams(max_tokens=2), request_id="s-publish")
    a = orch.run(prompt, sampling=SamplingParams(max_tokens=2), request_id="s-a")
    b = orch.run(prompt, sampling=SamplingParams(temperature=1.3, seed=5, max_tokens=3), request_id="s-b")
    assert a.prefill["num_matched_tokens"] == b.prefill["num_matched_tokens"] == 5 * BLOCK
    assert a.prefill["num_reused_tokens"] == b.prefill["num_reused_tokens"]


def test_second_chat_turn_hits_first_answer(orch: Orchestrator) -> None:
    turn1 = _prompt(9, 3 * BLOCK + 5)
    first = orch.run(turn1, sampling=SamplingParams(max_tokens=2 * BLOCK), request_id="chat-1")
    assert len(first.tokens) == 2 * BLOCK
    turn2 = turn1 + first.tokens + _prompt(10, 7)
    # decode publishes prompt + answer after it finishes: allow it a moment
    deadline = time.monotonic() + 10
    while True:
        second = orch.run(turn2, sampling=SamplingParams(max_tokens=2), publish=False, request_id="chat-2")
        if second.prefill["num_reused_tokens"] > len(turn1) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # the reuse reaches into the first turn's answer, not just its prompt
    assert second.prefill["num_reused_tokens"] >= (len(turn1) + len(first.tokens) - 1) // BLOCK * BLOCK
    assert second.prefill["num_reused_tokens"] > len(turn1)


def _decode_queue_length(cluster: LocalCluster) -> float:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    addr = cluster.metrics_addresses["decode0"]
    for family in text_string_to_metric_families(httpx.get(f"http://{addr}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "kvpool_decode_queue_length":
                return float(s.value)
    raise AssertionError("no kvpool_decode_queue_length")


def test_decode_refuses_past_the_context_and_drops_cancelled_requests(cluster: LocalCluster) -> None:
    import grpc

    from kvpool.rpc.server import channel
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

    prompt = _prompt(9, 40)
    with channel(cluster.decode_addresses[0]) as ch:
        stub = pb_grpc.DecodeStub(ch)
        too_long = pb.DecodeRequest(
            token_ids=prompt, first_token=5, sampling=pb.SamplingParams(max_tokens=40_000)
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Decode(too_long, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in str(err.value.details())
        # a long generation whose caller hangs up after 2 tokens leaves the batch at once
        call = stub.Decode(
            pb.DecodeRequest(
                token_ids=prompt,
                first_token=5,
                sampling=pb.SamplingParams(max_tokens=5000),
                request_id="cancel-me",
            ),  # fmt: skip
            timeout=120,
        )
        for i, _event in enumerate(call):
            if i == 1:
                break
        call.cancel()
    deadline = time.monotonic() + 20
    while _decode_queue_length(cluster) > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _decode_queue_length(cluster) == 0, "a cancelled request kept decoding"


def test_the_crossover_benchmarks_prefill_caller_reports_ttft_stats_and_publish(
    cluster: LocalCluster,
) -> None:
    """`kvpool bench crossover`'s prefill-only caller (through `kvpool.client.NodeClient`): TTFT as the
    caller sees it, the node's PrefillStats fields and how the publish ended."""
    from kvpool.bench.crossover_cluster import PrefillCaller

    call = PrefillCaller(cluster.prefill_addresses[0], timeout_s=120)
    try:
        prompt = _prompt(77, 3 * BLOCK + 1)
        ttft_s, stats = call(prompt, use_cache=False, publish=True, rid="caller-1")
    finally:
        call.close()
    assert ttft_s > 0 and stats["ttft_s"] > 0
    assert stats["num_prompt_tokens"] == len(prompt) and stats["num_reused_tokens"] == 0
    assert stats["publish_status"] == "committed"


def test_failed_pull_reuses_exactly_the_blocks_before(
    cluster: LocalCluster, orch: Orchestrator, runner
) -> None:  # type: ignore[no-untyped-def]
    """B18 with 0 < k < n: the prompt's 20 blocks span both stores (placement puts runs of 16 consecutive
    new blocks on one store, each run on the store with the most free slots), the store holding blocks
    k.. is killed, and the node reuses exactly blocks 0..k-1, recomputes the rest, and answers as a cold
    run of the same model in this process. Last in the module: the killed store stays listed (heartbeat
    timeout 30 s), so a later publish placed on it would fail."""
    from kvpool.client import MasterClient
    from kvpool.hashing import hash_blocks

    n = 20  # > one placement run (16 blocks): two stores hold the prompt
    prompt = _prompt(11, n * BLOCK + 2)
    sampling = SamplingParams(max_tokens=5)
    reference = runner.generate(prompt, params=sampling)
    orch.run(prompt, sampling=sampling, request_id="f-publish")
    ns = runner.namespace().digest()
    hashes = hash_blocks(ns, prompt, BLOCK)
    master = MasterClient(cluster.master_address)
    try:
        match = master.match(ns, hashes, count_hit=False, lease_ttl_ms=0)
    finally:
        master.close()
    assert match.num_matched == n
    owners = [reps[0].node_id for reps in match.replicas]
    assert len(set(owners)) == 2, owners  # the case k = 0 (every block on the victim) proves less
    k = next(i for i, o in enumerate(owners) if o != owners[0])
    victim = owners[k]
    assert 0 < k < n
    store = next(p for p in cluster.stores if p.info["node_id"] == victim)
    store.kill()
    result = orch.run(prompt, sampling=sampling, publish=False, request_id="f-after-kill")
    assert result.prefill["num_reused_tokens"] == k * BLOCK  # blocks 0..k-1, not one more or fewer
    assert result.prefill["num_failed_blocks"] >= 1
    assert result.tokens == reference
