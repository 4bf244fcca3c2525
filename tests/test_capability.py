"""Data-plane capabilities (issue #12): the HMAC itself, store refusals over real UCX on 127.0.0.1, a
LocalCluster with capabilities on (publish, read, re-replication), and the client treating a refused
capability as a failed block (recompute), never as a bad replica."""

from __future__ import annotations

import hmac
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("UCX_TLS", "tcp")  # noqa: E402 - before UCX initialises

from kvpool.capability import (  # noqa: E402
    CAPABILITY_NBYTES,
    READ,
    WRITE,
    Capabilities,
    CapabilityKey,
    CapabilitySettings,
    from_settings,
    message,
    refused,
)
from kvpool.errors import InvalidArgument, PermissionDenied  # noqa: E402
from kvpool.store import Segment, SlotTable  # noqa: E402
from kvpool.store.slots import Reservation  # noqa: E402
from kvpool.types import FakeClock, Location  # noqa: E402
from tests.capabilities import require_ucx
from tests.fresh_process import in_fresh_process  # noqa: E402
from transfer import BlockRead, BlockWrite, checksum  # noqa: E402

SECRET = b"s" * 32
NB = 4096
NS = b"n" * 16
NODE = "store-a"
NOW = 1_700_000_000_000


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _caps(clock: FakeClock | None = None, secret: bytes = SECRET) -> Capabilities:
    return Capabilities(CapabilityKey(secret), clock=clock or FakeClock(NOW), skew_ms=1000)


# ---------------------------------------------------------------- the MAC


def test_mac_is_rfc2104_hmac_sha256_truncated() -> None:
    msg = message(READ, NS, _h(1), NODE, 3, 7, NOW)
    want = hmac.digest(SECRET, msg, "sha256")[:CAPABILITY_NBYTES]
    assert CapabilityKey(SECRET).mac(msg) == want
    long_key = b"k" * 100  # longer than SHA-256's block: hashed first (RFC 2104 §2)
    assert CapabilityKey(long_key).mac(msg) == hmac.digest(long_key, msg, "sha256")[:16]


def test_message_is_tagged_and_length_prefixed() -> None:
    a = message(READ, NS, _h(1), "ab", 1, 1, 5)
    b = message(READ, NS, _h(1), "a", 1, 1, 5)
    assert a != b and a.startswith(b"\x0fkvpool-cap-v1")
    # moving a byte between fields never gives the same message
    assert message(READ, b"x" * 16, b"y" * 17, NODE, 1, 1, 5) != message(
        READ, b"x" * 17, b"y" * 16, NODE, 1, 1, 5
    )
    with pytest.raises(InvalidArgument):
        message("delete", NS, _h(1), NODE, 1, 1, 5)


def test_short_or_double_secret_is_refused(tmp_path: Any) -> None:
    with pytest.raises(InvalidArgument, match="at least 16"):
        CapabilityKey(b"short")
    f = tmp_path / "secret"
    f.write_text("x" * 40)
    with pytest.raises(InvalidArgument, match="chmod 600"):  # readable by others: refused (#46)
        from_settings(CapabilitySettings(cluster_secret_file=str(f)))
    f.chmod(0o600)
    with pytest.raises(InvalidArgument, match="not both"):
        from_settings(CapabilitySettings(cluster_secret="y" * 40, cluster_secret_file=str(f)))
    assert from_settings(CapabilitySettings()) is None  # no secret: capabilities off
    caps = from_settings(CapabilitySettings(cluster_secret_file=str(f)))
    assert caps is not None and caps.sign(READ, NS, _h(1), NODE, 1, 1, 5) == _caps(secret=b"x" * 40).sign(
        READ, NS, _h(1), NODE, 1, 1, 5
    )


