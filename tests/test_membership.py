"""Only proven members join a secured cluster (issue #24): stores prove the cluster secret by
challenge-response, every other member presents a join token the operator can revoke.

Real processes: a secured `LocalCluster` master and store; stores started without the secret, with a
wrong one, and a replayed registration are refused and hold no blocks; calls without a token are
refused; a serving node whose token is revoked is refused at its next heartbeat and leaves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

os.environ.setdefault("UCX_TLS", "tcp")  # noqa: E402 - before UCX initialises

from kvpool.capability import Capabilities, CapabilityKey  # noqa: E402
from kvpool.errors import (  # noqa: E402
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from kvpool.master.members import Membership  # noqa: E402
from kvpool.membership import (  # noqa: E402
    JOIN_TOKEN_METADATA,
    add_token,
    read_tokens,
    revoke_token,
    store_proof,
    token_digest,
)
from kvpool.types import FakeClock  # noqa: E402
from tests.capabilities import require_ucx

LAYOUT = "kv1:float32:b16:l2:h2:d16"  # 8 KiB blocks
SECRET = b"m" * 32
ENDPOINT = {
    "node_id": "s1",
    "role": "store",
    "epoch": 7,
    "grpc_address": "127.0.0.1:1",
    "data_address": "127.0.0.1:2",
}


def _caps(secret: bytes = SECRET) -> Capabilities:
    return Capabilities(CapabilityKey(secret))


# ---------------------------------------------------------------- proofs, challenges and token files


def _members(tmp_path: Any, clock: FakeClock, **kw: Any) -> Membership:
    kw = {"challenge_ttl_ms": 1000, "max_spent_challenges_per_node": 4} | kw
    return Membership(_caps(), tokens_file=str(tmp_path / "tokens.json"), clock=clock, **kw)


def test_a_proof_binds_the_challenge_the_secret_and_the_whole_endpoint(tmp_path: Any) -> None:
    clock = FakeClock(0)
    m = _members(tmp_path, clock)
    challenge, ttl_ms = m.new_challenge("s1")
    assert len(challenge) == 56 and ttl_ms == 1000
    good = store_proof(_caps(), challenge, **ENDPOINT)
    for change in ({"epoch": 8}, {"data_address": "127.0.0.1:3"}, {"role": "prefill"}):
        forged = store_proof(_caps(), challenge, **(ENDPOINT | change))
        assert forged != good
    wrong_secret = store_proof(_caps(b"x" * 32), challenge, **ENDPOINT)
    with pytest.raises(Unauthenticated, match="does not hold this cluster's secret"):
        m.admit_store(challenge=challenge, proof=wrong_secret, **ENDPOINT)
    assert m.num_spent_challenges() == 0  # a failed proof records nothing (callers cannot grow state)
    m.admit_store(challenge=challenge, proof=good, **ENDPOINT)
    c2, _ = m.new_challenge("s1")
    m.admit_store(challenge=c2, proof=store_proof(_caps(), c2, **ENDPOINT), **ENDPOINT)
    with pytest.raises(Unauthenticated, match="replayed"):  # replay
        m.admit_store(challenge=c2, proof=store_proof(_caps(), c2, **ENDPOINT), **ENDPOINT)
    c3, _ = m.new_challenge("another-node")  # a challenge is for the node that asked
    with pytest.raises(Unauthenticated):
        m.admit_store(challenge=c3, proof=store_proof(_caps(), c3, **ENDPOINT), **ENDPOINT)
    with pytest.raises(Unauthenticated, match="did not prove"):
        m.admit_store(challenge=b"", proof=b"", **ENDPOINT)


def test_challenges_are_stateless_expire_and_spent_ones_are_bounded_per_node(tmp_path: Any) -> None:
    clock = FakeClock(0)
    m = _members(tmp_path, clock)
    first = [m.new_challenge("s1")[0] for _ in range(10_000)]  # no cap, no state per challenge
    assert m.num_spent_challenges() == 0
    clock.advance(1001)
    with pytest.raises(Unauthenticated, match="expired"):
        m.admit_store(challenge=first[0], proof=store_proof(_caps(), first[0], **ENDPOINT), **ENDPOINT)
    held = m.new_challenge("s1")[0]  # minted before the node's next registrations

    def register(node: dict[str, Any]) -> None:
        clock.advance(1)
        challenge, _ = m.new_challenge(node["node_id"])
        m.admit_store(challenge=challenge, proof=store_proof(_caps(), challenge, **node), **node)

    for _ in range(5):
        register(ENDPOINT)
    assert m.num_spent_challenges() == 4
    # the oldest spent one was forgotten, and the node's floor refuses every challenge as old as it
    with pytest.raises(Unauthenticated, match="spent"):
        m.admit_store(challenge=held, proof=store_proof(_caps(), held, **ENDPOINT), **ENDPOINT)
    for _ in range(10_000):  # repeated registrations leave at most 4 spent challenges for the node
        register(ENDPOINT)
    assert m.num_spent_challenges() <= 4
    before = m.num_spent_challenges()
    register(ENDPOINT | {"node_id": "s2"})  # another node id keeps its own set
    assert m.num_spent_challenges() == before + 1


def test_token_file_keeps_digests_and_revocation_is_seen(tmp_path: Any) -> None:
    path = tmp_path / "tokens.json"
    alice = add_token(path, "alice")
    bob = add_token(path, "bob")
    assert alice not in path.read_text() and token_digest(alice) in path.read_text()
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(read_tokens(path).values()) == ["alice", "bob"]
    with pytest.raises(InvalidArgument, match="exists"):
        add_token(path, "alice")
    with pytest.raises(InvalidArgument, match="at least"):
        add_token(path, "carol", "short")
    m = _members(tmp_path, FakeClock(0))
    assert m.token_name(alice) == "alice" and m.token_name(bob) == "bob"
    for bad in ("", "not-a-token"):
        with pytest.raises(Unauthenticated):
            m.token_name(bad)
    assert revoke_token(path, "alice") and not revoke_token(path, "alice")
    time.sleep(0.6)  # past TOKEN_RELOAD_INTERVAL_S
    with pytest.raises(Unauthenticated, match="revoked"):
        m.token_name(alice)
    with pytest.raises(PermissionDenied, match="'alice' was revoked"):
        m.check_still_active("alice")
    m.check_still_active("bob")
    path.write_text("{not json")
    with pytest.raises(InvalidArgument, match="malformed"):
        read_tokens(path)
    time.sleep(0.6)
    assert m.token_name(bob) == "bob"  # a broken file keeps the previous tokens (and says so)


def test_an_unsecured_membership_admits_anyone(tmp_path: Any) -> None:
    m = Membership(None, tokens_file="", clock=FakeClock(0), challenge_ttl_ms=1)
    assert not m.secured and m.new_challenge("x") == (b"", 0)
    m.admit_store(challenge=b"", proof=b"", **ENDPOINT)
    assert m.token_name("") == ""


# ---------------------------------------------------------------- a secured cluster of real processes


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    require_ucx()
    from kvpool.cluster.local import LocalCluster, LocalClusterSpec

    spec = LocalClusterSpec(
        layout=LAYOUT,
        num_stores=1,
        num_prefill=0,
        num_decode=0,
        segment_size="8MiB",
        heartbeat_timeout_ms=30_000,
    )
    with LocalCluster(spec) as c:
        yield c


def _store(cluster: Any, node_id: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_CLUSTER_SECRET")}
    return subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "store", "--master", cluster.master_address, "--listen",
         "127.0.0.1", "--grpc-port", "0", "--data-port", "0", "--segment-size", "8MiB", "--layout", LAYOUT,
         "--node-id", node_id],
        capture_output=True, text=True, timeout=90, env=base | env,
    )  # fmt: skip


def _nodes(cluster: Any) -> dict[str, Any]:
    from kvpool.client import MasterClient

    with MasterClient(cluster.master_address) as mc:
        return {n.node.node_id: n for n in mc.list_nodes()}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "did not prove it holds the cluster secret"),
        ({"KVPOOL_CLUSTER_SECRET": "w" * 64}, "failed the membership proof"),
    ],
    ids=["no-secret", "wrong-secret"],
)
def test_a_store_without_the_secret_is_refused_and_holds_no_blocks(
    cluster: Any, env: dict[str, str], expected: str
) -> None:
    out = _store(cluster, "rogue", env)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if " INFO " not in line and " WARNING " not in line]
    assert len(errors) == 1 and "Unauthenticated" in errors[0] and expected in errors[0], errors
    assert "KVPOOL_READY" not in out.stdout
    nodes = _nodes(cluster)
    assert "rogue" not in nodes and nodes["store0"].alive
    _publish_lands_on_proven_stores_only(cluster)


def _publish_lands_on_proven_stores_only(cluster: Any) -> None:
    from kvpool.client import MasterClient, PoolClient
    from kvpool.types import KVLayout
    from transfer import UcxTransport

    nb = KVLayout.from_fingerprint(LAYOUT).block_nbytes
    rng = np.random.default_rng()
    hashes = [rng.bytes(16) for _ in range(8)]
    with MasterClient(cluster.master_address) as mc:
        ns, _ = mc.register_namespace("m", "v1", LAYOUT)
        t = UcxTransport(probe_bytes=1 << 20)
        try:
            with PoolClient(cluster.master_address, t, block_nbytes=nb) as pool:
                put = pool.put_blocks(
                    ns, None, hashes, [rng.integers(0, 256, nb, dtype=np.uint8) for _ in hashes]
                )
        finally:
            t.close()
        assert put.num_committed == 8, put
        match = mc.match(ns, hashes)
    assert {loc.node_id for reps in match.replicas for loc in reps} == {"store0"}


def _register_request(cluster: Any, stub: Any, node_id: str) -> Any:
    from kvpool.rpc import PROTOCOL_VERSION
    from kvpool.types import KVLayout
    from kvpool.v1 import kvpool_pb2 as pb

    caps = cluster.capabilities()  # the test holds the secret
    endpoint = ENDPOINT | {"node_id": node_id}
    challenge = stub.JoinChallenge(pb.JoinChallengeRequest(node_id=node_id), timeout=5).challenge
    return pb.RegisterNodeRequest(
        node=pb.NodeEndpoint(**endpoint),
        protocol_version=PROTOCOL_VERSION,
        layout_fingerprint=LAYOUT,
        num_slots=4,
        block_nbytes=KVLayout.from_fingerprint(LAYOUT).block_nbytes,
        challenge=challenge,
        proof=store_proof(caps, challenge, **endpoint),
    )


def test_a_replayed_registration_is_refused(cluster: Any) -> None:
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

    if cluster.capabilities() is None:
        pytest.skip("the environment configures the cluster secret")
    with grpc.insecure_channel(cluster.master_address) as ch:  # no join token: stores need none
        stub = pb_grpc.MasterStub(ch)
        req = _register_request(cluster, stub, "replayed")
        resp = stub.RegisterNode(req, timeout=5)
        assert resp.secured and len(resp.session) == 32
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterNode(req, timeout=5)  # the same bytes again
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in err.value.details()
        moved = _register_request(cluster, stub, "replayed2")
        moved.node.node_id = "someone-else"  # a proof made for another endpoint
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterNode(moved, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        beat = pb.HeartbeatRequest(node_id="replayed", epoch=ENDPOINT["epoch"], session=b"x" * 32)
        with pytest.raises(grpc.RpcError) as err:  # a heartbeat needs the registration's session
            stub.Heartbeat(beat, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        bye = pb.DeregisterNodeRequest(node_id="replayed", epoch=ENDPOINT["epoch"], session=resp.session)
        assert stub.DeregisterNode(bye, timeout=5).known
    nodes = _nodes(cluster)
    assert "someone-else" not in nodes and not nodes["replayed"].alive


def test_calls_without_an_active_join_token_are_refused(cluster: Any) -> None:
    from kvpool.rpc import PROTOCOL_VERSION
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

    calls = [
        ("Stats", pb.StatsRequest()),
        ("ListNodes", pb.ListNodesRequest()),
        ("MatchPrefix", pb.MatchPrefixRequest(namespace=b"n" * 16, block_hashes=[b"h" * 16], lease_ttl_ms=1000)),
        ("Evict", pb.EvictRequest(fraction=0.5)),
        ("RegisterNode", pb.RegisterNodeRequest(
            node=pb.NodeEndpoint(node_id="p", role="prefill", grpc_address="127.0.0.1:1", epoch=1),
            protocol_version=PROTOCOL_VERSION, layout_fingerprint=LAYOUT)),
    ]  # fmt: skip
    with grpc.insecure_channel(cluster.master_address) as ch:
        stub = pb_grpc.MasterStub(ch)
        for metadata in ((), ((JOIN_TOKEN_METADATA, "w" * 43),)):
            for name, req in calls:
                with pytest.raises(grpc.RpcError) as err:
                    getattr(stub, name)(req, timeout=5, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert "join token" in err.value.details(), err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.MatchPrefixStream(iter([calls[2][1]]), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Stats(pb.StatsRequest(), timeout=5, metadata=((JOIN_TOKEN_METADATA, cluster.join_token),))
        assert ok.uptime_s > 0
    assert "p" not in _nodes(cluster)


def test_the_admin_cli_needs_the_token_and_says_how(cluster: Any) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_JOIN_TOKEN")}
    cmd = [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", cluster.master_address, "nodes"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=base)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "KVPOOL_JOIN_TOKEN" in out.stderr, out.stderr
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=base | cluster.member_env)
    assert out.returncode == 0 and "store0" in out.stdout, out.stderr


def test_only_the_master_may_call_a_secured_store(cluster: Any) -> None:
    """A process that reaches a store's gRPC port cannot free, reserve, list or copy its slots."""
    from kvpool.membership import MASTER_CALL_METADATA, master_call_credential
    from kvpool.v1 import kvpool_pb2 as pb
    from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

    store = cluster.stores[0].info["grpc_address"]
    before = _nodes(cluster)["store0"].num_used_slots
    now_ms = int(time.time() * 1000)
    free = pb.FreeSlotsRequest(slots=[pb.SlotRef(slot=0, generation=1)])
    forged = master_call_credential(
        _caps(b"x" * 32), store, "/kvpool.v1.Store/FreeSlots", free.SerializeToString(), now_ms
    )
    with grpc.insecure_channel(store) as ch:
        stub = pb_grpc.StoreStub(ch)
        assert stub.GetInfo(pb.GetInfoRequest(), timeout=5).node.node_id == "store0"  # identity stays open
        for metadata in ((), ((MASTER_CALL_METADATA, forged),), ((MASTER_CALL_METADATA, "1.00"),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.FreeSlots(free, timeout=5, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            assert "only the master" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Inventory(pb.InventoryRequest(), timeout=5))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.ReserveSlots(pb.ReserveSlotsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    caps = cluster.capabilities()  # a credential made with the secret
    if caps is not None:
        stale = master_call_credential(caps, store, "/kvpool.v1.Store/Inventory", b"", now_ms - 120_000)
        good = master_call_credential(caps, store, "/kvpool.v1.Store/Inventory", b"", now_ms)
        with grpc.insecure_channel(store) as ch:
            stub = pb_grpc.StoreStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                list(
                    stub.Inventory(
                        pb.InventoryRequest(), timeout=5, metadata=((MASTER_CALL_METADATA, stale),)
                    )
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            list(stub.Inventory(pb.InventoryRequest(), timeout=5, metadata=((MASTER_CALL_METADATA, good),)))
    assert _nodes(cluster)["store0"].num_used_slots == before


def test_a_router_without_a_join_token_exits_2_with_one_line(cluster: Any) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_JOIN_TOKEN")}
    for extra in ([], ["--block-size", "16"]):
        out = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "router", "--master", cluster.master_address, "--port", "0",
             *extra],
            capture_output=True, text=True, timeout=90, env=base,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr[-2000:]
        errors = [line for line in out.stderr.splitlines() if line.startswith("kvpool router:")]
        assert len(errors) == 1 and "join token" in errors[0] and "Traceback" not in out.stderr, out.stderr


def test_the_token_cli_never_leaves_a_token_nobody_holds(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from kvpool.cli.main import app

    tokens, out = tmp_path / "tokens.json", tmp_path / "token"
    out.write_text("taken\n")
    r = CliRunner().invoke(app, ["token", "new", "ops", "--file", str(tokens), "--out", str(out)])
    assert r.exit_code == 2 and "--out" in r.output and not tokens.exists()  # checked before adding
    out.unlink()
    r = CliRunner().invoke(app, ["token", "new", "ops", "--file", str(tokens), "--out", str(out)])
    assert (
        r.exit_code == 0
        and str(out.resolve()) in r.output
        and read_tokens(tokens) == {token_digest(out.read_text().strip()): "ops"}
    )
    for bad in ("bad name", "a/b", "é"):
        r = CliRunner().invoke(app, ["token", "new", bad, "--file", str(tokens)])
        assert r.exit_code == 2 and "name" in r.output, bad
    for cmd in (["list"], ["revoke", "ops"]):
        r = CliRunner().invoke(app, ["token", *cmd, "--file", str(tmp_path / "missing.json")])
        assert r.exit_code == 1 and "no token file" in r.output
    r = CliRunner().invoke(app, ["token", "list", "--file", str(tmp_path)])  # a directory
    assert r.exit_code == 2 and "cannot read" in r.output


def test_an_unreadable_join_token_file_is_one_line(cluster: Any, tmp_path: Any) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_JOIN_TOKEN")}
    env["KVPOOL_JOIN_TOKEN_FILE"] = str(tmp_path / "nope")
    out = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "admin", "--master", cluster.master_address, "stats"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "KVPOOL_JOIN_TOKEN_FILE" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_store_with_a_secret_refuses_an_unsecured_master_before_joining() -> None:
    from kvpool.client import MasterClient
    from kvpool.master.server import serve
    from kvpool.master.settings import MasterSettings

    require_ucx()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    master = serve(MasterSettings(port=0, bind_host="127.0.0.1", metrics=False, layout=LAYOUT))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "store", "--master", master.address, "--grpc-port", "0",
             "--data-port", "0", "--segment-size", "8MiB", "--layout", LAYOUT, "--node-id", "s-secret"],
            capture_output=True, text=True, timeout=90, env=env | {"KVPOOL_CLUSTER_SECRET": "q" * 32},
        )  # fmt: skip
        assert out.returncode == 2 and "runs unsecured" in out.stderr, out.stderr[-2000:]
        with MasterClient(master.address) as mc:
            assert mc.list_nodes() == []  # never listed, never adopted
    finally:
        master.stop()
