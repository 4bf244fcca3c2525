"""The serving key: the credential that opens a serving node's `Prefill` and `Decode` calls (and, given to
vLLM as its API key, a vLLM engine's OpenAI server). Only the router and the admin hold it.

Without it anyone who reaches a node's port could run inference past the router's API keys, with any
`cache_salt` (asking, block by block, whether another tenant sent a prefix). So:

- a caller (router, admin, benchmark client) reads the key from `KVPOOL_SERVING_KEY_FILE` (0600, first
  line) and every channel it makes (`kvpool.rpc.server.channel`) sends it in the `kvpool-serving-key`
  metadata of its `Prefill`/`Decode` calls, and of those only;
- a serving node holds only the key's SHA-256 (`KVPOOL_SERVING_KEY_SHA256`, hex): it cannot call another
  node with it. Its `Prefill.Prefill` and `Decode.Decode` answer UNAUTHENTICATED without a key of that
  digest (compared in constant time); `GetInfo` and health checks stay open.

`kvpool up` and `LocalCluster` make a fresh key per cluster (`new_serving_key`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

SERVING_KEY_METADATA = "kvpool-serving-key"
"""gRPC metadata key carrying the serving key on `Prefill`/`Decode` calls."""
KEY_FILE_ENV = "KVPOOL_SERVING_KEY_FILE"
DIGEST_ENV = "KVPOOL_SERVING_KEY_SHA256"
GUARDED_SERVICES = ("/kvpool.v1.Prefill/", "/kvpool.v1.Decode/")
OPEN_METHODS = frozenset({"/kvpool.v1.Prefill/GetInfo", "/kvpool.v1.Decode/GetInfo"})


def key_digest(key: str) -> str:
    """Hex SHA-256 of a serving key (what a serving node holds)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_serving_key(directory: Path) -> tuple[dict[str, str], dict[str, str]]:
    """A fresh serving key in a new 0600 file `directory/serving_key`. Returns (the callers' environment
    entries naming the file, the serving nodes' entries holding its digest)."""
    key = secrets.token_urlsafe(32)
    path = Path(directory) / "serving_key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return {KEY_FILE_ENV: str(path)}, {DIGEST_ENV: key_digest(key)}


def serving_key() -> str:
    """This process's serving key (the first line of `KVPOOL_SERVING_KEY_FILE`, read afresh); "" when the
    variable is unset. Raises `InvalidArgument` naming the file when it cannot be read or is empty."""
    path = os.environ.get(KEY_FILE_ENV, "")
    if not path:
        return ""
    try:
        return Path(path).read_text().strip().splitlines()[0].strip()
    except (OSError, IndexError, UnicodeDecodeError) as exc:
        from kvpool.errors import InvalidArgument

        why = "it is empty" if isinstance(exc, IndexError) else exc
        raise InvalidArgument(f"cannot read the serving key file {path} ({KEY_FILE_ENV}): {why}") from None


def call_metadata(key: str) -> Callable[[str], list[tuple[str, str]]]:
    """Per-call metadata for a channel: the key on `Prefill`/`Decode` calls, nothing on others (the key
    never travels to a master or a store)."""
    pair = [(SERVING_KEY_METADATA, key)]

    def metadata(method: str) -> list[tuple[str, str]]:
        return pair if method.startswith(GUARDED_SERVICES) else []

    return metadata


class ServingKeyGate(grpc.ServerInterceptor):
    """UNAUTHENTICATED for a `Prefill`/`Decode` call without a key whose SHA-256 is `digest_hex`."""

    def __init__(self, digest_hex: str) -> None:
        from kvpool.rpc.guards import deny_handlers

        self._expected = bytes.fromhex(digest_hex)
        if len(self._expected) != 32:
            raise ValueError(f"{DIGEST_ENV} must be a hex SHA-256 (64 hex digits)")
        self._deny = deny_handlers(
            "this serving node takes requests only from the router: missing or wrong serving key "
            f"({SERVING_KEY_METADATA})"
        )

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        method = details.method or ""
        if not method.startswith(GUARDED_SERVICES) or method in OPEN_METHODS:
            return continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == SERVING_KEY_METADATA:
                got = value.encode() if isinstance(value, str) else bytes(value)
                if hmac.compare_digest(hashlib.sha256(got).digest(), self._expected):
                    return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        return self._deny[(handler.request_streaming, handler.response_streaming)]


def server_gate() -> list[grpc.ServerInterceptor]:
    """The gate when this process is configured with a key digest (`KVPOOL_SERVING_KEY_SHA256`)."""
    digest = os.environ.get(DIGEST_ENV, "")
    return [ServingKeyGate(digest)] if digest else []


def engine_headers() -> dict[str, str]:
    """HTTP headers for calls to a vLLM engine started with the serving key as its API key (`kvpool up`
    gives it `VLLM_API_KEY`): `Authorization: Bearer <key>`; {} without a key."""
    key = serving_key()
    return {"Authorization": f"Bearer {key}"} if key else {}
