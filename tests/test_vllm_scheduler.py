"""The vLLM connector's scheduler half without vLLM, built as `build_scheduler` builds it, on a real master
and store; fakes stand in for vLLM's request, blocks, scheduler output and KV cache manager. Pool blocks
hold random bytes: the scheduler only matches, it never reads them."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from kvpool.client import MasterClient, NodeInfo, PoolClient
from kvpool.client.master_link import MasterLink, new_epoch
from kvpool.cluster.local import LocalCluster, LocalClusterSpec
from kvpool.connector.connector import KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.cost import RecomputeModel
from kvpool.hashing import hash_blocks
from kvpool.types import KVLayout
from kvpool.vllm.identity import Namespaces
from kvpool.vllm.meta import KVPoolWorkerMetadata, SaveSpec
from kvpool.vllm.scheduler import ReportedLinks, SchedulerHalf
from tests.capabilities import require_ucx

transfer = pytest.importorskip("transfer")

FP = "kv1:float32:b64:l4:h4:d32"
LAYOUT = KVLayout.from_fingerprint(FP)
BS = LAYOUT.block_size
# No call of the engine step may take longer: a call that does not wait on the pool takes ~1 ms, one that
# waits on a held match 2 s (Gated) or on a silent master its call timeout (5 s).
FAST_S = 1.0


class Req:
    """vLLM's `Request`, as far as the scheduler half reads it."""

    cache_salt = lora_request = prompt_embeds = None
    mm_features: tuple[Any, ...] = ()
    num_computed_tokens = num_preemptions = 0

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id, self.prompt_token_ids, self.all_token_ids = request_id, list(tokens), list(tokens)
        self.num_prompt_tokens = len(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def blocks(ids: Any) -> Any:  # vLLM's KVCacheBlocks of a request (one KV cache group)
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def sched_out(new: Any = (), cached: Any = (), tokens: Any = None, spec: Any = None) -> Any:
    """A `SchedulerOutput`: `new` and `cached` are (req_id, num_computed_tokens) pairs."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c) for r, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]),
        num_scheduled_tokens=dict(tokens or {}), scheduled_spec_decode_tokens=dict(spec or {}),
    )  # fmt: skip


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, n)]


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not (ok := cond()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return ok


class Gated:
    """The master as the decision connector sees it, each match held until `gate` opens (at most 2 s): a
    slow master, so that a match is still in flight when the test says so."""

    def __init__(self, master: MasterClient) -> None:
        self.master, self.gate = master, threading.Event()
        self.gate.set()

    def match(self, *args: Any, **kwargs: Any) -> Any:
        self.gate.wait(2.0)
        return self.master.match(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.master, name)


@contextmanager
def built(address: str, *, match_wait_s: float = 5.0, timeout_s: float = 2.0) -> Iterator[SchedulerHalf]:
    """A scheduler half as `build_scheduler` builds it (start-up recompute model fixed)."""
    master = MasterClient(address, timeout_s=timeout_s)
    connector = KVConnector(
        master=Gated(master), pool=None, transport=ReportedLinks(), node_id=f"vllm-{uuid.uuid4().hex[:8]}",
        block_size=BS, block_nbytes=LAYOUT.block_nbytes,
        recompute=RecomputeModel(overhead_s=0.001, per_token_s=1e-4, per_pair_s=0.0), local_tier=LocalTier(0),
    )  # fmt: skip
    node = NodeInfo(connector.node_id, "vllm", "", "", new_epoch())
    link = MasterLink(master, node, layout_fingerprint=FP, on_flush_epoch=connector.note_flush_epoch)
    link.start(require_master=False)
    ns = Namespaces(model_id="m", weights_version="w1", layout=LAYOUT, engine="vllm-test-cpu-vec")
    half = SchedulerHalf(connector=connector, link=link, namespaces=ns, match_wait_s=match_wait_s)
    try:
        yield half
    finally:
        half.shutdown()
        link.stop()
        master.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    require_ucx()
    spec = LocalClusterSpec(layout=FP, num_stores=1, num_prefill=0, num_decode=0)
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def pool(cluster: LocalCluster) -> Iterator[PoolClient]:
    t = transfer.UcxTransport()
    with PoolClient(cluster.master_address, t, block_nbytes=LAYOUT.block_nbytes) as pc:
        yield pc
    t.close()


@pytest.fixture
def half(cluster: LocalCluster) -> Iterator[SchedulerHalf]:
    with built(cluster.master_address) as h:
        yield h


def put(half: SchedulerHalf, pool: PoolClient, tokens: list[int], n: int) -> None:
    """Put the first `n` blocks of `tokens` into the pool under the half's namespace."""
    ns = half.link.namespaces.namespace(
        half.namespaces.namespace(cache_salt=None, lora_path=None)
    )  # registers it
    hashes = hash_blocks(ns, tokens, BS)[:n]
    data = np.random.default_rng(n).integers(0, 256, (n, LAYOUT.block_nbytes), dtype=np.uint8)
    res = pool.put_blocks(ns, None, hashes, list(data))
    assert res.num_committed + res.num_existing == n


def call(half: SchedulerHalf, req: Req, computed: int, timed: bool = True) -> tuple[int | None, bool]:
    t0 = time.perf_counter()
    out = half.get_num_new_matched_tokens(req, computed)
    dt = time.perf_counter() - t0
    assert not timed or dt < FAST_S, f"the engine step waited {dt * 1e3:.0f} ms on the pool"
    return out


def answer(half: SchedulerHalf, req: Req, computed: int, timed: bool = False) -> int:
    """Poll as vLLM's scheduler does, one call per step, until the half answers (in 5 s)."""
    deadline = time.monotonic() + 15.0
    while (out := call(half, req, computed, timed))[0] is None:
        assert time.monotonic() < deadline, "no answer"
        time.sleep(0.01)
    n, load_async = out
    assert n is not None and load_async is False
    return n


def live(pool: PoolClient) -> int:
    return pool.master.stats().num_live_leases


def test_first_call_never_blocks_then_one_match_answers(half, pool) -> None:
    tokens = prompt(6 * BS + 10, seed=1)
    put(half, pool, tokens, 5)
    before = pool.master.stats().num_match_requests
    req = Req("r1", tokens)
    half.connector.master.gate.clear()  # the master is slow: the step goes on without it
    assert call(half, req, 0) == (None, False)
    assert call(half, req, 0) == (None, False)
    half.connector.master.gate.set()
    assert answer(half, req, 0, timed=True) == 5 * BS
    for _ in range(3):
        assert call(half, req, 0) == (5 * BS, False)
    assert pool.master.stats().num_match_requests == before + 1


def test_never_the_last_token_nor_what_vllms_prefix_cache_holds(half, pool) -> None:
    exact = prompt(5 * BS, seed=2)
    put(half, pool, exact, 5)
    assert answer(half, Req("r2", exact), 0) == 4 * BS
    tokens = prompt(6 * BS + 10, seed=3)
    put(half, pool, tokens, 5)
    assert answer(half, Req("a", tokens), 2 * BS) == 3 * BS
    assert answer(half, Req("b", tokens), 5 * BS) == 0
    before = pool.master.stats().num_match_requests
    assert call(half, Req("c", tokens), 6 * BS) == (0, False)  # every reusable block is local: no match
    assert pool.master.stats().num_match_requests == before


def test_leases_b13(half, pool) -> None:
    tokens = prompt(6 * BS + 10, seed=4)
    put(half, pool, tokens, 5)
    base = live(pool)
    a = Req("a", tokens)  # decided, then vLLM loads nothing: released at allocation
    assert answer(half, a, 0) == 5 * BS
    assert live(pool) == base + 1
    half.update_state_after_alloc(a, blocks(range(7)), 0)
    assert wait_until(lambda: live(pool) == base)  # released in the background (`LeaseReleaser`)
    b = Req("b", tokens)  # a load: the lease travels to the worker with the LoadSpec
    assert answer(half, b, BS) == 4 * BS
    assert live(pool) == base + 1
    half.update_state_after_alloc(b, blocks(range(100, 107)), 4 * BS)
    [load] = half.build_connector_meta(sched_out()).loads
    assert load.request_id == "b" and load.sync and load.block_ids == [101, 102, 103, 104]
    assert (load.plan.pull_start, load.plan.pull_end) == (1, 5) and load.plan.lease_id
    assert half.build_connector_meta(sched_out()).loads == []
    done, params = half.request_finished(b, [])
    assert done is False and params is not None
    assert params["kvpool"]["decision"] == "pull" and params["kvpool"]["num_loaded_tokens"] == 4 * BS
    assert live(pool) == base + 1  # the worker's now, not the scheduler's
    half.connector.release(load.plan)  # what the worker does once its pull ended
    assert wait_until(lambda: live(pool) == base)
    c = Req("c", tokens)  # finished (aborted) while its match is in flight
    half.connector.master.gate.clear()
    assert call(half, c, 0) == (None, False)
    future = half._reqs["c"].future
    assert future is not None
    half.request_finished(c, [])
    half.connector.master.gate.set()
    plan = future.result(timeout=5)
    assert plan.num_pool_blocks == 5 and plan.pull_end > plan.pull_start  # it was granted a lease
    assert wait_until(lambda: live(pool) == base), "the late match's lease was never released"


def test_a_pull_leaves_the_ledger_when_its_worker_reports_the_load_done(half, pool) -> None:
    """B39 under vLLM: the scheduler's ledger entry of a load ends when the worker's step output says the
    load ended (with its time, which teaches the link's contended throughput), not when the request ends."""
    tokens = prompt(6 * BS + 10, seed=21)
    put(half, pool, tokens, 5)
    ledger = half.connector.pulls
    reqs = [Req(f"q{i}", tokens) for i in range(2)]
    for i, req in enumerate(reqs):  # the second decides behind the first's pull
        assert answer(half, req, 0) > 0
        half.update_state_after_alloc(req, blocks(range(10 * i, 10 * i + 7)), 5 * BS)
    assert len(half.build_connector_meta(sched_out()).loads) == 2
    assert ledger.num_registered - ledger.num_released == 2
    peer = next(iter(half._reqs["q0"].plan.addresses.values()))  # type: ignore[union-attr]
    assert ledger.in_flight(peer).num_pulls == 2 and ledger.in_flight(peer).bytes_per_s == 0.0
    out = SimpleNamespace(
        finished_recving=None,
        kv_connector_worker_meta=KVPoolWorkerMetadata(loads_done={"q0": 0.2, "q1": 0.5}),
    )
    half.update_connector_output(out)  # both requests still run: their pulls are over
    assert ledger.in_flight(peer).num_pulls == 0
    nbytes = 5 * LAYOUT.block_nbytes  # q1 waited behind q0's bytes: both drained in its 0.5 s
    assert ledger.in_flight(peer).bytes_per_s == pytest.approx(2 * nbytes / 0.5)
    for req in reqs:
        half.request_finished(req, [])
    assert ledger.num_registered == ledger.num_released and not half._tickets


def test_a_request_finished_after_its_match_answered_releases_the_lease(half, pool) -> None:
    tokens = prompt(6 * BS + 10, seed=5)
    put(half, pool, tokens, 5)
    base = live(pool)
    req = Req("r", tokens)
    half.connector.master.gate.clear()
    assert call(half, req, 0) == (None, False)
    half.connector.master.gate.set()
    future = half._reqs["r"].future
    assert future is not None
    plan = future.result(timeout=5)  # answered; vLLM aborts the waiting request before asking again
    try:
        assert live(pool) == base + 1
        half.request_finished(req, [])
        assert wait_until(lambda: live(pool) == base, timeout_s=10.0)
    finally:
        half.connector.release(plan)


def test_a_load_after_the_local_hit_shrank_holds_a_lease(half, pool) -> None:
    tokens = prompt(6 * BS + 10, seed=6)
    put(half, pool, tokens, 5)
    req = Req("r", tokens)
    assert answer(half, req, 5 * BS) == 0  # vLLM holds every pooled block itself
    n = answer(half, req, 2 * BS)  # a step later two of them were evicted from vLLM's cache
    if n:
        half.update_state_after_alloc(req, blocks(range(7)), n)
        [load] = half.build_connector_meta(sched_out()).loads
        assert load.plan.lease_id is not None
        half.connector.release(load.plan)


@contextmanager
def silent_master() -> Iterator[str]:
    """A gRPC server that takes every call and never answers it (HTTP/2 is up, the master hangs)."""
    gate = threading.Event()

    def hang(request: bytes, context: Any) -> bytes:
        gate.wait(10)
        return b""

    hung = SimpleNamespace(service=lambda details: grpc.unary_unary_rpc_method_handler(hang))
    server = grpc.server(ThreadPoolExecutor(max_workers=16), handlers=[hung])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        gate.set()
        server.stop(0)


def test_a_silent_master_costs_the_hit_never_the_step() -> None:
    with silent_master() as address, built(address, match_wait_s=0.2, timeout_s=5.0) as h:
        req = Req("r", prompt(3 * BS, seed=7))
        t0 = time.monotonic()
        assert call(h, req, 0) == (None, False)
        assert answer(h, req, 0, timed=True) == 0
        assert 0.2 <= time.monotonic() - t0 < 3.0  # well before the master call times out (5 s)
        assert call(h, req, 0) == (0, False)  # never asked again
        assert h.num_match_timeouts == 1 and h._reqs["r"].num_matches == 1
        _, params = h.request_finished(req, [])
        assert params is not None and params["kvpool"]["decision"] == "no_answer"


def prefill(half: SchedulerHalf, req: Req, ids: list[int]) -> list[SaveSpec]:
    """Answer, allocate and schedule the whole prompt of `req`; returns the step's saves."""
    assert answer(half, req, 0) == 0
    half.update_state_after_alloc(req, blocks(ids), 0)
    half.kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (ids,))  # vLLM's KVCacheManager
    n = req.num_tokens
    meta = half.build_connector_meta(sched_out(new=[(req.request_id, 0)], tokens={req.request_id: n}))
    assert meta.step_tokens == [(n, 0)]
    req.num_computed_tokens = n
    req.all_token_ids.append(1)  # the sampled token
    return meta.saves


