"""A hypothesis fuzz of every Master RPC against an in-process master: it answers a status, never dies."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.master import MasterSettings, serve
from kvpool.rpc.server import channel
from kvpool.types import DEFAULT_LAYOUT
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,  # a fake store address the master cannot reach
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


@pytest.fixture(scope="module")
def stub() -> Iterator[pb_grpc.MasterStub]:
    server = serve(MasterSettings(port=0, store_timeout_s=0.2))
    ch = channel(server.address)
    try:
        yield pb_grpc.MasterStub(ch)
    finally:
        ch.close()
        server.stop()


raw = st.binary(max_size=20) | st.sampled_from([b"\x00" * 16, b"\xff" * 16])
ids = st.text(max_size=8)
u64 = st.integers(0, 2**64 - 1) | st.integers(0, 5)
u32 = st.integers(0, 2**32 - 1) | st.integers(0, 5)
loc = st.builds(pb.BlockLocation, node_id=ids, slot=u64, generation=u64, local=st.booleans())
node = st.builds(pb.NodeEndpoint, node_id=ids, role=st.sampled_from(["store", "prefill", "x"]), epoch=u64)
fl = st.floats(allow_nan=True, allow_infinity=True)
hashes = st.lists(raw, max_size=4)

CALLS = st.one_of(
    st.tuples(
        st.just("RegisterNode"),
        st.builds(
            pb.RegisterNodeRequest,
            node=node,
            protocol_version=u32,
            layout_fingerprint=st.sampled_from(["", DEFAULT_LAYOUT, "kv1:float32:b64:l4:h2:d32"]),
            num_slots=u64,
            block_nbytes=u64,
        ),
    ),
    st.tuples(
        st.just("Heartbeat"), st.builds(pb.HeartbeatRequest, node_id=ids, epoch=u64, num_used_slots=u64)
    ),
    st.tuples(
        st.just("RegisterNamespace"),
        st.builds(pb.RegisterNamespaceRequest, model_id=ids, weights_version=ids, layout_fingerprint=ids),
    ),
    st.tuples(
        st.just("SetModelVersion"), st.builds(pb.SetModelVersionRequest, model_id=ids, weights_version=ids)
    ),
    st.tuples(
        st.just("MatchPrefix"),
        st.builds(
            pb.MatchPrefixRequest,
            namespace=raw,
            block_hashes=hashes,
            count_hit=st.booleans(),
            lease_ttl_ms=u64,
            num_prompt_tokens=u64,
        ),
    ),
    st.tuples(st.just("RenewLease"), st.builds(pb.RenewLeaseRequest, lease_id=u64, ttl_ms=u64)),
    st.tuples(st.just("ReleaseLease"), st.builds(pb.ReleaseLeaseRequest, lease_id=u64)),
    st.tuples(
        st.just("ReleaseLeases"),
        st.builds(
            pb.ReleaseLeasesRequest,
            lease_ids=st.lists(u64, max_size=3) | st.lists(st.just(1), min_size=1025, max_size=1025),
        ),
    ),
    st.tuples(
        st.just("Reserve"),
        st.builds(
            pb.ReserveRequest,
            namespace=raw,
            parent_hash=raw,
            block_hashes=hashes,
            num_replicas=u32,
            block_nbytes=u64,
            recompute_cost_s=st.lists(fl, max_size=3),
            write_lease_ms=u64,
        ),
    ),
    st.tuples(
        st.just("Commit"),
        st.builds(
            pb.CommitRequest,
            reservation_id=u64,
            blocks=st.lists(
                st.builds(pb.CommittedBlock, block_hash=raw, checksum=u64, written=st.lists(loc, max_size=2)),
                max_size=2,
            ),
        ),
    ),
    st.tuples(st.just("Abort"), st.builds(pb.AbortRequest, reservation_id=u64)),
    st.tuples(
        st.just("RemoveBlocks"),
        st.builds(pb.RemoveBlocksRequest, namespace=raw, block_hashes=hashes, force=st.booleans()),
    ),
    st.tuples(
        st.just("ReportBadReplica"),
        st.builds(pb.ReportBadReplicaRequest, namespace=raw, block_hash=raw, location=loc, reason=ids),
    ),
    st.tuples(
        st.just("ReportDataPlaneFailure"),
        st.builds(
            pb.ReportDataPlaneFailureRequest,
            node_id=ids,
            epoch=u64,
            kind=st.sampled_from(["write", "read", "checksum", "", "x"]) | ids,
            detail=ids,
        ),
    ),
    st.tuples(
        st.just("ReportLocal"),
        st.builds(
            pb.ReportLocalRequest,
            node_id=ids,
            epoch=u64,
            namespace=raw,
            stored=hashes,
            removed=hashes,
            cleared=st.booleans(),
        ),
    ),
    st.tuples(st.just("Stats"), st.just(pb.StatsRequest())),
    st.tuples(st.just("ListNodes"), st.just(pb.ListNodesRequest())),
    st.tuples(st.just("Drain"), st.builds(pb.DrainRequest, node_id=ids)),
    st.tuples(st.just("Evict"), st.builds(pb.EvictRequest, fraction=fl, node_id=ids)),
    st.tuples(st.just("InvalidateNamespace"), st.builds(pb.InvalidateNamespaceRequest, namespace=raw)),
    st.tuples(
        st.just("RegisterAdapter"),
        st.builds(pb.RegisterAdapterRequest, model_id=ids, name=ids, digest=ids | st.just("a" * 32)),
    ),
    st.tuples(
        st.just("ReloadAdapter"),
        st.builds(pb.ReloadAdapterRequest, model_id=ids, name=ids, digest=ids | st.just("b" * 32)),
    ),
    st.tuples(st.just("UnloadAdapter"), st.builds(pb.UnloadAdapterRequest, model_id=ids, name=ids)),
    st.tuples(st.just("ListAdapters"), st.builds(pb.ListAdaptersRequest, model_id=ids)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(CALLS, min_size=1, max_size=6))
def test_every_rpc_answers_a_status_and_the_master_keeps_serving(stub, calls) -> None:
    for name, request in calls:
        try:
            getattr(stub, name)(request, timeout=5)
        except grpc.RpcError as exc:
            assert exc.code() in OK, f"{name}: {exc.code()} {exc.details()}"
    stub.Stats(pb.StatsRequest(), timeout=5)  # the master still serves: an RpcError here fails the test


def test_huge_prompt_token_counts_are_refused(stub) -> None:
    """Found by the fuzz: a match reporting ~2**64 prompt tokens overflowed the uint64 counters of Stats,
    after which every Stats call failed."""
    req = pb.MatchPrefixRequest(
        namespace=b"\x00" * 16, block_hashes=[b"\x01" * 16], count_hit=True, num_prompt_tokens=2**64 - 1
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.MatchPrefix(req, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_prompt_tokens" in err.value.details()
    for _ in range(3):
        stub.MatchPrefix(pb.MatchPrefixRequest(**{**_fields(req), "num_prompt_tokens": 2**32 - 1}), timeout=5)
    assert stub.Stats(pb.StatsRequest(), timeout=5).requested_tokens >= 3 * (2**32 - 1)


def _fields(msg) -> dict:
    return {f.name: v for f, v in msg.ListFields()}
