"""Routing policies on fake node states (no processes): balance under a hot prefix, ties, tenants, restarts.

Field cases: B21 (prefix affinity overloads one worker), B09 (cross-tenant affinity), B22 (stale index).
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import replace

import pytest

from kvpool.client.types import Match, NodeInfo, NodeLoad, NodeStatus
from kvpool.errors import InvalidArgument, Unavailable
from kvpool.hashing import Namespace, hash_blocks
from kvpool.router.policy import NodeState, RouteRequest, RoutingPolicy, predict
from kvpool.router.state import Inflight, local_runs, node_states
from kvpool.router.tenants import Tenants
from kvpool.types import KVLayout, Location
from tests.tenant_files import SALT_KEY, write_private

BS = 64
NBYTES = 4096 * BS
LOAD = NodeLoad(
    recompute_s_per_token=1e-4, recompute_overhead_s=0.005, link_alpha_s=0.001, link_beta_bytes_per_s=1e9
)
PREFIX_BLOCKS = 8
PROMPT = PREFIX_BLOCKS * BS + 100  # a 512-token shared prefix and a distinct 100-token suffix
WORKERS = ["w0", "w1", "w2", "w3"]


def _req(pool_blocks: int = PREFIX_BLOCKS) -> RouteRequest:
    return RouteRequest(prompt_len=PROMPT, block_size=BS, block_nbytes=NBYTES, pool_blocks=pool_blocks)


def _simulate(policy: str, *, n: int, interarrival_s: float, seed: int = 0) -> tuple[Counter[str], float]:
    """Discrete-event run: w0 holds the hot prefix in its local tier, the others can pull it from the pool.

    Each worker serves one request at a time, FIFO, taking exactly the predicted service time. Heartbeats
    never arrive (reported queue 0: the paced-request failure of B21), so only the router's own in-flight
    accounting carries the load. Returns the placements and the worst TTFT.
    """
    router = RoutingPolicy(policy, seed=seed)
    inflight = Inflight()
    free_at = dict.fromkeys(WORKERS, 0.0)
    done: list[tuple[float, str, float]] = []
    counts: Counter[str] = Counter()
    worst = 0.0
    for i in range(n):
        now = i * interarrival_s
        while done and done[0][0] <= now:
            _, node, secs = heapq.heappop(done)
            inflight.end(node, 1, secs)
        states = []
        for w in WORKERS:
            count, secs = inflight.get(w, 1)
            local = PREFIX_BLOCKS if w == "w0" else 0
            states.append(
                NodeState(node_id=w, epoch=1, load=LOAD, inflight=count, inflight_s=secs, local_blocks=local)
            )
        choice = router.choose(_req(), states)
        service = choice.prediction.service_s
        start = max(now, free_at[choice.node_id])
        free_at[choice.node_id] = start + service
        worst = max(worst, start + service - now)
        inflight.begin(choice.node_id, 1, service)
        heapq.heappush(done, (start + service, choice.node_id, service))
        counts[choice.node_id] += 1
    return counts, worst


def test_cost_prediction_prefers_local_hit_then_pull_over_recompute() -> None:
    warm = predict(_req(), NodeState(node_id="w0", load=LOAD, local_blocks=PREFIX_BLOCKS))
    pull = predict(_req(), NodeState(node_id="w1", load=LOAD))
    cold = predict(_req(pool_blocks=0), NodeState(node_id="w1", load=LOAD))
    assert warm.reused_tokens == pull.reused_tokens == PREFIX_BLOCKS * BS
    assert cold.reused_tokens == 0
    assert warm.service_s < pull.service_s < cold.service_s
    busy = predict(_req(), NodeState(node_id="w0", load=LOAD, local_blocks=8, inflight=3, inflight_s=0.3))
    assert busy.queue_s == pytest.approx(0.3)
    # requests the node reports beyond our own (another router's) count at this prompt's service each
    other = predict(_req(), NodeState(node_id="w0", load=replace(LOAD, queue_len=2)))
    assert other.queue_s == pytest.approx(2 * other.service_s)


def test_hot_prefix_burst_no_node_above_1_5x_fair_share() -> None:
    """B21: 100 requests at once (none finishes); w0 warm. Nobody takes more than 1.5x its fair share."""
    counts, _ = _simulate("cost", n=100, interarrival_s=0.0)
    assert max(counts.values()) <= 1.5 * 100 / len(WORKERS), counts
    assert set(counts) == set(WORKERS)
    counts_aff, _ = _simulate("affinity", n=100, interarrival_s=0.0)
    assert counts_aff["w0"] == 100  # the baseline this policy exists to beat


def test_hot_prefix_paced_requests_still_see_load() -> None:
    """B21: paced arrivals faster than one worker serves; reported queue always 0. <= 40 % per worker."""
    counts, worst = _simulate("cost", n=100, interarrival_s=0.006)
    assert max(counts.values()) <= 40, counts
    counts_aff, worst_aff = _simulate("affinity", n=100, interarrival_s=0.006)
    assert counts_aff["w0"] == 100
    assert worst < worst_aff / 3


def test_two_router_replicas_without_shared_state() -> None:
    """B21: two routers, no shared state, a burst of 16: no worker above 1.5x fair share + 2."""
    total: Counter[str] = Counter()
    for seed in (1, 2):
        counts, _ = _simulate("cost", n=8, interarrival_s=0.0, seed=seed)
        total.update(counts)
    assert max(total.values()) <= 1.5 * 16 / len(WORKERS) + 2, total


def test_least_load_and_round_robin_spread_evenly() -> None:
    for policy in ("least-load", "round-robin"):
        counts, _ = _simulate(policy, n=100, interarrival_s=0.0)
        assert max(counts.values()) - min(counts.values()) <= 1, (policy, counts)


def test_ties_broken_by_seeded_random_choice() -> None:
    nodes = [NodeState(node_id=w, load=LOAD) for w in reversed(WORKERS)]

    def picks(seed: int) -> list[str]:
        router = RoutingPolicy("cost", seed=seed)
        return [router.choose(_req(0), nodes).node_id for _ in range(200)]

    a, b, c = picks(7), picks(7), picks(8)
    assert a == b  # reproducible
    assert a != c  # the seed matters
    counts = Counter(a)
    assert set(counts) == set(WORKERS) and min(counts.values()) > 25  # not container order
    choice = RoutingPolicy("cost", seed=7).choose(_req(0), nodes)
    assert choice.tied == 4


def test_bad_policy_and_no_nodes() -> None:
    with pytest.raises(InvalidArgument, match="unknown routing policy"):
        RoutingPolicy("fastest")
    with pytest.raises(Unavailable):
        RoutingPolicy("cost").choose(_req(), [])


# ---- peeks: tenants (B09) and restarted nodes (B22) ----------------------------------------------------

LAYOUT = KVLayout(dtype="float32", block_size=BS, num_layers=4, num_kv_heads=4, head_dim=32)


def _status(node_id: str, epoch: int, role: str = "prefill") -> NodeStatus:
    info = NodeInfo(node_id=node_id, role=role, grpc_address="x", data_address="", epoch=epoch)
    return NodeStatus(
        node=info, alive=True, draining=False, num_slots=0, num_used_slots=0, num_blocks=0, used_bytes=0,
        load=LOAD,
    )  # fmt: skip


class FakeIndex:
    """Block hash -> locations, the peek semantics of the master (leading run, no counting, no lease)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[bytes, bytes], list[Location]] = {}
        self.nodes: dict[str, NodeInfo] = {}

    def put(self, ns: bytes, hashes: list[bytes], locs: list[Location], nodes: list[NodeInfo]) -> None:
        for h in hashes:
            self.blocks.setdefault((ns, h), []).extend(locs)
        self.nodes.update({n.node_id: n for n in nodes})

    def purge_local(self, node_id: str) -> None:
        for locs in self.blocks.values():
            locs[:] = [x for x in locs if not (x.local and x.node_id == node_id)]

    def match(self, ns: bytes, hashes: list[bytes]) -> Match:
        replicas = []
        for h in hashes:
            locs = self.blocks.get((ns, h))
            if not locs:
                break
            replicas.append(tuple(locs))
        names = {x.node_id for r in replicas for x in r}
        return Match(len(replicas), replicas, None, {k: v for k, v in self.nodes.items() if k in names})