def decode(half: SchedulerHalf, req: Req, until: int) -> list[SaveSpec]:
    """One token a step until `until` tokens' KV is computed; returns every step's saves."""
    saves = []
    while req.num_computed_tokens < until:
        rid, c = req.request_id, req.num_computed_tokens
        saves += half.build_connector_meta(sched_out(cached=[(rid, c)], tokens={rid: 1})).saves
        req.num_computed_tokens += 1
        req.all_token_ids.append(2 + c % 7)
    return saves


def digest(half: SchedulerHalf) -> bytes:
    return half.namespaces.namespace(cache_salt=None, lora_path=None).digest()


def test_saves_each_full_block_once(half) -> None:
    req = Req("s", prompt(200, seed=8))
    [save] = prefill(half, req, [10, 11, 12, 13])
    assert (save.request_id, save.start_block, save.block_ids, save.final) == ("s", 0, [10, 11, 12], False)
    assert save.ns == digest(half)
    assert save.hashes == hash_blocks(digest(half), req.prompt_token_ids, BS)[:3]
    [save] = decode(half, req, until=4 * BS + 5)  # block 3 fills at 256 tokens
    assert (save.start_block, save.block_ids) == (3, [13])
    assert save.hashes == hash_blocks(digest(half), req.all_token_ids[: 4 * BS], BS)
    done, params = half.request_finished(req, [10, 11, 12, 13, 14])
    assert done is False and params is not None
    assert params["kvpool"]["decision"] == "none" and params["kvpool"]["num_saved_blocks"] == 4
    assert half.build_connector_meta(sched_out()).saves == []


