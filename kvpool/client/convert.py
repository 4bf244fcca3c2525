"""Proto <-> client values (the only place in `kvpool.client` that touches proto messages): the master's
calls (`kvpool.client.types`), sampling parameters, the serving nodes' hand-off (`kvpool.client.node_types`),
and the master's orders to store nodes (`kvpool.client.store_client`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.client.node_types import (
    DecodeEvent,
    DecodeRequest,
    DecodeStats,
    DecodeTokens,
    Finished,
    FirstToken,
    PrefillEvent,
    PrefillRequest,
    PrefillStats,
    Published,
)
from kvpool.client.types import (
    CommitBlock,
    EngineNamespace,
    Match,
    NamespaceStatus,
    NodeIdentity,
    NodeInfo,
    NodeLoad,
    NodeStatus,
    PoolStats,
    Reservation,
    ReservedBlock,
)
from kvpool.errors import InvalidArgument
from kvpool.sampling import SamplingParams
from kvpool.types import HASH_NBYTES, DiskTierReport, InventoryBatch, Location, SlotOrder
from kvpool.v1 import kvpool_pb2 as pb


def location(loc: Any) -> Location:
    return Location(
        loc.node_id, loc.slot, loc.generation, loc.local, loc.capability, loc.capability_expiry_ms
    )


def location_pb(loc: Location) -> pb.BlockLocation:
    return pb.BlockLocation(node_id=loc.node_id, slot=loc.slot, generation=loc.generation, local=loc.local)


def node_info(n: Any) -> NodeInfo:
    e = n.engine_namespace
    engine_ns = (
        EngineNamespace(e.model_id, e.weights_version, e.layout_fingerprint, e.engine)
        if n.HasField("engine_namespace")
        else None
    )
    return NodeInfo(n.node_id, n.role, n.grpc_address, n.data_address, n.epoch, n.url, engine_ns)


def engine_namespace_pb(e: EngineNamespace | None) -> pb.EngineNamespace | None:
    if e is None:
        return None
    return pb.EngineNamespace(
        model_id=e.model_id,
        weights_version=e.weights_version,
        layout_fingerprint=e.layout_fingerprint,
        engine=e.engine,
    )


def endpoint_pb(n: NodeInfo) -> pb.NodeEndpoint:
    return pb.NodeEndpoint(
        node_id=n.node_id,
        role=n.role,
        grpc_address=n.grpc_address,
        data_address=n.data_address,
        epoch=n.epoch,
        url=n.url,
        engine_namespace=engine_namespace_pb(n.engine_namespace),
    )


def load_pb(ld: NodeLoad) -> pb.NodeLoad:
    return pb.NodeLoad(
        queue_len=ld.queue_len,
        recompute_s_per_token=ld.recompute_s_per_token,
        recompute_s_per_token_ctx=ld.recompute_s_per_token_ctx,
        recompute_overhead_s=ld.recompute_overhead_s,
        link_alpha_s=ld.link_alpha_s,
        link_beta_bytes_per_s=ld.link_beta_bytes_per_s,
        kv_usage=ld.kv_usage,
    )


def match_pb(
    namespace: bytes,
    block_hashes: Sequence[bytes],
    count_hit: bool,
    lease_ttl_ms: int,
    num_prompt_tokens: int,
    request_id: str,
) -> pb.MatchPrefixRequest:
    return pb.MatchPrefixRequest(
        namespace=namespace,
        block_hashes=list(block_hashes),
        count_hit=count_hit,
        lease_ttl_ms=lease_ttl_ms,
        request_id=request_id,
        num_prompt_tokens=num_prompt_tokens,
        packed_replicas=True,
    )


def _packed_replicas(resp: Any) -> list[tuple[Location, ...]]:
    """The replica_* columns of a packed `MatchPrefixResponse` as one tuple of `Location`s per block."""
    names = list(resp.replica_node_ids)
    node_ids = [names[k] for k in resp.replica_node]
    local = [False] * len(node_ids)
    for i in resp.replica_local:
        local[i] = True
    if resp.replica_capability:
        expiry = [resp.capability_expiry_ms] * len(node_ids)
        caps = resp.replica_capability
        flat = list(map(Location, node_ids, resp.replica_slot, resp.replica_generation, local, caps, expiry))
    else:
        flat = list(map(Location, node_ids, resp.replica_slot, resp.replica_generation, local))
    if not resp.replica_count:
        return [(loc,) for loc in flat]
    out, at = [], 0
    for count in resp.replica_count:
        out.append(tuple(flat[at : at + count]))
        at += count
    return out


def match(resp: Any) -> Match:
    """Packed replicas when the master sent them, else the per-block `replicas` messages."""
    if resp.replica_node:
        replicas = _packed_replicas(resp)
    else:
        replicas = [tuple(location(x) for x in r.locations) for r in resp.replicas]
    return Match(
        num_matched=resp.num_matched,
        replicas=replicas,
        lease_id=resp.lease_id or None,
        nodes={n.node_id: node_info(n) for n in resp.nodes},
    )


def reservation(resp: Any) -> Reservation:
    return Reservation(
        reservation_id=resp.reservation_id,
        blocks=[
            ReservedBlock(bytes(b.block_hash), b.already_present, tuple(location(x) for x in b.locations))
            for b in resp.blocks
        ],
        write_lease_ms=resp.write_lease_ms,
        nodes={n.node_id: node_info(n) for n in resp.nodes},
        num_replicas_placed=resp.num_replicas_placed,
    )


def commit_block_pb(b: CommitBlock) -> pb.CommittedBlock:
    return pb.CommittedBlock(
        block_hash=b.block_hash, checksum=b.checksum, written=[location_pb(x) for x in b.written]
    )


def node_status(n: Any) -> NodeStatus:
    return NodeStatus(
        node=node_info(n.node),
        alive=n.alive,
        draining=n.draining,
        num_slots=n.num_slots,
        num_used_slots=n.num_used_slots,
        num_blocks=n.num_blocks,
        used_bytes=n.used_bytes,
        load=load_from_pb(n.load),
        dataplane_state=n.dataplane_state,
        num_dataplane_failures=n.num_dataplane_failures,
        silent_s=n.silent_ms / 1000.0,
    )


def load_from_pb(ld: Any) -> NodeLoad:
    """A `pb.NodeLoad` as the domain value (no validation: the master's servicer validates)."""
    return NodeLoad(
        queue_len=ld.queue_len,
        recompute_s_per_token=ld.recompute_s_per_token,
        recompute_s_per_token_ctx=ld.recompute_s_per_token_ctx,
        recompute_overhead_s=ld.recompute_overhead_s,
        link_alpha_s=ld.link_alpha_s,
        link_beta_bytes_per_s=ld.link_beta_bytes_per_s,
        kv_usage=ld.kv_usage,
    )


def stats(r: Any) -> PoolStats:
    return PoolStats(
        num_blocks=r.num_blocks,
        used_bytes=r.used_bytes,
        capacity_bytes=r.capacity_bytes,
        num_live_leases=r.num_live_leases,
        num_evictions=r.num_evictions,
        num_match_requests=r.num_match_requests,
        requested_tokens=r.requested_tokens,
        hit_tokens=r.hit_tokens,
        requested_blocks=r.requested_blocks,
        hit_blocks=r.hit_blocks,
        uptime_s=r.uptime_s,
        num_namespaces=r.num_namespaces,
        num_reserved_blocks=r.num_reserved_blocks,
        num_rereplications=r.num_rereplications,
        block_size=r.block_size,
        index_bytes=r.index_bytes,
        index_bytes_limit=r.index_bytes_limit,
        num_admission_refusals=r.num_admission_refusals,
        nodes=[node_status(n) for n in r.nodes],
        namespaces=[
            NamespaceStatus(bytes(x.namespace), x.model_id, x.weights_version, x.active, x.num_blocks)
            for x in r.namespaces
        ],
    )


def sampling(msg: Any) -> SamplingParams:
    """A `pb.SamplingParams` as the domain value, validated (`InvalidArgument`); unset `top_p` and
    `max_tokens` (0 on the wire) are 1.0 and 16."""
    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.has_seed else None,
        max_tokens=int(msg.max_tokens) if msg.max_tokens else 16,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
    )


