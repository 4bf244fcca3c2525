"""The index's memory limit (`--max-index-bytes`): past it a Reserve first evicts leaves by the policy, and
when nothing can be evicted (every block leased) it is refused RESOURCE_EXHAUSTED, counted in `admin
status` and in Prometheus (real master service, real store process, tiny layout)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from kvpool.client import MasterClient, PoolClient
from kvpool.errors import ResourceExhausted
from kvpool.master import MasterSettings, serve
from kvpool.master.metrics import master_registry
from kvpool.master.procs import start_master, start_store
from kvpool.types import KVLayout
from tests.capabilities import require_ucx
from tests.test_master_failures import free_port

TINY = "kv1:float16:b1:l1:h1:d1"
LAY = KVLayout.from_fingerprint(TINY)
CHAIN = 64
transfer = pytest.importorskip("transfer")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def transport() -> Iterator[object]:
    require_ucx()
    t = transfer.UcxTransport()
    yield t
    t.close()


def _chain(seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16) for _ in range(CHAIN)]


def test_past_the_limit_leaves_are_evicted_then_reserves_refused(transport: object) -> None:
    server = serve(MasterSettings(port=0, layout=TINY, metrics=False))
    address = server.address
    store = start_store(address, "s0", segment="1MiB", layout=TINY)
    m = server.master
    data = [np.zeros(LAY.block_nbytes, np.uint8)] * CHAIN
    try:
        with MasterClient(address) as c, PoolClient(address, transport, block_nbytes=LAY.block_nbytes) as w:
            ns, _ = c.register_namespace("adm", "v1", TINY)
            a, b, d = _chain(1), _chain(2), _chain(3)
            assert w.put_blocks(ns, None, a, data).num_committed == CHAIN
            with m.lock:
                limit = m.admission.index_bytes()  # full now: the next chain needs room
            m.settings = m.settings.model_copy(update={"max_index_bytes": limit})
            assert w.put_blocks(ns, None, b, data).num_committed == CHAIN  # room made by evicting a's leaves
            assert c.match(ns, b).num_matched == CHAIN
            assert c.match(ns, a).num_matched < CHAIN
            assert m.admission.num_evictions >= CHAIN and m.admission.num_refusals == 0
            with m.lock:
                assert m.index.num_blocks <= 2 * CHAIN - CHAIN  # within the limit's block count
            leases = [c.match(ns, x, lease_ttl_ms=60_000) for x in (a, b)]  # every block leased
            assert sum(x.num_matched for x in leases) == m.index.num_blocks
            with pytest.raises(ResourceExhausted, match="max-index-bytes"):
                w.put_blocks(ns, None, d, data)
            s = c.stats()
            assert (s.index_bytes_limit, s.num_admission_refusals) == (limit, 1)
            assert s.index_bytes > 0
        text = generate_latest(master_registry(m)).decode()
        assert "kvpool_master_admission_refusals_total 1.0" in text
        assert f"kvpool_master_index_memory_bytes_limit {float(limit)}" in text
    finally:
        store.kill()
        server.stop()


def test_the_flag_sets_the_limit_and_the_default_is_half_the_memory() -> None:
    import psutil

    assert MasterSettings().max_index_bytes == psutil.virtual_memory().total // 2
    proc = start_master("--max-index-bytes", "3MiB", layout=TINY)
    try:
        with MasterClient(proc.grpc_address) as c:
            assert c.stats().index_bytes_limit == 3 << 20
    finally:
        proc.kill()


def test_kvpool_up_passes_the_limit_to_each_master(tmp_path: Path) -> None:
    from kvpool.cluster.launch import plan
    from kvpool.cluster.spec import load_spec
    from kvpool.errors import InvalidArgument

    path = tmp_path / "cluster.toml"
    path.write_text('[master]\nport = 0\nmax_index_bytes = "2GiB"\n')
    [master] = [x for x in plan(load_spec(path), TINY) if x.role == "master"]
    assert master.args[master.args.index("--max-index-bytes") + 1] == str(2 << 30)
    path.write_text("[master]\nport = 0\n")
    [master] = [x for x in plan(load_spec(path), TINY) if x.role == "master"]
    assert "--max-index-bytes" not in master.args  # the master's own default
    path.write_text('[master]\nmax_index_bytes = "plenty"\n')
    with pytest.raises(InvalidArgument, match="max_index_bytes"):
        load_spec(path)


def test_an_inventory_past_the_limit_is_freed_not_adopted(transport: object) -> None:
    """A master restarted with a limit its stores' blocks do not fit in refuses them at adoption (counted)
    and frees their slots, rather than growing past its limit."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = serve(MasterSettings(port=port, layout=TINY, metrics=False))
    store = start_store(address, "s0", segment="1MiB", layout=TINY)
    try:
        with MasterClient(address) as c, PoolClient(address, transport, block_nbytes=LAY.block_nbytes) as w:
            ns, _ = c.register_namespace("adm", "v1", TINY)
            data = [np.zeros(LAY.block_nbytes, np.uint8)] * CHAIN
            assert w.put_blocks(ns, None, _chain(4), data).num_committed == CHAIN
        server.stop()
        server = serve(MasterSettings(port=port, layout=TINY, metrics=False, max_index_bytes=1))
        m = server.master
        with MasterClient(address) as c:
            assert c.register_namespace("adm", "v1", TINY)[0] == ns
        _wait(lambda: "s0" in m.st.nodes and m.st.nodes["s0"].ready, 30, "the store adopted")
        _wait(lambda: m.admission.num_refusals >= 1, 30, "the inventory refused")
        _wait(lambda: m.st.nodes["s0"].num_allocated == 0, 30, "its slots freed")
        assert m.index.num_blocks == 0
    finally:
        store.kill()
        server.stop()


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)
