"""Least privilege on a secured cluster (issue #46, item 6): role-scoped join tokens, writes bound to the
caller's own registration, and a cluster secret file others can read refused.

Real processes: a secured `LocalCluster` master and store; tokens of each role are added to its token
file (the master re-reads it) and every call is a real gRPC call with that token's metadata."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

os.environ.setdefault("UCX_TLS", "tcp")  # noqa: E402 - before UCX initialises

from kvpool.membership import JOIN_TOKEN_METADATA, add_token, revoke_token  # noqa: E402
from kvpool.rpc import PROTOCOL_VERSION  # noqa: E402
from kvpool.v1 import kvpool_pb2 as pb  # noqa: E402
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc  # noqa: E402
from tests.capabilities import require_ucx  # noqa: E402

LAYOUT = "kv1:float32:b16:l2:h2:d16"  # 8 KiB blocks


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


def _token(cluster: Any, name: str, role: str) -> tuple[tuple[str, str], ...]:
    """A fresh token of `role` in the cluster's token file, as call metadata (once the master sees it)."""
    return _seen(cluster, add_token(cluster.log_dir / "join_tokens.json", name, role=role))


def _seen(cluster: Any, token: str) -> tuple[tuple[str, str], ...]:
    """`token` (already in the cluster's token file) as call metadata, once the master sees it."""
    md = ((JOIN_TOKEN_METADATA, token),)
    with grpc.insecure_channel(cluster.master_address) as ch:
        stub = pb_grpc.MasterStub(ch)
        deadline = time.monotonic() + 30
        while True:  # the master re-reads the file within half a second of a change
            try:
                stub.Masters(pb.MastersRequest(), timeout=5, metadata=md)
                return md
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAUTHENTICATED or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


def _code(call: Any, *args: Any, **kw: Any) -> grpc.StatusCode:
    try:
        call(*args, timeout=10, **kw)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _register(stub: Any, md: Any, node_id: str, role: str = "prefill", epoch: int = 1) -> grpc.StatusCode:
    req = pb.RegisterNodeRequest(
        node=pb.NodeEndpoint(node_id=node_id, role=role, grpc_address="127.0.0.1:1", epoch=epoch),
        protocol_version=PROTOCOL_VERSION,
        layout_fingerprint=LAYOUT,
    )
    return _code(stub.RegisterNode, req, metadata=md)


def test_a_router_token_cannot_run_admin_operations(cluster: Any) -> None:
    md = _token(cluster, "router-lp", "router")
    with grpc.insecure_channel(cluster.master_address) as ch:
        stub = pb_grpc.MasterStub(ch)
        ns = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="m", weights_version="v", layout_fingerprint=LAYOUT),
            timeout=10,
            metadata=md,
        ).namespace
        allowed = [
            ("ListNodes", pb.ListNodesRequest()),
            ("Stats", pb.StatsRequest()),
            ("MatchPrefix", pb.MatchPrefixRequest(namespace=ns, block_hashes=[b"h" * 16])),
        ]
        for name, req in allowed:
            assert _code(getattr(stub, name), req, metadata=md) == grpc.StatusCode.OK, name
        denied = [
            ("Evict", pb.EvictRequest(fraction=0.5)),
            ("Drain", pb.DrainRequest(node_id="store0")),
            ("SetModelVersion", pb.SetModelVersionRequest(model_id="m", weights_version="v2")),
            ("RemoveBlocks", pb.RemoveBlocksRequest(namespace=ns, block_hashes=[b"h" * 16])),
            ("InvalidateNamespace", pb.InvalidateNamespaceRequest(namespace=ns)),
            ("Reserve", pb.ReserveRequest(namespace=ns, block_hashes=[b"h" * 16], num_replicas=1)),
            (
                "ReserveBatch",
                pb.ReserveBatchRequest(chains=[pb.ReserveRequest(namespace=ns, block_hashes=[b"h" * 16])]),
            ),
            ("CommitBatch", pb.CommitBatchRequest(commits=[pb.CommitRequest(reservation_id=1)])),
        ]
        for name, req in denied:
            with pytest.raises(grpc.RpcError) as err:
                getattr(stub, name)(req, timeout=10, metadata=md)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert "router" in err.value.details() and name in err.value.details()
        # nor may it register a node that would be sent tenants' prompts
        assert _register(stub, md, "fake-prefill", "prefill") == grpc.StatusCode.PERMISSION_DENIED
        assert _register(stub, md, "fake-engine", "vllm") == grpc.StatusCode.PERMISSION_DENIED
        nodes = {n.node.node_id for n in stub.ListNodes(pb.ListNodesRequest(), timeout=10, metadata=md).nodes}
        assert "store0" in nodes and not nodes & {"fake-prefill", "fake-engine"}
        # the same calls with an admin token pass the door (Evict runs)
        admin = ((JOIN_TOKEN_METADATA, cluster.join_token),)
        assert _code(stub.Evict, pb.EvictRequest(fraction=0.01), metadata=admin) == grpc.StatusCode.OK


