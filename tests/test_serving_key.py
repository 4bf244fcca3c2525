"""No door around the router (issue #46, item 1): a serving node's `Prefill` and `Decode` calls need the
serving key, which only the router and the admin hold (`kvpool.rpc.serving_key`).

Real processes: a secured `LocalCluster` (its serving nodes hold the key's digest only; this process, like
a router, holds the key); direct calls without the key, with a wrong one, or with the key's digest are
refused UNAUTHENTICATED before any work; the same call with the key is served."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

os.environ.setdefault("UCX_TLS", "tcp")  # noqa: E402 - before UCX initialises

from kvpool.cluster.local import LocalCluster, LocalClusterSpec  # noqa: E402
from kvpool.rpc.serving_key import DIGEST_ENV, KEY_FILE_ENV, SERVING_KEY_METADATA, serving_key  # noqa: E402
from kvpool.v1 import kvpool_pb2 as pb  # noqa: E402
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc  # noqa: E402
from tests.capabilities import require_ucx  # noqa: E402

BLOCK = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    require_ucx()
    from kvpool.model import ModelRunner

    layout = ModelRunner.load(None, block_size=BLOCK).layout.fingerprint()
    spec = LocalClusterSpec(
        layout=layout, block_size=BLOCK, num_stores=1, segment_size="16MiB", heartbeat_timeout_ms=30_000
    )
    with LocalCluster(spec) as c:
        yield c


def _prefill(stub: pb_grpc.PrefillStub, metadata: tuple[tuple[str, str], ...]) -> list[pb.PrefillEvent]:
    req = pb.PrefillRequest(
        request_id="direct",
        token_ids=list(range(3, 40)),
        sampling=pb.SamplingParams(max_tokens=1),
        publish=False,
    )
    return list(stub.Prefill(req, timeout=120, metadata=metadata))


def test_a_direct_prefill_or_decode_call_without_the_serving_key_is_refused(cluster: LocalCluster) -> None:
    from kvpool.membership import token_digest

    key = serving_key()
    assert key, "a secured LocalCluster gives this process (a caller) the serving key"
    wrong = (
        (),
        ((SERVING_KEY_METADATA, "x" * 43),),
        ((SERVING_KEY_METADATA, token_digest(key)),),  # what a node holds does not open another node
    )
    for md in wrong:
        with grpc.insecure_channel(cluster.prefill_addresses[0]) as ch:
            with pytest.raises(grpc.RpcError) as err:
                _prefill(pb_grpc.PrefillStub(ch), md)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
            assert "serving key" in err.value.details()
        with grpc.insecure_channel(cluster.decode_addresses[0]) as ch:
            req = pb.DecodeRequest(
                token_ids=[3, 4, 5], first_token=6, sampling=pb.SamplingParams(max_tokens=2)
            )
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.DecodeStub(ch).Decode(req, timeout=60, metadata=md))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
    with grpc.insecure_channel(cluster.prefill_addresses[0]) as ch:
        stub = pb_grpc.PrefillStub(ch)
        assert stub.GetInfo(pb.GetInfoRequest(), timeout=30).node.node_id == "prefill0"  # stays open
        events = _prefill(stub, ((SERVING_KEY_METADATA, key),))
        assert any(e.HasField("first_token") for e in events), events


def test_serving_nodes_hold_the_digest_and_never_the_key(cluster: LocalCluster) -> None:
    for proc in cluster.prefill + cluster.decode:
        environ = Path(f"/proc/{proc.proc.pid}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=", 1)[0].decode() for e in environ if b"=" in e}
        assert DIGEST_ENV in names and KEY_FILE_ENV not in names, proc.name