def _warm_index(ns: bytes, hashes: list[bytes], epoch: int = 1) -> FakeIndex:
    index = FakeIndex()
    store = NodeInfo("store0", "store", "s", "d", 1)
    w0 = NodeInfo("w0", "prefill", "x", "", epoch)
    index.put(ns, hashes, [Location("store0", 1, 1), Location("w0", 0, 0, local=True)], [store, w0])
    return index


def test_b09_tenant_salt_isolates_affinity(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tfile = write_private(
        tmp_path / "tenants.toml",
        '[[tenants]]\nname = "t1"\napi_keys = ["key-1"]\n\n[[tenants]]\nname = "t2"\napi_keys = ["key-2"]\n',
    )
    tenants = Tenants.load(tfile, SALT_KEY)
    s1 = tenants.cache_salt(tenants.authenticate("key-1"))
    s2 = tenants.cache_salt(tenants.authenticate("key-2"))
    # a client-supplied salt equal to T1's does not give T2 T1's namespace
    s2_forged = tenants.cache_salt(tenants.authenticate("key-2"), client_salt=s1)
    assert len({s1, s2, s2_forged}) == 3
    tokens = list(range(8 * BS + 10))

    def hashes(salt: str) -> list[bytes]:
        ns = Namespace(model_id="m", weights_version="v", layout=LAYOUT, cache_salt=salt).digest()
        return [bytes(h) for h in hash_blocks(ns, tokens, BS)]

    def ns_of(salt: str) -> bytes:
        return Namespace(model_id="m", weights_version="v", layout=LAYOUT, cache_salt=salt).digest()

    h1 = hashes(s1)
    assert h1[0] != hashes(s2)[0]  # the salt changes block 0 and, chained, every later key
    assert not set(h1) & set(hashes(s2)) and not set(h1) & set(hashes(s2_forged))
    index = _warm_index(ns_of(s1), h1)
    nodes = [_status(w, 1) for w in WORKERS]
    router = RoutingPolicy("affinity", seed=0)
    for salt, want in ((s2, 0), (s2_forged, 0), (s1, 8)):  # T1 again: the paired positive
        match = index.match(ns_of(salt), hashes(salt))
        assert match.num_matched == want
        states = node_states(nodes, match, Inflight(), max_blocks=8)
        req = RouteRequest(prompt_len=len(tokens), block_size=BS, block_nbytes=NBYTES, pool_blocks=want)
        assert -router.scores(req, states)["w0"] == want


def test_b09_unknown_api_key_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tfile = write_private(tmp_path / "tenants.toml", '[[tenants]]\nname = "t1"\napi_keys = ["key-1"]\n')
    tenants = Tenants.load(tfile, SALT_KEY)
    assert tenants.authenticate("nope") is None
    assert tenants.authenticate("") is None
    open_tenants = Tenants.open()
    assert open_tenants.cache_salt(open_tenants.authenticate("anything")) == ""


def test_b22_restarted_node_stops_attracting_its_old_blocks() -> None:
    ns = Namespace(model_id="m", weights_version="v", layout=LAYOUT).digest()
    hs = [bytes(h) for h in hash_blocks(ns, list(range(8 * BS + 10)), BS)]
    index = _warm_index(ns, hs, epoch=1)
    router = RoutingPolicy("cost", seed=0)
    req = RouteRequest(prompt_len=8 * BS + 10, block_size=BS, block_nbytes=NBYTES, pool_blocks=8)
    before = node_states([_status(w, 1) for w in WORKERS], index.match(ns, hs), Inflight(), 8)
    assert router.choose(req, before).node_id == "w0"
    # w0 restarts: the node list shows epoch 2 while the peek still names the epoch-1 record (a late view)
    after = node_states(
        [_status("w0", 2), *(_status(w, 1) for w in WORKERS[1:])], index.match(ns, hs), Inflight(), 8
    )
    assert {s.node_id: s.local_blocks for s in after} == dict.fromkeys(WORKERS, 0)
    # and once the master purged w0's local locations (it does on a new epoch), nothing names w0 at all
    index.purge_local("w0")
    assert local_runs(index.match(ns, hs), {"w0": 1}, 8) == {}
    picks = Counter(router.choose(req, after).node_id for _ in range(40))
    assert len(picks) == 4  # no longer favoured: a tie among equals


def test_inflight_is_per_epoch() -> None:
    inflight = Inflight()
    inflight.begin("w0", 1, 0.5)
    inflight.begin("w0", 1, 0.25)
    assert inflight.get("w0", 1) == (2, 0.75)
    assert inflight.get("w0", 2) == (0, 0.0)
    inflight.end("w0", 1, 0.5)
    inflight.end("w0", 1, 0.25)
    assert inflight.get("w0", 1) == (0, 0.0) and inflight.total() == 0
