"""The master's match stream on its `grpc.aio` server (a real master and two stores): one match per
message, pipelined messages answered in order, bad input answered INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest

from kvpool.client import MasterClient, PoolClient
from kvpool.errors import InvalidArgument
from kvpool.hashing import hash_blocks
from kvpool.master.procs import LAYOUT
from kvpool.v1 import kvpool_pb2 as pb
from tests.test_master_cluster import LAY, blocks_for, cluster, transport  # noqa: F401 - fixtures


def test_stream_matches_in_order_pipelined_and_refuses_bad_input(cluster, transport) -> None:  # noqa: F811
    master, _ = cluster
    with MasterClient(master.grpc_address) as c:
        ns, _ = c.register_namespace("stream", "v1", LAYOUT)
        chains = [hash_blocks(ns, [i] * 64 * (i + 1), LAY.block_size) for i in range(4)]
        with PoolClient(master.grpc_address, transport, block_nbytes=LAY.block_nbytes) as pool:
            for i, ch in enumerate(chains):
                assert pool.put_blocks(ns, None, ch, blocks_for(len(ch), i)).num_committed == len(ch)
        before = c.stats().num_match_requests
        with c.match_stream() as s:
            assert [s.match(ns, ch).num_matched for ch in chains] == [1, 2, 3, 4]
            for ch in chains:  # four in flight on one stream, each one prompt
                s.send(ns, ch, count_hit=True)
            got = [s.receive() for _ in chains]
            assert [m.num_matched for m in got] == [1, 2, 3, 4]
            assert [m.replicas for m in got] == [c.match(ns, ch).replicas for ch in chains]
            with pytest.raises(InvalidArgument):
                s.match(ns, [b"short"])
        assert c.stats().num_match_requests == before + 4
        with grpc.insecure_channel(master.grpc_address) as ch:
            raw = ch.stream_stream("/kvpool.v1.Master/MatchPrefixStream", lambda b: b, lambda b: b)
            good = pb.MatchPrefixRequest(namespace=ns, block_hashes=chains[0]).SerializeToString()
            with pytest.raises(grpc.RpcError) as err:
                list(raw(iter([good, b"\xff\xff"]), timeout=5))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert c.match(ns, chains[3]).num_matched == 4  # the master still serves