def test_check_accepts_only_the_signed_fields_until_expiry() -> None:
    clock = FakeClock(NOW)
    caps = _caps(clock)
    exp = NOW + 5000
    cap = caps.sign(READ, NS, _h(1), NODE, 3, 7, exp)
    caps.check(READ, NS, _h(1), NODE, 3, 7, exp, cap)
    bad = {
        "op": (WRITE, NS, _h(1), NODE, 3, 7, exp, cap),
        "namespace": (READ, b"m" * 16, _h(1), NODE, 3, 7, exp, cap),
        "block": (READ, NS, _h(2), NODE, 3, 7, exp, cap),
        "node": (READ, NS, _h(1), "store-b", 3, 7, exp, cap),
        "slot": (READ, NS, _h(1), NODE, 4, 7, exp, cap),
        "generation": (READ, NS, _h(1), NODE, 3, 8, exp, cap),
        "expiry": (READ, NS, _h(1), NODE, 3, 7, exp + 10_000, cap),
        "forged": (READ, NS, _h(1), NODE, 3, 7, exp, bytes(16)),
        "other secret": (
            READ,
            NS,
            _h(1),
            NODE,
            3,
            7,
            exp,
            _caps(secret=b"t" * 32).sign(READ, NS, _h(1), NODE, 3, 7, exp),
        ),
    }
    for what, args in bad.items():
        with pytest.raises(PermissionDenied, match="capability invalid"):
            caps.check(*args)
            pytest.fail(f"accepted with another {what}")
    with pytest.raises(PermissionDenied, match="capability missing"):
        caps.check(READ, NS, _h(1), NODE, 3, 7, exp, b"")
    clock.advance(5000 + 1000)  # at expiry + skew: still valid
    caps.check(READ, NS, _h(1), NODE, 3, 7, exp, cap)
    clock.advance(1)
    with pytest.raises(PermissionDenied, match="capability expired"):
        caps.check(READ, NS, _h(1), NODE, 3, 7, exp, cap)
    assert refused("PermissionDenied: capability expired for read of slot 3 (1 ms ago)")


def test_verify_costs_about_one_hmac() -> None:
    """A check is one HMAC-SHA256 over a short message plus field packing: compared with raw HMACs timed in
    the same loop (so a loaded machine slows both alike), never more than 20 of them (about 3 measured on
    the 2-core VM: the bound leaves 5x and more for noise; a key derived per check costs far more)."""
    import hashlib

    caps = _caps()
    cap = caps.sign(READ, NS, _h(1), NODE, 3, 7, NOW + 10**6)
    key, msg = os.urandom(32), os.urandom(96)
    best_check = best_hmac = float("inf")
    for _ in range(5):  # best of 5 rounds of each, interleaved
        t0 = time.perf_counter()
        for _ in range(2_000):
            caps.check(READ, NS, _h(1), NODE, 3, 7, NOW + 10**6, cap)
        t1 = time.perf_counter()
        for _ in range(2_000):
            hmac.new(key, msg, hashlib.sha256).digest()
        t2 = time.perf_counter()
        best_check, best_hmac = min(best_check, t1 - t0), min(best_hmac, t2 - t1)
    print(f"capability check {best_check / 2e-3:.2f} us, raw HMAC {best_hmac / 2e-3:.2f} us")
    assert best_check < 20 * best_hmac


# ---------------------------------------------------------------- a store over real UCX


def _require_ucx() -> None:
    require_ucx()


@pytest.fixture(scope="module")
def ucx() -> Iterator[Any]:
    _require_ucx()
    from transfer import UcxTransport

    t = UcxTransport(probe_bytes=1 << 20)
    yield t
    t.close()


def _store(caps: Capabilities | None, *, shared: bool = False) -> tuple[SlotTable, Any]:
    """An in-process store; `shared`: its segment is mapped by same-host readers (`transfer.shared_segment`)."""
    from transfer import UcxBlockServer

    segment = Segment(16 * NB, NB, pin_memory="off", share=shared)
    table = SlotTable(segment, capabilities=caps, node_id=NODE)
    server = UcxBlockServer(table, "127.0.0.1", 0, send_timeout_s=5.0, shared=segment.shared)
    server.start()
    return table, server


def _committed(table: SlotTable, caps: Capabilities | None, slot: int, data: bytes) -> None:
    table.reserve([Reservation(slot, 1, NS, _h(slot))], 60_000)
    wcap = caps.sign(WRITE, NS, _h(slot), NODE, slot, 1, NOW + 60_000) if caps else b""
    table.begin_write(slot, 1, NB, wcap, NOW + 60_000)[:] = data
    table.end_write(slot, 1, checksum(data), True)
    assert table.commit([(slot, 1)]) == [(slot, 1, "")]


def _read(ucx: Any, server: Any, read: BlockRead) -> tuple[Any, bytes]:
    out = bytearray(b"\xee" * NB)
    [res] = ucx.read_blocks(server.address, [read], [memoryview(out)], timeout_s=5)
    return res, bytes(out)


