"""`kvpool.client.NodeClient` and its values: the wire's hand-off events as typed values (every field of
the proto messages carried), the decode hand-off's rule (recompute unless committed), and a node that
cannot be reached (a real connection to a port nothing listens on) as `Unavailable` naming the call."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from kvpool.client import convert
from kvpool.client.node_client import NodeClient
from kvpool.client.node_types import (
    DecodeRequest,
    DecodeStats,
    DecodeTokens,
    Finished,
    FirstToken,
    PrefillRequest,
    PrefillStats,
    Published,
)
from kvpool.errors import Unavailable
from kvpool.sampling import SamplingParams
from kvpool.v1 import kvpool_pb2 as pb


def _filled(msg_type: type) -> dict[str, object]:
    """A value for every field of a proto message type (distinct, non-default)."""
    out: dict[str, object] = {}
    for i, f in enumerate(msg_type.DESCRIPTOR.fields, start=1):
        out[f.name] = f"s{i}" if f.type == f.TYPE_STRING else (i + 0.5 if f.type == f.TYPE_DOUBLE else i)
    return out


def test_prefill_events_carry_every_field() -> None:
    stats = _filled(pb.PrefillStats)
    ev = pb.PrefillEvent(
        first_token=pb.PrefillFirstToken(token_id=7, block_hashes=[b"a" * 32], stats=pb.PrefillStats(**stats))
    )
    first = convert.prefill_event(ev)
    assert first == FirstToken(7, (b"a" * 32,), PrefillStats(**stats))  # type: ignore[arg-type]
    assert dataclasses.asdict(first.stats) == stats
    published = _filled(pb.PrefillPublished)
    out = convert.prefill_event(pb.PrefillEvent(published=pb.PrefillPublished(**published)))
    assert isinstance(out, Published) and dataclasses.asdict(out) == published
    assert convert.prefill_event(pb.PrefillEvent()) is None


def test_decode_events_tokens_then_finished() -> None:
    stats = _filled(pb.DecodeStats)
    ev = pb.DecodeEvent(token_ids=[4, 5], finished=True, stats=pb.DecodeStats(**stats))
    tokens, fin = convert.decode_events(ev)
    assert tokens == DecodeTokens((4, 5))
    assert isinstance(fin, Finished) and fin.stats == DecodeStats(**stats)  # type: ignore[arg-type]
    assert convert.decode_events(pb.DecodeEvent(token_ids=[9])) == [DecodeTokens((9,))]


def test_handoff_recomputes_unless_committed() -> None:
    sampling = SamplingParams(max_tokens=3, seed=5)
    req = PrefillRequest(
        request_id="r", token_ids=[1, 2, 3], sampling=sampling, cache_salt="t", publish=False
    )
    first = FirstToken(9, (b"h" * 32,), PrefillStats())
    dreq = DecodeRequest.handoff(req, first, Published(status="committed"))
    assert dreq.prompt_committed and dreq.first_token == 9 and dreq.block_hashes == (b"h" * 32,)
    assert (dreq.cache_salt, dreq.publish, dreq.sampling) == ("t", False, sampling)
    assert not DecodeRequest.handoff(req, first, Published(status="publish_failed")).prompt_committed
    assert not DecodeRequest.handoff(req, first, None).prompt_committed
    wire = convert.decode_request_pb(dreq)
    assert (
        convert.sampling(wire.sampling) == sampling
        and wire.prompt_committed
        and list(wire.token_ids) == [1, 2, 3]
    )


def test_an_unreachable_node_is_unavailable_naming_the_call() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # closed when the block ends: nothing listens there
    req = PrefillRequest(request_id="r", token_ids=[1], sampling=SamplingParams())
    with NodeClient(timeout_s=5.0) as nodes:
        with pytest.raises(Unavailable, match="^Prefill r: "):
            list(nodes.prefill(address, req, what="Prefill r"))
        with pytest.raises(Unavailable, match="^Prefill r: "):
            list(nodes.handoff(address, address, req))
