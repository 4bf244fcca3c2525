"""Proto views of the master's records for the servicer (`kvpool.master.service`): endpoints, node stats,
match responses, locations, and the argument checks the servicer shares."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from kvpool.client.convert import load_pb
from kvpool.errors import InvalidArgument
from kvpool.index.results import MatchResult
from kvpool.master.core import Master
from kvpool.master.nodes import NodeRecord
from kvpool.types import Location
from kvpool.v1 import kvpool_pb2 as pb

MAX_ID_LEN = 256


def endpoint(rec: NodeRecord) -> pb.NodeEndpoint:
    return pb.NodeEndpoint(
        node_id=rec.node_id,
        role=rec.role,
        grpc_address=rec.grpc_address,
        data_address=rec.data_address,
        epoch=rec.epoch,
        url=rec.url,
        engine_namespace=(
            pb.EngineNamespace(
                model_id=rec.engine_namespace[0],
                weights_version=rec.engine_namespace[1],
                layout_fingerprint=rec.engine_namespace[2],
                engine=rec.engine_namespace[3],
            )
            if rec.engine_namespace
            else None
        ),
    )


def location(loc: pb.BlockLocation) -> Location:
    return Location(loc.node_id, loc.slot, loc.generation, loc.local)


def location_pb(loc: Location) -> pb.BlockLocation:
    return pb.BlockLocation(
        node_id=loc.node_id,
        slot=loc.slot,
        generation=loc.generation,
        local=loc.local,
        capability=loc.capability,
        capability_expiry_ms=loc.capability_expiry_ms,
    )


def engine_url(role: str, url: str) -> str:
    """A vLLM engine's OpenAI base URL (`http(s)://host:port`, no trailing slash); other roles send none."""
    if not role.startswith("vllm"):
        if url:
            raise InvalidArgument(f"only vLLM engines register a url, not role {role!r}")
        return url
    if url and not re.fullmatch(r"https?://[^/\s]+:\d{1,5}", url.rstrip("/")):
        raise InvalidArgument(f"url must be http(s)://host:port, got {url!r}")
    return url.rstrip("/")


def engine_namespace(role: str, n: pb.NodeEndpoint) -> tuple[str, ...]:
    """A vLLM engine's namespace base (model, weights version, layout, engine), each field bounded; ()
    when none was sent. Other roles send none (`InvalidArgument`)."""
    if not n.HasField("engine_namespace"):
        return ()
    if not role.startswith("vllm"):
        raise InvalidArgument(f"only vLLM engines register an engine_namespace, not role {role!r}")
    e = n.engine_namespace
    fields = (e.model_id, e.weights_version, e.layout_fingerprint, e.engine)
    names = ("model_id", "weights_version", "layout_fingerprint", "engine")
    for value, name in zip(fields, names, strict=True):
        if not value:
            raise InvalidArgument(f"engine_namespace.{name} must be non-empty")
        short(value, f"engine_namespace.{name}")
    return fields


def short(value: str, what: str) -> str:
    if len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"{what} is longer than {MAX_ID_LEN} characters")
    return value


def node_stats(m: Master, rec: NodeRecord) -> pb.NodeStats:
    """Under the master's lock."""
    dp = rec.dataplane
    return pb.NodeStats(
        node=endpoint(rec),
        alive=rec.alive,
        draining=rec.draining,
        num_slots=rec.num_slots,
        num_used_slots=rec.num_allocated if rec.is_store else 0,
        num_blocks=m.index.num_blocks_on_node(rec.node_id),
        used_bytes=m.index.bytes_on_node(rec.node_id),
        load=load_pb(rec.load),
        dataplane_state=dp.refresh(m.clock.now_ms(), m.dataplane_policy) if rec.is_store else "",
        num_dataplane_failures=dp.num_failures,
        silent_ms=max(0, m.clock.now_ms() - rec.last_seen_ms),
    )


def match_response(
    res: MatchResult,
    nodes: Sequence[NodeRecord],
    request_id: str,
    lease_ttl_ms: int = 0,
    packed: bool = False,
    grants: tuple[Sequence[bytes], int] = ((), 0),
) -> pb.MatchPrefixResponse:
    """The response; `packed`: replicas as the replica_* columns (no message per replica); `grants`: a
    read capability per replica in packed order, and their expiry (see `grants.match_grants`)."""
    resp = pb.MatchPrefixResponse(
        num_matched=res.num_matched,
        lease_id=res.lease_id or 0,
        lease_ttl_ms=lease_ttl_ms if res.lease_id else 0,
        nodes=[endpoint(n) for n in nodes],
        request_id=request_id,
    )
    if not res.num_matched:
        return resp
    caps, expiry = grants
    if not packed:
        resp.replicas.extend(
            pb.BlockReplicas(locations=[location_pb(x) for x in locs]) for locs in res.locations
        )
        flat = [x for r in resp.replicas for x in r.locations]
        for x, cap in zip(flat if caps else (), caps, strict=True):
            x.capability, x.capability_expiry_ms = cap, expiry
        return resp
    if caps:
        resp.replica_capability.extend(caps)
        resp.capability_expiry_ms = expiry
    if res.extra:  # some block has several replicas: flatten them in order
        flat = [loc for locs in res.locations for loc in locs]
        names = list(dict.fromkeys(loc.node_id for loc in flat))
        at = {name: k for k, name in enumerate(names)}
        resp.replica_node_ids.extend(names)
        resp.replica_node.extend([at[loc.node_id] for loc in flat])
        resp.replica_slot.extend([loc.slot for loc in flat])
        resp.replica_generation.extend([loc.generation for loc in flat])
        resp.replica_count.extend([len(locs) for locs in res.locations])
        resp.replica_local.extend([i for i, loc in enumerate(flat) if loc.local])
        return resp
    ks = res.replica_node.tolist()
    table = list(dict.fromkeys(ks))
    resp.replica_node_ids.extend([res.node_ids[k] for k in table])
    if len(table) == 1:
        resp.replica_node.extend([0] * len(ks))
    else:
        at = {k: i for i, k in enumerate(table)}
        resp.replica_node.extend([at[k] for k in ks])
    resp.replica_slot.extend(res.replica_slot.tolist())
    resp.replica_generation.extend(res.replica_generation.tolist())
    if res.replica_local.any():
        resp.replica_local.extend(np.flatnonzero(res.replica_local).tolist())
    return resp