def _fresh(case: str, *args: object) -> None:
    """The in-process stores below run in a fresh interpreter each (tests/fresh_process.py): after other
    modules' UCX work in the same pytest process a new in-process server's handshake could be swallowed."""
    in_fresh_process("tests.test_capability", case, *args, transport_kwargs="probe_bytes=1 << 20")


@pytest.mark.parametrize("shared", [False, True], ids=["ucx", "same-host-mapped"])
def test_store_serves_only_reads_with_a_valid_capability(shared: bool) -> None:
    """Over UCX and through a same-host reader's mapping of the segment alike: the store checks every read."""
    _fresh("_case_store_serves_only_reads_with_a_valid_capability", shared)


def _case_store_serves_only_reads_with_a_valid_capability(ucx: Any, shared: bool) -> None:
    clock = FakeClock(NOW)
    caps = _caps(clock)
    table, server = _store(caps, shared=shared)
    try:
        data = bytes(range(256)) * (NB // 256)
        _committed(table, caps, 3, data)
        _committed(table, caps, 4, b"\x04" * NB)
        exp = NOW + 10_000
        good = caps.sign(READ, NS, _h(3), NODE, 3, 1, exp)
        res, out = _read(ucx, server, BlockRead(3, 1, NB, good, exp))
        assert res.ok and out == data
        assert (ucx._peers[server.address].mapping is not None) == shared
        untouched = b"\xee" * NB
        refusals = [
            ("missing", BlockRead(3, 1, NB)),
            ("invalid", BlockRead(3, 1, NB, bytes(16), exp)),  # forged
            ("invalid", BlockRead(4, 1, NB, good, exp)),  # another slot's
            (
                "invalid",
                BlockRead(3, 1, NB, caps.sign(READ, NS, _h(4), NODE, 3, 1, exp), exp),
            ),  # another block's
            ("invalid", BlockRead(3, 1, NB, caps.sign(READ, NS, _h(3), "store-b", 3, 1, exp), exp)),  # node's
            ("invalid", BlockRead(3, 1, NB, caps.sign(WRITE, NS, _h(3), NODE, 3, 1, exp), exp)),  # a write's
            ("invalid", BlockRead(3, 1, NB, good, exp + 1)),  # a stretched expiry
        ]
        for k, (want, read) in enumerate(refusals):
            res, out = _read(ucx, server, read)
            assert not res.ok and f"PermissionDenied: capability {want}" in res.error, (k, res.error)
            assert out == untouched, k  # not one byte moved
        stale = caps.sign(READ, NS, _h(3), NODE, 3, 2, exp)  # a generation the slot is not at
        res, out = _read(ucx, server, BlockRead(3, 2, NB, stale, exp))
        assert not res.ok and "StaleGeneration" in res.error and out == untouched
        clock.advance(10_000 + 1000 + 1)  # past expiry + skew
        res, out = _read(ucx, server, BlockRead(3, 1, NB, good, exp))
        assert not res.ok and "capability expired" in res.error and out == untouched
        deadline = time.monotonic() + 5  # a same-host reader's `mdone` (its unpin) is not waited for
        while table.num_inflight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert table.num_inflight == 0
    finally:
        server.stop()


def test_store_accepts_only_writes_with_a_write_capability() -> None:
    _fresh("_case_store_accepts_only_writes_with_a_write_capability")


def _case_store_accepts_only_writes_with_a_write_capability(ucx: Any) -> None:
    caps = _caps()
    table, server = _store(caps)
    try:
        table.reserve([Reservation(s, 1, NS, _h(s)) for s in (5, 6)], 60_000)
        data = b"\x05" * NB
        exp = NOW + 10_000
        read_cap = caps.sign(READ, NS, _h(5), NODE, 5, 1, exp)
        for w in (
            BlockWrite(5, 1, data, checksum(data)),
            BlockWrite(5, 1, data, checksum(data), read_cap, exp),  # a read capability never writes
            BlockWrite(5, 1, data, checksum(data), caps.sign(WRITE, NS, _h(6), NODE, 6, 1, exp), exp),
        ):
            [res] = ucx.write_blocks(server.address, [w], timeout_s=5)
            assert not res.ok and "PermissionDenied: capability" in res.error
        assert table.state(5)[0].name == "RESERVED"
        assert bytes(table.segment.slot_view(5)) == bytes(NB)  # nothing landed
        wcap = caps.sign(WRITE, NS, _h(5), NODE, 5, 1, exp)
        [res] = ucx.write_blocks(
            server.address, [BlockWrite(5, 1, data, checksum(data), wcap, exp)], timeout_s=5
        )
        assert res.ok and table.state(5)[0].name == "WRITTEN"
    finally:
        server.stop()


def test_secret_off_serves_without_capability() -> None:
    _fresh("_case_secret_off_serves_without_capability")


def _case_secret_off_serves_without_capability(ucx: Any) -> None:
    table, server = _store(None)
    try:
        _committed(table, None, 2, b"\x02" * NB)
        res, out = _read(ucx, server, BlockRead(2, 1, NB))
        assert res.ok and out == b"\x02" * NB
    finally:
        server.stop()


# ---------------------------------------------------------------- a LocalCluster with capabilities on

LAYOUT = "kv1:float32:b16:l2:h2:d16"  # 8 KiB blocks


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    _require_ucx()
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec

    spec = LocalClusterSpec(
        layout=LAYOUT,
        num_stores=2,
        num_prefill=0,
        num_decode=0,
        segment_size="8MiB",
        heartbeat_timeout_ms=30_000,
    )
    with LocalCluster(spec) as c:
        yield c


class RecordingMaster:
    """A `MasterClient` that records bad-replica reports (and can tamper with capabilities)."""

    def __init__(self, address: str, *, forge: bool = False) -> None:
        from kvpool.client import MasterClient

        self.inner = MasterClient(address)
        self.forge = forge
        self.reports: list[str] = []

    def match(self, *args: Any, **kwargs: Any) -> Any:
        m = self.inner.match(*args, **kwargs)
        if not self.forge:
            return m
        forged = [tuple(replace(x, capability=bytes(16)) for x in reps) for reps in m.replicas]
        return replace(m, replicas=forged)

    def report_bad_replica(self, ns: bytes, block_hash: bytes, loc: Location, reason: str) -> None:
        self.reports.append(reason)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _publish(cluster: Any, ucx: Any, n: int, seed: int) -> tuple[bytes, list[bytes], list[np.ndarray]]:
    from kvpool.client import MasterClient, PoolClient
    from kvpool.types import KVLayout

    nb = KVLayout.from_fingerprint(LAYOUT).block_nbytes
    with MasterClient(cluster.master_address) as mc:
        ns, _ = mc.register_namespace("m", "v1", LAYOUT)
    rng = np.random.default_rng(seed)
    blocks = [rng.integers(0, 256, nb, dtype=np.uint8) for _ in range(n)]
    hashes = [rng.bytes(16) for _ in range(n)]
    with PoolClient(cluster.master_address, ucx, block_nbytes=nb) as pool:
        put = pool.put_blocks(ns, None, hashes, blocks)
    assert put.num_committed == n, put
    return ns, hashes, blocks


def test_cluster_grants_capabilities_and_stores_enforce_them(cluster: Any, ucx: Any) -> None:
    from kvpool.client import MasterClient, PoolClient
    from kvpool.types import KVLayout

    nb = KVLayout.from_fingerprint(LAYOUT).block_nbytes
    ns, hashes, blocks = _publish(cluster, ucx, 6, seed=1)
    with PoolClient(cluster.master_address, ucx, block_nbytes=nb) as pool:
        got = pool.get_blocks(ns, hashes)  # the master grants, the stores verify
    assert got.num_ok == 6 and all(g.data == b.tobytes() for g, b in zip(got.blocks, blocks, strict=True))
    with MasterClient(cluster.master_address) as mc:
        peek = mc.match(ns, hashes)  # no lease: no capability
        assert peek.num_matched == 6 and all(not x.capability for reps in peek.replicas for x in reps)
        leased = mc.match(ns, hashes, lease_ttl_ms=5000)
        try:
            loc = leased.replicas[0][0]
            assert len(loc.capability) == 16 and loc.capability_expiry_ms > time.time() * 1000
            peer = leased.data_address(loc.node_id)
            out = bytearray(nb)
            # reaching the UCX port is not enough: no capability, no bytes
            [res] = ucx.read_blocks(
                peer, [BlockRead(loc.slot, loc.generation, nb)], [memoryview(out)], timeout_s=5
            )
            assert not res.ok and "capability missing" in res.error and out == bytearray(nb)
            read = BlockRead(loc.slot, loc.generation, nb, loc.capability, loc.capability_expiry_ms)
            [res] = ucx.read_blocks(peer, [read], [memoryview(out)], timeout_s=5)
            assert res.ok and bytes(out) == blocks[0].tobytes()
        finally:
            mc.release_lease(leased.lease_id)


def test_drain_copies_between_stores_with_capabilities(cluster: Any, ucx: Any) -> None:
    from kvpool.client import MasterClient, PoolClient
    from kvpool.types import KVLayout

    nb = KVLayout.from_fingerprint(LAYOUT).block_nbytes
    ns, hashes, blocks = _publish(cluster, ucx, 4, seed=2)
    with MasterClient(cluster.master_address) as mc:
        owners = {x.node_id for reps in mc.match(ns, hashes).replicas for x in reps}
        victim = sorted(owners)[0]
        mc.drain(victim)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = {x.node_id for reps in mc.match(ns, hashes).replicas for x in reps}
            if victim not in now and mc.match(ns, hashes).num_matched == 4:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"drain of {victim} did not move the blocks:\n{cluster.logs()}")
    with PoolClient(cluster.master_address, ucx, block_nbytes=nb) as pool:
        got = pool.get_blocks(ns, hashes)
    assert got.num_ok == 4 and all(g.data == b.tobytes() for g, b in zip(got.blocks, blocks, strict=True))