def sampling_pb(params: SamplingParams) -> pb.SamplingParams:
    """`SamplingParams` on the wire (`has_seed` says whether `seed` is set)."""
    return pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed or 0,
        has_seed=params.seed is not None,
        max_tokens=params.max_tokens,
        stop_token_ids=list(params.stop_token_ids),
    )


# ---- the serving nodes' hand-off ----------------------------------------------------------------------
def prefill_request_pb(req: PrefillRequest) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=req.request_id,
        token_ids=list(req.token_ids),
        sampling=sampling_pb(req.sampling),
        cache_salt=req.cache_salt,
        publish=req.publish,
        use_cache=req.use_cache,
    )


def decode_request_pb(req: DecodeRequest) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=req.request_id,
        token_ids=list(req.token_ids),
        first_token=req.first_token,
        block_hashes=list(req.block_hashes),
        sampling=sampling_pb(req.sampling),
        cache_salt=req.cache_salt,
        prompt_committed=req.prompt_committed,
        publish=req.publish,
        use_cache=req.use_cache,
    )


def _fields(msg: Any) -> dict[str, Any]:
    return {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields}


def prefill_event(ev: Any) -> PrefillEvent | None:
    """A `pb.PrefillEvent` as `FirstToken` or `Published` (None: neither is set, a newer node's event)."""
    if ev.HasField("first_token"):
        ft = ev.first_token
        return FirstToken(
            int(ft.token_id), tuple(bytes(h) for h in ft.block_hashes), PrefillStats(**_fields(ft.stats))
        )
    if ev.HasField("published"):
        return Published(**_fields(ev.published))
    return None