def test_a_serving_node_cannot_write_as_another_node(cluster: Any) -> None:
    alice, bob = _token(cluster, "serving-a", "serving"), _token(cluster, "serving-b", "serving")
    with grpc.insecure_channel(cluster.master_address) as ch:
        stub = pb_grpc.MasterStub(ch)
        assert _register(stub, alice, "pa") == grpc.StatusCode.OK
        assert _register(stub, bob, "pb") == grpc.StatusCode.OK
        ns = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="m", weights_version="v", layout_fingerprint=LAYOUT),
            timeout=10,
            metadata=bob,
        ).namespace

        def reserve(md: Any, writer: str, h: bytes) -> Any:
            req = pb.ReserveRequest(
                namespace=ns,
                block_hashes=[h],
                num_replicas=1,
                block_nbytes=8192,
                write_lease_ms=10_000,
                writer_node_id=writer,
            )
            return stub.Reserve(req, timeout=10, metadata=md)

        with pytest.raises(grpc.RpcError) as err:
            reserve(bob, "pa", b"1" * 16)  # bob's token, alice's node id
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        assert "writes only as itself" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            reserve(bob, "nobody", b"1" * 16)  # a node id nobody registered
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        rid = reserve(alice, "pa", b"2" * 16).reservation_id
        assert rid > 0
        # bob cannot commit or abort alice's reservation; alice can
        for call, req in (
            (stub.Commit, pb.CommitRequest(reservation_id=rid)),
            (stub.Abort, pb.AbortRequest(reservation_id=rid)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(req, timeout=10, metadata=bob)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        assert _code(stub.Abort, pb.AbortRequest(reservation_id=rid), metadata=alice) == grpc.StatusCode.OK
        # nor can it take alice's node id by registering it again (same epoch, or a new one)
        for epoch in (1, 2):
            assert _register(stub, bob, "pa", epoch=epoch) == grpc.StatusCode.PERMISSION_DENIED, epoch
        with pytest.raises(grpc.RpcError) as err:
            reserve(bob, "pa", b"3" * 16)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert _register(stub, alice, "pa") == grpc.StatusCode.OK  # alice refreshes her own
        # a serving token writes and matches, but runs no admin operation either
        for name, req in (
            ("Evict", pb.EvictRequest(fraction=0.5)),
            ("Drain", pb.DrainRequest(node_id="store0")),
        ):
            assert _code(getattr(stub, name), req, metadata=alice) == grpc.StatusCode.PERMISSION_DENIED, name
        # once alice's token is revoked, her node id is free for another member (a token rotation)
        assert revoke_token(cluster.log_dir / "join_tokens.json", "serving-a")
        deadline = time.monotonic() + 10  # the master re-reads tokens every 0.5 s; "pa" lives 30 s unbeaten
        while _register(stub, bob, "pa", epoch=3) != grpc.StatusCode.OK:
            assert time.monotonic() < deadline, "the master did not free a revoked token's node id"
            time.sleep(0.2)


def test_a_cluster_secret_file_others_can_read_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 64 + "\n")
    secret.chmod(0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env |= {"KVPOOL_CLUSTER_SECRET_FILE": str(secret), "KVPOOL_JOIN_TOKENS_FILE": str(tmp_path / "t.json")}
    cmd = [sys.executable, "-m", "kvpool.cli.main", "master", "--listen", "127.0.0.1", "--port", "0"]
    out = subprocess.run([*cmd, "--layout", LAYOUT], capture_output=True, text=True, timeout=45, env=env)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "chmod 600" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "READY" not in out.stdout


def test_the_token_cli_writes_roles_and_makes_serving_keys(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvpool.cli.main import app
    from kvpool.membership import read_token_roles
    from kvpool.rpc.serving_key import key_digest

    tokens = str(tmp_path / "tokens.json")
    runner = CliRunner()
    assert runner.invoke(app, ["token", "new", "r1", "--role", "router", "--file", tokens]).exit_code == 0
    assert runner.invoke(app, ["token", "new", "old", "--file", tokens]).exit_code == 0  # admin by default
    bad = runner.invoke(app, ["token", "new", "x", "--role", "root", "--file", tokens])
    assert bad.exit_code == 2 and "admin, router, serving, engine, store" in bad.output
    listed = runner.invoke(app, ["token", "list", "--roles", "--file", tokens]).output.split("\n")
    assert listed[:2] == ["old admin", "r1 router"]
    assert sorted(read_token_roles(Path(tokens)).values()) == [("old", "admin"), ("r1", "router")]
    out = runner.invoke(app, ["token", "serving-key", "--out", str(tmp_path / "key")])
    assert out.exit_code == 0, out.output
    key = (tmp_path / "key").read_text().strip()
    assert f"KVPOOL_SERVING_KEY_SHA256={key_digest(key)}" in out.output
    assert (tmp_path / "key").stat().st_mode & 0o077 == 0


def test_a_member_cannot_end_or_renew_another_members_read_lease(cluster: Any) -> None:
    alice, bob = _token(cluster, "serving-la", "serving"), _token(cluster, "serving-lb", "serving")
    with grpc.insecure_channel(cluster.master_address) as ch:
        stub = pb_grpc.MasterStub(ch)
        assert _register(stub, alice, "pla") == grpc.StatusCode.OK
        ns = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="m", weights_version="v", layout_fingerprint=LAYOUT),
            timeout=10,
            metadata=alice,
        ).namespace
        h = b"L" * 16
        from kvpool.client import PoolClient
        from transfer import UcxTransport

        transport = UcxTransport(probe_bytes=1 << 20)
        try:  # a real block, written by this process (an admin token: its write is unbound)
            with PoolClient(cluster.master_address, transport, block_nbytes=8192) as pool:
                put = pool.put_blocks(ns, None, [h], [np.zeros(8192, np.uint8)], num_replicas=1)
                assert put.num_committed == 1, put
        finally:
            transport.close()
        match = pb.MatchPrefixRequest(namespace=ns, block_hashes=[h], lease_ttl_ms=30_000)
        lease = stub.MatchPrefix(match, timeout=10, metadata=alice).lease_id
        assert lease > 0
        for call, request in (
            (stub.ReleaseLease, pb.ReleaseLeaseRequest(lease_id=lease)),
            (stub.ReleaseLeases, pb.ReleaseLeasesRequest(lease_ids=[lease])),
            (stub.RenewLease, pb.RenewLeaseRequest(lease_id=lease, ttl_ms=30_000)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=10, metadata=bob)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        assert _code(
            stub.RenewLease, pb.RenewLeaseRequest(lease_id=lease, ttl_ms=30_000), metadata=alice
        ) == (grpc.StatusCode.OK)
        assert (
            _code(stub.ReleaseLease, pb.ReleaseLeaseRequest(lease_id=lease), metadata=alice)
            == grpc.StatusCode.OK
        )


def test_up_binds_each_serving_node_to_its_own_token(cluster: Any, tmp_path: Path) -> None:
    """`kvpool up`'s credentials for a plan of three serving nodes, given to a real secured master: each
    node's token registers and reserves as that node only."""
    from kvpool.cluster.credentials import TOKEN_ROLE, UpCredentials, token_name
    from kvpool.cluster.launch import plan
    from kvpool.cluster.spec import ClusterSpec

    spec = ClusterSpec.model_validate({"prefill": {"count": 2}, "decode": {"count": 1}})
    launches = [x for x in plan(spec, LAYOUT) if x.role in ("prefill", "decode")]
    creds = UpCredentials.make(tmp_path, {"KVPOOL_CLUSTER_SECRET": "s" * 64}, launches)
    md = {}
    for launch in launches:  # the master's token file learns each node's token, as kvpool up's would
        token = creds.token_file(launch).read_text().strip()
        add_token(
            cluster.log_dir / "join_tokens.json",
            f"up-{token_name(launch)}",
            token,
            role=TOKEN_ROLE[launch.role],
        )
        md[launch.name] = _seen(cluster, token)
    assert len({m[0][1] for m in md.values()}) == 3
    with grpc.insecure_channel(cluster.master_address) as ch:
        stub = pb_grpc.MasterStub(ch)
        for launch in launches:
            assert _register(stub, md[launch.name], launch.name, launch.role) == grpc.StatusCode.OK
        ns = stub.RegisterNamespace(
            pb.RegisterNamespaceRequest(model_id="m", weights_version="v", layout_fingerprint=LAYOUT),
            timeout=10,
            metadata=md["prefill0"],
        ).namespace
        for caller, writer, expected in (
            ("prefill1", "prefill0", grpc.StatusCode.PERMISSION_DENIED),
            ("decode0", "prefill1", grpc.StatusCode.PERMISSION_DENIED),
            ("prefill0", "prefill0", grpc.StatusCode.OK),
        ):
            req = pb.ReserveRequest(
                namespace=ns,
                block_hashes=[f"up-{caller}-{writer}".encode().ljust(16, b"-")[:16]],
                num_replicas=1,
                block_nbytes=8192,
                write_lease_ms=10_000,
                writer_node_id=writer,
            )
            assert _code(stub.Reserve, req, metadata=md[caller]) == expected, (caller, writer)
        assert _register(stub, md["prefill1"], "prefill0", "prefill", 7) == grpc.StatusCode.PERMISSION_DENIED
