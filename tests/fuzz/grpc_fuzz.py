"""The gRPC fuzz loop and the live servers it runs against (shared by the default and the slow tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpool.client.store_client import SignedCalls
from kvpool.cluster.local import LocalCluster
from kvpool.membership import MASTER_CALL_METADATA, master_call_credential
from kvpool.rpc.server import channel
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from tests.fuzz.cluster import Cases
from tests.fuzz.messages import Hints, message, near_valid
from tests.fuzz.targets import ROLE, Target, call, hints

RAW = st.binary(max_size=64) | st.binary(min_size=1000, max_size=3000)
"""Raw bytes sent as the serialized request (mostly undecodable, some decode to odd messages)."""

FOUND = {
    "Master.RegisterNode": [b"\x00"],  # undecodable: was INTERNAL ("Exception deserializing request!")
    "Master.MatchPrefixStream": [b"\x00"],  # undecodable in a stream: was INTERNAL (the abort overridden)
}
"""Cases the fuzz found, kept as explicit examples (each was a wrong status before its fix)."""

PROMPT = [1, *range(40, 40 + 37)]  # 38 tokens: two full blocks and a tail
GREEDY = pb.SamplingParams(max_tokens=4)


@dataclass
class Servers:
    """Channels to every live server, by role, and this cluster's field hints."""

    channels: dict[str, grpc.Channel]
    hints: Hints
    first_token: int  # the greedy first token of PROMPT, taken before any fuzz
    decoded: list[int]  # the greedy tokens decode gives for PROMPT, before any fuzz

    def prefill(self, tokens: list[int], **kw: object) -> list[pb.PrefillEvent]:
        stub = pb_grpc.PrefillStub(self.channels["prefill"])
        req = pb.PrefillRequest(request_id="probe", token_ids=tokens, sampling=GREEDY, **kw)  # type: ignore[arg-type]
        return list(stub.Prefill(req, timeout=60))

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def decode(self, tokens: list[int], first: int) -> list[int]:
        stub = pb_grpc.DecodeStub(self.channels["decode"])
        req = pb.DecodeRequest(request_id="probe", token_ids=tokens, first_token=first, sampling=GREEDY)
        return [t for ev in stub.Decode(req, timeout=60) for t in ev.token_ids]


def connect(cluster: LocalCluster) -> Servers:
    """Channels to every server of `cluster`; the greedy baselines of `PROMPT` are taken now."""
    addresses = {
        "master": cluster.master_address,
        "store": cluster.stores[0].info["grpc_address"],
        "prefill": cluster.prefill_addresses[0],
        "decode": cluster.decode_addresses[0],
    }
    channels = {role: channel(a) for role, a in addresses.items()}
    caps = cluster.capabilities()
    if caps is not None:  # a secured store serves the master only: the fuzzer signs as the master does
        channels["store"] = grpc.intercept_channel(
            channels["store"],
            SignedCalls(
                addresses["store"],
                lambda a, m, body: [
                    (
                        MASTER_CALL_METADATA,
                        master_call_credential(caps, a, m, body, time.time_ns() // 1_000_000),
                    )
                ],
            ),
        )
    s = Servers(channels, {}, 0, [])
    try:
        info = pb_grpc.StoreStub(s.channels["store"]).GetInfo(pb.GetInfoRequest(), timeout=10)
        s.hints = hints(info.layout_fingerprint, info.num_slots, info.node.data_address)
        s.first_token = s.prefill(PROMPT, use_cache=False)[0].first_token.token_id
        s.decoded = s.decode(PROMPT, s.first_token)
    except BaseException:
        s.close()
        raise
    return s


def requests(target: Target, h: Hints) -> st.SearchStrategy[bytes]:
    """Serialized requests for `target`: descriptor-derived messages (with hints), near-valid ones, or
    raw bytes."""
    generic = message(target.method.input_type, h)
    near = near_valid(target.method.input_type, h)
    msgs = generic if near is None else generic | near
    return msgs.map(lambda m: m.SerializeToString()) | RAW


def fuzz(servers: Servers, target: Target, n: int, cases: Cases) -> None:
    """Send `n` fuzz cases to `target` (derandomized: the same cases every run)."""
    ch = servers.channels[ROLE[target.service]]

    def run(payload: bytes) -> None:
        cases.add(target.name)
        code, details = call(ch, target, payload)
        assert code in target.allowed, f"{target.name}: {code} {details}"

    for payload in FOUND.get(target.name, []):
        run = example(payload=payload)(run)
    run = given(payload=requests(target, servers.hints))(run)
    settings(max_examples=n, deadline=None, derandomize=True, database=None,
             suppress_health_check=list(HealthCheck))(run)()  # fmt: skip
