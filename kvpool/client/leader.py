"""Following the leader among masters in high availability (kvpool.master.ha): the list of masters a
client knows, a channel to each, the one in use, and the redirect a non-leader's refusal carries."""

from __future__ import annotations

import re
import threading

import grpc

from kvpool.rpc.server import channel
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

_NOT_LEADER = re.compile(r"not the leader \(leader is ([^)]*)\)")


def not_leader_redirect(details: str | None) -> str | None:
    """From an UNAVAILABLE refusal of a master that does not lead (kvpool.master.ha.gate): the leader's
    address, "" when it named none ("unknown"); None when `details` is no such refusal."""
    found = _NOT_LEADER.search(details or "")
    if found is None:
        return None
    leader = found.group(1).strip()
    return "" if leader == "unknown" else leader


def never_sent(details: str | None) -> bool:
    """An UNAVAILABLE whose call never reached a server (no connection could be made)."""
    return "failed to connect" in (details or "").lower()


class Masters:
    """ "a:1[,b:2...]": the masters, the one in use (`address`, `stub`), one channel each opened on first
    use and kept until `close()` (switching never cancels a call in flight on the previous one).
    Thread-safe."""

    def __init__(self, addresses: str) -> None:
        self.addresses = tuple(a.strip() for a in addresses.split(",") if a.strip()) or (addresses,)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self.address = self.addresses[0]
        self.stub = self._stub_for(self.address)

    def _stub_for(self, address: str) -> pb_grpc.MasterStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address)
            return pb_grpc.MasterStub(ch)

    def use(self, address: str) -> None:
        """Send the following calls to `address` (one of `addresses`: a client never follows a leader named
        outside its list)."""
        stub = self._stub_for(address)
        self.stub, self.address = stub, address

    def next_after(self, address: str) -> str:
        """The master after `address` in the list: the first one for an address outside it, "" for the
        only one."""
        if address not in self.addresses:
            return self.addresses[0]
        if len(self.addresses) < 2:
            return ""
        return self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()