def test_a_finished_requests_last_full_block_is_saved_before_its_blocks_are_freed(half) -> None:
    # Prefill 200 tokens, then one step of 1 + 55 drafts, all accepted: block 3's KV is computed, but the
    # step announced only the verified token (drafts are not counted done); then the request stops.
    req = Req("f", prompt(200, seed=9))
    assert len(prefill(half, req, [20, 21, 22, 23])) == 1
    so = sched_out(cached=[("f", 200)], tokens={"f": 56}, spec={"f": list(range(55))})
    assert half.build_connector_meta(so).saves == []
    req.num_computed_tokens = 4 * BS
    req.all_token_ids += [3] * 56
    done, params = half.request_finished(req, [20, 21, 22, 23, 24])
    assert done is True and params is not None and params["kvpool"]["decision"] == "none"
    assert params["kvpool"]["num_saved_blocks"] == 4  # the final save counts
    [save] = half.build_connector_meta(sched_out()).saves
    assert (save.start_block, save.block_ids, save.final) == (3, [23], True)
    assert save.hashes == hash_blocks(digest(half), req.all_token_ids[: 4 * BS], BS)
    assert half.build_connector_meta(sched_out()).saves == []


def test_decode_blocks_of_a_short_first_prompt_are_saved(half) -> None:
    req = Req("short", prompt(10, seed=11))
    saves = prefill(half, req, [5, 6]) + decode(half, req, until=BS - 1)
    wait_until(
        lambda: half.link.namespaces.known(digest(half)), timeout_s=10.0
    )  # a fix may register in the background
    [save] = saves + decode(half, req, until=BS + 3)
    assert (save.start_block, save.block_ids) == (0, [5])
