"""`MatchStream`: prefix matches over one `MatchPrefixStream` call (kvpool.client.MasterClient.match_stream)."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence

import grpc

from kvpool.client import convert as cv
from kvpool.client.errors import raise_refined
from kvpool.errors import DeadlineExceeded
from kvpool.types import Match
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc


class MatchStream:
    """Matches over one `MatchPrefixStream` call, answered in order: `match` (one in flight) or
    `send`/`receive` (pipelined). One caller thread; `close()` when done."""

    def __init__(self, stub: pb_grpc.MasterStub, address: str) -> None:
        self._address = address
        self._requests: queue.SimpleQueue[pb.MatchPrefixRequest | None] = queue.SimpleQueue()
        self._responses: Iterator[pb.MatchPrefixResponse] = stub.MatchPrefixStream(self._iter())

    def _iter(self) -> Iterator[pb.MatchPrefixRequest]:
        while True:
            item = self._requests.get()
            if item is None:
                return
            yield item

    def match(
        self,
        namespace: bytes,
        block_hashes: Sequence[bytes],
        *,
        count_hit: bool = False,
        lease_ttl_ms: int = 0,
        num_prompt_tokens: int = 0,
    ) -> Match:
        self.send(
            namespace,
            block_hashes,
            count_hit=count_hit,
            lease_ttl_ms=lease_ttl_ms,
            num_prompt_tokens=num_prompt_tokens,
        )
        return self.receive()

    def send(
        self,
        namespace: bytes,
        block_hashes: Sequence[bytes],
        *,
        count_hit: bool = False,
        lease_ttl_ms: int = 0,
        num_prompt_tokens: int = 0,
    ) -> None:
        """Queue one match (one prompt) without waiting: pipelining, several in flight on the stream.
        Each `receive()` returns the answer to the oldest one sent and not yet received."""
        self._requests.put(
            cv.match_pb(namespace, block_hashes, count_hit, lease_ttl_ms, num_prompt_tokens, "")
        )

    def receive(self) -> Match:
        """The answer to the oldest match sent and not yet received (blocks until it arrives)."""
        try:
            return cv.match(next(self._responses))
        except grpc.RpcError as exc:
            raise_refined(exc, f"MatchPrefixStream at master {self._address}")
        except StopIteration:
            raise DeadlineExceeded("match stream ended") from None

    def close(self) -> None:
        self._requests.put(None)
        cancel = getattr(self._responses, "cancel", None)
        if cancel is not None:
            cancel()

    def __enter__(self) -> MatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