def decode_events(ev: Any) -> list[DecodeEvent]:
    """A `pb.DecodeEvent` as its `DecodeTokens` (when it carries tokens), then `Finished` (when final)."""
    out: list[DecodeEvent] = []
    if ev.token_ids:
        out.append(DecodeTokens(tuple(int(t) for t in ev.token_ids)))
    if ev.finished:
        out.append(Finished(DecodeStats(**_fields(ev.stats))))
    return out


# ---- the master's orders to store nodes, and any node's GetInfo ------------------------------------------
def slot_reservation_pb(o: SlotOrder) -> pb.SlotReservation:
    return pb.SlotReservation(
        slot=o.slot,
        generation=o.generation,
        namespace=o.namespace,
        block_hash=o.block_hash,
        parent_hash=o.parent_hash,
    )


def slot_ref_pb(slot: int, generation: int) -> pb.SlotRef:
    return pb.SlotRef(slot=slot, generation=generation)


def copy_block_pb(src: Location, dst: Location, checksum: int) -> pb.CopyBlock:
    """Copy replica `src` (with the read capability it carries) into slot `dst`; `checksum`: xxh3_64."""
    return pb.CopyBlock(
        src=slot_ref_pb(src.slot, src.generation),
        dst=slot_ref_pb(dst.slot, dst.generation),
        checksum=checksum,
        src_capability=src.capability,
        src_capability_expiry_ms=src.capability_expiry_ms,
    )


def slot_results(asked: Sequence[tuple[int, int]], results: Any) -> dict[tuple[int, int], str]:
    """{(slot, generation): error} of a store's per-slot results ("" = ok; "no result" for a slot of
    `asked` it did not answer; "refused" for a failure without a message)."""
    out = {ref: "no result" for ref in asked}
    for r in results:
        out[(r.slot, r.generation)] = "" if r.ok else (r.error or "refused")
    return out


