"""What the gRPC fuzz sends where: one `Target` per method of every service in the proto.

`TARGETS` is built from `kvpool_pb2.DESCRIPTOR.services_by_name`; `HINTS` holds the per-method field
hints that reach the deep code paths. A method added to the proto is fuzzed with generic messages at
once; `test_every_rpc_has_a_fuzz_target` fails until it is listed in `EXPECTED` (and so reviewed).
Calls go through a generic channel with identity serializers, so raw bytes and messages travel alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import strategies as st

from kvpool.v1 import kvpool_pb2 as pb
from tests.fuzz.messages import Hints, Only

SC = grpc.StatusCode
PROPER = frozenset({
    SC.OK, SC.INVALID_ARGUMENT, SC.NOT_FOUND, SC.FAILED_PRECONDITION, SC.RESOURCE_EXHAUSTED,
    SC.DEADLINE_EXCEEDED, SC.UNAUTHENTICATED, SC.PERMISSION_DENIED, SC.ABORTED, SC.OUT_OF_RANGE,
    SC.ALREADY_EXISTS,
})  # fmt: skip
"""Every answer must be one of these (UNIMPLEMENTED only for unknown methods; never UNKNOWN/INTERNAL)."""

PEER_UNAVAILABLE = frozenset({SC.UNAVAILABLE})
"""Also proper where the server itself calls a peer the request names (a fuzzed store address)."""

EXPECTED = {
    "Master": {"JoinChallenge", "RegisterNode", "Heartbeat", "DeregisterNode", "RegisterNamespace", "SetModelVersion",
               "MatchPrefix", "MatchPrefixStream", "RenewLease", "ReleaseLease", "ReleaseLeases", "Reserve", "Commit", "ReserveBatch", "CommitBatch", "Abort",
               "RemoveBlocks", "ReportBadReplica", "ReportDataPlaneFailure", "ReportLocal", "Stats", "ListNodes", "Drain", "Evict",
               "InvalidateNamespace", "RegisterAdapter", "ReloadAdapter", "UnloadAdapter", "ListAdapters", "Masters"},
    "Store": {"GetInfo", "ReserveSlots", "CommitSlots", "FreeSlots", "Inventory", "CopyBlocks",
              "DemoteBlocks", "PromoteBlocks"},
    "Prefill": {"Prefill", "GetInfo"},
    "Decode": {"Decode", "GetInfo"},
}  # fmt: skip
"""The methods reviewed for fuzzing; the proto's services must list exactly these."""

ROLE = {"Master": "master", "Store": "store", "Prefill": "prefill", "Decode": "decode"}
TIMEOUT_S = {"Prefill": 30.0, "Decode": 30.0}

VOCAB = 259
TINY_PROMPT = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
"""Tiny prompts of valid token ids for the methods that run the model."""


