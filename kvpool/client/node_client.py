"""`NodeClient`: calls to the prefill and decode nodes, typed events out (`kvpool.client.node_types`).

The router, the demo and the benchmarks hand a request off through it: `prefill` streams a
`FirstToken` then `Published`; `decode` streams `DecodeTokens`* then `Finished`; `handoff` is both on one
prefill and one decode node (decode continues from the first token, recomputing the prompt when its
publish did not commit). Channels are cached per address until `close`. A failed call raises the
`KVPoolError` of its gRPC status (`kvpool.rpc.status.raise_from_rpc_error`; UNAVAILABLE, a node that
cannot be reached, is `Unavailable`), its message prefixed with `what` when given. Closing a stream
early cancels the call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc

from kvpool.client import convert
from kvpool.client.node_types import (
    DecodeEvent,
    DecodeRequest,
    FirstToken,
    PrefillEvent,
    PrefillRequest,
    Published,
)
from kvpool.errors import Unavailable
from kvpool.rpc.server import channel
from kvpool.rpc.status import raise_from_rpc_error
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc


class NodeClient:
    """Prefill and decode calls with a deadline of `timeout_s` seconds per call (the whole stream)."""

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def __enter__(self) -> NodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stub(self, address: str, kind: str) -> Any:
        """The `Prefill` or `Decode` stub (`kind`: "prefill" | "decode") on the channel to `address`."""
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address)
        return pb_grpc.PrefillStub(ch) if kind == "prefill" else pb_grpc.DecodeStub(ch)

    def prefill(self, address: str, req: PrefillRequest, *, what: str = "") -> Iterator[PrefillEvent]:
        """`req` on the prefill node at `address` (host:port): `FirstToken`, then `Published` unless the
        request does not publish. Raises `KVPoolError` (see the module)."""
        call = self._stub(address, "prefill").Prefill(convert.prefill_request_pb(req), timeout=self.timeout_s)
        try:
            for ev in call:
                event = convert.prefill_event(ev)
                if event is not None:
                    yield event
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, what)
        finally:
            _cancel(call)

    def decode(self, address: str, req: DecodeRequest, *, what: str = "") -> Iterator[DecodeEvent]:
        """`req` on the decode node at `address`: `DecodeTokens`* (the tokens after the first), then one
        `Finished`. Raises `KVPoolError` (see the module)."""
        call = self._stub(address, "decode").Decode(convert.decode_request_pb(req), timeout=self.timeout_s)
        try:
            for ev in call:
                yield from convert.decode_events(ev)
        except grpc.RpcError as exc:
            raise_from_rpc_error(exc, what)
        finally:
            _cancel(call)

    def handoff(
        self, prefill_address: str, decode_address: str, req: PrefillRequest
    ) -> Iterator[PrefillEvent | DecodeEvent]:
        """`req` prefilled on one node and decoded on the other: `FirstToken`, `Published` (status
        "publish_failed" when the prefill sent none), then the decode node's `DecodeTokens`* and
        `Finished`. Decode always runs (a stop first token or `max_tokens=1` ends there at once). Raises
        `KVPoolError`; `Unavailable` when the prefill ended without a first token."""
        rid = req.request_id
        first: FirstToken | None = None
        published: Published | None = None
        for ev in self.prefill(prefill_address, req, what=f"Prefill {rid}"):
            if isinstance(ev, FirstToken):
                first = ev
                yield ev
            else:
                published = ev
        if first is None:
            raise Unavailable(f"Prefill {rid} ended without a first token")
        yield published if published is not None else Published(status="publish_failed")
        dreq = DecodeRequest.handoff(req, first, published)
        yield from self.decode(decode_address, dreq, what=f"Decode {rid}")


def _cancel(call: Any) -> None:
    """End a call whose stream the caller stopped reading (no-op once it finished)."""
    cancel = getattr(call, "cancel", None)
    if cancel is not None:
        cancel()
