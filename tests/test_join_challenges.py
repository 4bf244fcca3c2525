"""The master's open calls cannot be used to lock stores out (issue #46, item 4).

Real processes: a secured `kvpool master` (the test holds its cluster secret, so it can answer
challenges itself), real gRPC calls and a real `kvpool store`. Join challenges are stateless MACs
(`kvpool.master.challenges`), so 10,000 open challenges leave a store free to register; a forged,
tampered, expired, another node's or another master's challenge is refused; `JoinChallenge` and
`RegisterNode` are rate limited per peer address, and one peer over its limit leaves the others alone.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

os.environ.setdefault("UCX_TLS", "tcp")  # noqa: E402 - before UCX initialises

from kvpool.capability import Capabilities, CapabilityKey  # noqa: E402
from kvpool.master.procs import Proc, start  # noqa: E402
from kvpool.master.ratelimit import PeerRateLimiter, peer_host  # noqa: E402
from kvpool.membership import store_proof  # noqa: E402
from kvpool.rpc import PROTOCOL_VERSION  # noqa: E402
from kvpool.types import KVLayout  # noqa: E402
from kvpool.v1 import kvpool_pb2 as pb  # noqa: E402
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc  # noqa: E402
from tests.capabilities import mark, require_ucx  # noqa: E402

LAYOUT = "kv1:float32:b64:l4:h2:d32"
SECRET = "c" * 64


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _master(**env: str) -> Proc:
    base = {"KVPOOL_CLUSTER_SECRET": SECRET, "KVPOOL_METRICS": "false"}
    return start(["master", "--port", "0", "--layout", LAYOUT], env=base | env)


def _port(proc: Proc) -> int:
    return int(proc.grpc_address.rsplit(":", 1)[1])


@pytest.fixture
def caps() -> Capabilities:
    return Capabilities(CapabilityKey(SECRET.encode()))


def _endpoint(node_id: str) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "role": "store",
        "epoch": 1,
        "grpc_address": "127.0.0.1:1",
        "data_address": "127.0.0.1:2",
    }


def _register(stub: Any, caps: Capabilities, node_id: str, challenge: bytes, **change: Any) -> Any:
    endpoint = _endpoint(node_id)
    req = pb.RegisterNodeRequest(
        node=pb.NodeEndpoint(**(endpoint | change)),
        protocol_version=PROTOCOL_VERSION,
        layout_fingerprint=LAYOUT,
        num_slots=4,
        block_nbytes=KVLayout.from_fingerprint(LAYOUT).block_nbytes,
        challenge=challenge,
        proof=store_proof(caps, challenge, **(endpoint | change)),
    )
    return stub.RegisterNode(req, timeout=10)


def _challenge(stub: Any, node_id: str) -> bytes:
    return bytes(stub.JoinChallenge(pb.JoinChallengeRequest(node_id=node_id), timeout=10).challenge)


def _refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


@pytest.fixture
def unlimited_master() -> Iterator[Proc]:
    m = _master(KVPOOL_JOIN_RATE_PER_S="0")  # no rate limit: what is tested is the challenges' state
    try:
        yield m
    finally:
        m.kill()


def test_ten_thousand_open_challenges_do_not_stop_a_store_from_registering(
    unlimited_master: Proc, caps: Capabilities
) -> None:
    require_ucx()
    address = unlimited_master.grpc_address

    def flood(k: int) -> int:  # many callers: one channel (connection) each
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.MasterStub(ch)
            return sum(len(_challenge(stub, f"nobody-{k}-{i}")) for i in range(2_500))

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(flood, range(4))) == 10_000 * 56  # every one answered, none refused
    store = start(  # a real store, with the secret
        ["store", "--master", address, "--listen", "127.0.0.1", "--grpc-port", "0", "--data-port", "0",
         "--segment-size", "8MiB", "--layout", LAYOUT, "--node-id", "after-the-flood", "--pin-memory", "off"],
        env={"KVPOOL_CLUSTER_SECRET": SECRET},
    )  # fmt: skip
    try:
        assert store.ready["node_id"] == "after-the-flood"
    finally:
        store.kill()
    with grpc.insecure_channel(address) as ch:  # and one answered by hand, after 10,000 more
        stub = pb_grpc.MasterStub(ch)
        held = [_challenge(stub, "late") for _ in range(10_000)]
        assert _register(stub, caps, "late", held[0]).secured


def test_forged_expired_replayed_or_foreign_challenges_are_refused(
    unlimited_master: Proc, caps: Capabilities
) -> None:
    other = _master(KVPOOL_JOIN_RATE_PER_S="0", KVPOOL_CHALLENGE_TTL_MS="300")  # same secret
    try:
        with (
            grpc.insecure_channel(unlimited_master.grpc_address) as ch,
            grpc.insecure_channel(other.grpc_address) as ch2,
        ):
            stub, stub2 = pb_grpc.MasterStub(ch), pb_grpc.MasterStub(ch2)

            def unauthenticated(call: Any, match: str) -> None:
                err = _refused(call)
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
                assert match in err.details(), err.details()

            good = _challenge(stub, "s1")
            forged = os.urandom(len(good))
            unauthenticated(lambda: _register(stub, caps, "s1", forged), "not this master's")
            tampered = bytes([good[0] ^ 1]) + good[1:]  # its time moved
            unauthenticated(lambda: _register(stub, caps, "s1", tampered), "not this master's")
            unauthenticated(lambda: _register(stub, caps, "s1", good[:32]), "malformed")
            foreign = _challenge(stub, "another-node")  # another node id's challenge, proof made for s1
            unauthenticated(lambda: _register(stub, caps, "s1", foreign), "not this master's")
            elsewhere = _challenge(stub2, "s1")  # another master's (same secret)
            unauthenticated(lambda: _register(stub, caps, "s1", elsewhere), "not this master's")
            assert _register(stub, caps, "s1", good).secured  # the untouched one works once
            unauthenticated(lambda: _register(stub, caps, "s1", good), "already spent")
            stale = _challenge(stub2, "s2")
            time.sleep(0.6)  # past the other master's challenge_ttl_ms
            unauthenticated(lambda: _register(stub2, caps, "s2", stale), "expired")
            assert _register(stub2, caps, "s2", _challenge(stub2, "s2")).secured
    finally:
        other.kill()


@mark("ipv6", None if _ipv6_loopback() else "no IPv6 loopback (::1) for a second peer address")
def test_the_open_calls_are_rate_limited_per_peer_and_spare_other_peers(caps: Capabilities) -> None:
    m = _master(KVPOOL_JOIN_RATE_PER_S="0.01", KVPOOL_JOIN_BURST="5", KVPOOL_BIND_HOST="::")
    try:
        port = _port(m)
        with (
            grpc.insecure_channel(f"[::1]:{port}") as noisy_ch,
            grpc.insecure_channel(f"127.0.0.1:{port}") as quiet_ch,
        ):
            noisy, quiet = pb_grpc.MasterStub(noisy_ch), pb_grpc.MasterStub(quiet_ch)
            for _ in range(5):
                _challenge(noisy, "n")
            err = _refused(lambda: _challenge(noisy, "n"))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "join_rate_per_s" in err.details() and "::1" in err.details()
            err = _refused(lambda: _register(noisy, caps, "n", b"x" * 56))  # RegisterNode shares it
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            # a fresh connection from the same address gets no fresh bucket
            own_connection = [("grpc.use_local_subchannel_pool", 1)]  # a new TCP connection, new port
            with grpc.insecure_channel(f"[::1]:{port}", options=own_connection) as again:
                err = _refused(lambda: _challenge(pb_grpc.MasterStub(again), "n"))
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            # the other peer is untouched: it asks and registers (2 of its 5 calls)
            assert _register(quiet, caps, "quiet", _challenge(quiet, "quiet")).secured
    finally:
        m.kill()


def test_peer_buckets_are_by_host_and_bounded() -> None:
    assert peer_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert peer_host("ipv6:%5B::1%5D:41706") == "::1"
    assert peer_host("ipv6:[fd00::2]:9") == "fd00::2"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"
    now = [0.0]
    limiter = PeerRateLimiter(rate_per_s=1.0, burst=2, max_peers=100, clock_s=lambda: now[0])
    for i in range(10_000):  # many addresses: at most max_peers buckets
        limiter.take(f"ipv4:10.{i // 256 % 256}.{i % 256}.1:{i}", "JoinChallenge")
    assert limiter.num_peers() == 100
    limiter.take("ipv4:1.1.1.1:1", "x")
    limiter.take("ipv4:1.1.1.1:2", "x")
    with pytest.raises(Exception, match="join_rate_per_s"):
        limiter.take("ipv4:1.1.1.1:3", "x")
    now[0] += 1.0  # refilled at rate_per_s
    limiter.take("ipv4:1.1.1.1:4", "x")