def hints(layout: str, num_slots: int, data_address: str) -> Hints:
    """Field hints for this cluster: its layout, the store's slots the master never reaches in a fuzz
    run (the top eighth: the master allocates from slot 0 up), small generation numbers."""
    top = st.integers(num_slots - num_slots // 8, num_slots - 1)
    gen = st.integers(0, 4)
    ns16 = st.binary(min_size=16, max_size=16)
    sampling = st.builds(pb.SamplingParams, max_tokens=st.integers(1, 4)) | st.builds(
        pb.SamplingParams,
        temperature=st.sampled_from([0.0, 0.0, 0.7, 1e-30, 1e30, -1.0, float("nan"), float("inf")]),
        top_p=st.sampled_from([0.0, 0.5, 1.0, 1.5, float("nan")]),
        top_k=st.integers(0, 3) | st.just(2**32 - 1),
        seed=st.integers(0, 2**64 - 1),
        has_seed=st.booleans(),
        max_tokens=st.integers(0, 4),
        stop_token_ids=st.lists(st.integers(0, VOCAB + 2), max_size=3),
    )
    m, s, p, d = (
        "kvpool.v1.",
        "kvpool.v1.SlotReservation.",
        "kvpool.v1.PrefillRequest.",
        "kvpool.v1.DecodeRequest.",
    )
    slot_ref = st.builds(pb.SlotRef, slot=top, generation=gen)
    fake_store = st.builds(
        pb.NodeEndpoint,
        node_id=st.sampled_from(["fz0", "fz1", "fz2"]),
        role=st.just("store"),
        grpc_address=st.just("127.0.0.1:1"),
        data_address=st.just("127.0.0.1:1"),
        epoch=st.integers(0, 3),
    )
    return {
        m + "RegisterNodeRequest.node": fake_store,
        m + "RegisterNodeRequest.layout_fingerprint": st.just(layout),
        m + "RegisterNodeRequest.protocol_version": st.integers(0, 2),
        m + "RegisterNodeRequest.num_slots": st.integers(0, 64),
        m + "RegisterNodeRequest.block_nbytes": st.just(65536),
        m + "HeartbeatRequest.node_id": st.sampled_from(["fz0", "fz1", "fz2"]),
        # only the fuzz's own fake stores leave: the cluster's real nodes keep serving
        m + "DeregisterNodeRequest.node_id": st.sampled_from(["fz0", "fz1", "fz2"]),
        m + "DeregisterNodeRequest.epoch": st.integers(0, 3),
        # only the fuzz's own fake stores are reported: the cluster's real stores keep their data plane
        m + "ReportDataPlaneFailureRequest.node_id": st.sampled_from(["fz0", "fz1", "fz2", ""]),
        m + "ReportDataPlaneFailureRequest.kind": st.sampled_from(["write", "read", "checksum", "", "x"]),
        m + "RegisterNamespaceRequest.layout_fingerprint": st.just(layout),
        m + "MatchPrefixRequest.namespace": ns16,
        m + "ReserveRequest.block_nbytes": st.just(65536),
        # the store's own slots: in range but out of the master's way, so the pool keeps serving
        s + "slot": Only(top | st.integers(num_slots, 2**64 - 1)),
        s + "generation": gen,
        s + "namespace": ns16,
        s + "block_hash": ns16,
        m + "SlotRef.slot": Only(top | st.integers(num_slots, 2**64 - 1)),
        m + "SlotRef.generation": gen,
        m + "ReserveSlotsRequest.slots": st.lists(st.builds(
            pb.SlotReservation, slot=top, generation=gen, namespace=ns16, block_hash=ns16), max_size=3),
        m + "ReserveSlotsRequest.write_lease_ms": st.integers(1, 3000),
        m + "CommitSlotsRequest.slots": st.lists(slot_ref, max_size=3),
        m + "FreeSlotsRequest.slots": st.lists(slot_ref, max_size=3),
        m + "CopyBlocksRequest.blocks": st.lists(st.builds(
            pb.CopyBlock, src=st.builds(pb.SlotRef, slot=st.integers(0, 20), generation=gen), dst=slot_ref,
            checksum=st.integers(0, 2**64 - 1)), max_size=3),
        m + "TierMoveRequest.moves": st.lists(st.builds(pb.TierMove, src=slot_ref, dst=slot_ref), max_size=3),
        m + "CopyBlocksRequest.src_data_address": st.sampled_from([data_address, "127.0.0.1:1", "nohost", ":"]),
        # the model's work per call stays tiny: short prompts, at most a few new tokens
        p + "token_ids": TINY_PROMPT,
        p + "publish": st.booleans(),
        p + "use_cache": st.booleans(),
        d + "prompt_committed": st.booleans(),
        d + "publish": st.booleans(),
        d + "use_cache": st.booleans(),
        p + "sampling": Only(sampling | st.just(pb.SamplingParams())),
        d + "token_ids": TINY_PROMPT,
        d + "first_token": st.integers(0, VOCAB - 1),
        d + "sampling": Only(sampling | st.just(pb.SamplingParams())),
    }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Target:
    """One method: its full path, shape and the statuses it may answer."""

    service: str
    method: MethodDescriptor
    allowed: frozenset[grpc.StatusCode]

    @property
    def name(self) -> str:
        return f"{self.service}.{self.method.name}"

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"


def targets() -> list[Target]:
    """Every method of every service in the proto (whatever `EXPECTED` says)."""
    out = []
    for sname, svc in pb.DESCRIPTOR.services_by_name.items():
        for method in svc.methods:
            peer = sname == "Master" or method.name == "CopyBlocks"
            out.append(Target(sname, method, PROPER | (PEER_UNAVAILABLE if peer else frozenset())))
    return out


def call(ch: grpc.Channel, target: Target, payload: bytes, timeout_s: float | None = None) -> tuple[Any, str]:
    """Send `payload` (serialized request bytes) to `target`; returns (status code, details)."""
    m = target.method
    timeout = timeout_s or TIMEOUT_S.get(target.service, 10.0)
    try:
        if m.client_streaming:
            fn = ch.stream_stream(target.path, request_serializer=None, response_deserializer=None)
            for _ in fn(_repeat(payload), timeout=timeout):
                pass
        elif m.server_streaming:
            for _ in ch.unary_stream(target.path, request_serializer=None, response_deserializer=None)(
                payload, timeout=timeout
            ):
                pass
        else:
            ch.unary_unary(target.path, request_serializer=None, response_deserializer=None)(
                payload, timeout=timeout
            )
    except grpc.RpcError as exc:
        return exc.code(), str(exc.details())
    return SC.OK, ""


def _repeat(payload: bytes) -> Iterator[bytes]:
    yield payload
    yield payload