def test_refused_capability_is_a_failed_block_not_a_bad_replica(cluster: Any, ucx: Any) -> None:
    from kvpool.client import PoolClient
    from kvpool.connector.pull import pull_blocks
    from kvpool.types import KVLayout

    nb = KVLayout.from_fingerprint(LAYOUT).block_nbytes
    ns, hashes, blocks = _publish(cluster, ucx, 3, seed=3)
    forger = RecordingMaster(cluster.master_address, forge=True)
    try:
        m = forger.match(ns, hashes, lease_ttl_ms=5000)
        addrs = {n: i.data_address for n, i in m.nodes.items()}
        run, failed = pull_blocks(
            ucx, forger, ns, hashes, m.replicas, addrs, start=0, end=3, block_nbytes=nb, timeout_s=5
        )
        assert run == [] and failed >= 3  # nothing reused: the connector recomputes the whole prefix
        forger.inner.release_lease(m.lease_id)
        pool = PoolClient(cluster.master_address, ucx, block_nbytes=nb)
        pool.master.close()
        pool.master = forger  # type: ignore[assignment]
        got = pool.get_blocks(ns, hashes)
        assert got.num_ok == 0 and all("capability invalid" in b.error for b in got.blocks)
        assert forger.reports == []  # a refused capability never strips the pool of a good replica
        honest = RecordingMaster(cluster.master_address)
        m = honest.match(ns, hashes, lease_ttl_ms=5000)
        run, failed = pull_blocks(
            ucx, honest, ns, hashes, m.replicas, addrs, start=0, end=3, block_nbytes=nb, timeout_s=5
        )
        honest.inner.release_lease(m.lease_id)
        honest.inner.close()
        assert failed == 0 and [r.tobytes() for r in run] == [b.tobytes() for b in blocks]
    finally:
        forger.inner.close()