def disk_tier_pb(r: DiskTierReport | None) -> pb.DiskTierInfo | None:
    """proto `DiskTierInfo` of a store's disk tier report (None: no tier)."""
    return None if r is None else pb.DiskTierInfo(**dataclasses.asdict(r))


def disk_tier(info: Any) -> DiskTierReport:
    """The `DiskTierReport` of a proto `DiskTierInfo`."""
    return DiskTierReport(**{f.name: getattr(info, f.name) for f in dataclasses.fields(DiskTierReport)})


def inventory_batch_pb(b: InventoryBatch, epoch: int) -> pb.InventoryResponse:
    """One `InventoryResponse` holding batch `b` as packed little-endian columns."""
    return pb.InventoryResponse(
        epoch=epoch,
        num_entries=len(b),
        namespaces=b.namespaces,
        ns_index=np.ascontiguousarray(b.ns_index, dtype="<i4").tobytes(),
        block_hashes=np.ascontiguousarray(b.block_hashes, dtype=np.uint8).tobytes(),
        parent_hashes=np.ascontiguousarray(b.parent_hashes, dtype=np.uint8).tobytes(),
        has_parent=np.ascontiguousarray(b.has_parent, dtype=np.uint8).tobytes(),
        slots=np.ascontiguousarray(b.slots, dtype="<u8").tobytes(),
        generations=np.ascontiguousarray(b.generations, dtype="<u8").tobytes(),
        checksums=np.ascontiguousarray(b.checksums, dtype="<u8").tobytes(),
        size_bytes=np.ascontiguousarray(b.size_bytes, dtype="<u8").tobytes(),
        next_slot=b.next_slot,
        medium=b"" if b.medium is None else np.ascontiguousarray(b.medium, dtype=np.uint8).tobytes(),
    )


def _column(raw: bytes, dtype: str, n: int, width: int, what: str) -> np.ndarray:
    a = np.frombuffer(raw, dtype=dtype)
    if a.size != n * width:
        raise InvalidArgument(f"inventory column {what}: {a.size} values for {n} entries of {width}")
    return a.reshape(n, width) if width > 1 else a


def inventory_batch(resp: Any) -> InventoryBatch:
    """The `InventoryBatch` of one `InventoryResponse` (read-only views of its bytes, native dtypes);
    `InvalidArgument` when a column's length does not match `num_entries` or an `ns_index` is out of range."""
    n = resp.num_entries
    ns_index = _column(resp.ns_index, "<i4", n, 1, "ns_index").astype(np.int32)
    if n and (ns_index.min() < 0 or ns_index.max() >= len(resp.namespaces)):
        raise InvalidArgument(f"inventory ns_index out of range of {len(resp.namespaces)} namespaces")
    return InventoryBatch(
        namespaces=list(resp.namespaces),
        ns_index=ns_index,
        block_hashes=_column(resp.block_hashes, "u1", n, HASH_NBYTES, "block_hashes"),
        parent_hashes=_column(resp.parent_hashes, "u1", n, HASH_NBYTES, "parent_hashes"),
        has_parent=_column(resp.has_parent, "u1", n, 1, "has_parent").astype(bool),
        slots=_column(resp.slots, "<u8", n, 1, "slots").astype(np.uint64),
        generations=_column(resp.generations, "<u8", n, 1, "generations").astype(np.uint64),
        checksums=_column(resp.checksums, "<u8", n, 1, "checksums").astype(np.uint64),
        size_bytes=_column(resp.size_bytes, "<u8", n, 1, "size_bytes").astype(np.uint64),
        next_slot=resp.next_slot,
        medium=_column(resp.medium, "u1", n, 1, "medium") if resp.medium else None,
    )


def node_identity(info: Any) -> NodeIdentity:
    return NodeIdentity(info.node.node_id, info.node.epoch, info.layout_fingerprint)
