"""Fuzz every gRPC method of every service against live servers: each call gets a proper status, never
UNKNOWN or INTERNAL, and every server keeps serving (issue #12, bad input). The slow variant sends
≥ 10,000 cases in all: `test_slow.py`."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.v1 import kvpool_pb2 as pb
from tests.fuzz.cluster import BLOCK, Cases
from tests.fuzz.grpc_fuzz import PROMPT, Servers, fuzz
from tests.fuzz.targets import EXPECTED, ROLE, Target, call, targets

DEFAULT_CASES = 10
"""Per method in the default run (30 methods: a few hundred cases, well under a minute)."""


def test_every_rpc_has_a_fuzz_target() -> None:
    """A new RPC fails here until it is reviewed into `EXPECTED` (it is fuzzed generically meanwhile)."""
    got = {name: {m.name for m in svc.methods} for name, svc in pb.DESCRIPTOR.services_by_name.items()}
    assert got == EXPECTED
    assert {t.name for t in targets()} == {f"{s}.{m}" for s, ms in EXPECTED.items() for m in ms}


@pytest.mark.parametrize("target", targets(), ids=lambda t: t.name)
def test_fuzz_method(servers: Servers, target: Target, cases: Cases) -> None:
    fuzz(servers, target, DEFAULT_CASES, cases)


@pytest.mark.parametrize("role", sorted(set(ROLE.values())))
def test_unknown_method_is_unimplemented(servers: Servers, role: str) -> None:
    svc = {v: k for k, v in ROLE.items()}[role]
    fake = Target(svc, pb.DESCRIPTOR.services_by_name[svc].methods[0], frozenset())
    ch = servers.channels[role]
    path = f"/kvpool.v1.{svc}/NoSuchMethod"
    with pytest.raises(grpc.RpcError) as err:
        ch.unary_unary(path, request_serializer=None, response_deserializer=None)(b"", timeout=5)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert call(ch, fake, b"\xff\xff\xff")[0] == grpc.StatusCode.INVALID_ARGUMENT  # undecodable: not INTERNAL


def check_still_serving(servers: Servers) -> None:
    """Every server answers its health check, and real requests still give the right answers."""
    for role, ch in servers.channels.items():
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, role
    # the greedy first token of a known prompt is what it was before the fuzz (cold, then warm)
    assert servers.prefill(PROMPT, use_cache=False)[0].first_token.token_id == servers.first_token
    assert servers.decode(PROMPT, servers.first_token) == servers.decoded
    # publish + match round trip through master and store: a fresh prompt is committed, then hit
    fresh = [1, *range(100, 100 + 3 * BLOCK)]
    events = servers.prefill(fresh, publish=True, use_cache=True)
    assert events[1].published.status == "committed", events[1].published.error
    again = servers.prefill(fresh, use_cache=True)[0].first_token
    assert again.stats.num_matched_tokens == 3 * BLOCK
    assert again.token_id == events[0].first_token.token_id


def test_servers_still_serve_after_the_fuzz(servers: Servers, cases: Cases) -> None:
    assert cases.total >= len(targets()) * DEFAULT_CASES or cases.total == 0  # ran after the fuzz
    check_still_serving(servers)