def test_connector_recomputes_when_the_capability_is_refused(
    cluster: Any, ucx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpool.connector.connector import KVConnector
    from kvpool.connector.local_tier import LocalTier
    from kvpool.cost import RecomputeModel
    from kvpool.types import KVLayout

    lay = KVLayout.from_fingerprint(LAYOUT)
    ns, hashes, _ = _publish(cluster, ucx, 4, seed=4)
    monkeypatch.setenv("KVPOOL_FORCE_DECISION", "pull")
    forger = RecordingMaster(cluster.master_address, forge=True)
    conn = None
    try:
        conn = KVConnector(
            master=forger, pool=None, transport=ucx, node_id="p0", block_size=lay.block_size,
            block_nbytes=lay.block_nbytes, recompute=RecomputeModel(overhead_s=0.0, per_token_s=1.0, per_pair_s=0.0),
            local_tier=LocalTier(0),
        )  # fmt: skip
        tokens = list(range(4 * lay.block_size + 1))
        loaded = conn.load_prefix(ns, tokens, hashes, count_hit=False)
        assert loaded.stats.decision == "pull" and loaded.stats.num_pool_blocks == 4
        assert loaded.blocks == [] and loaded.stats.num_reused_tokens == 0  # → recompute everything
        assert loaded.stats.num_failed_blocks >= 4 and forger.reports == []
    finally:
        if conn is not None:
            conn.close()  # its lease release goes out before the master link closes
        forger.inner.close()
