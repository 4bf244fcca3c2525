"""Deterministic namespaces and chained 128-bit block hashes.

Scheme (hash version `HASH_VERSION`):

    ns        = BLAKE2b-128(person="kvpool-ns",  fields of the Namespace, each tagged + length-prefixed)
    h_0       = BLAKE2b-128(person="kvpool-blk", "v"=HASH_VERSION, "p"=ns,      "t"=tokens_0 [, "x"=extras_0])
    h_i       = BLAKE2b-128(person="kvpool-blk", "v"=HASH_VERSION, "p"=h_{i-1}, "t"=tokens_i [, "x"=extras_i])

Every field is written as `tag (1 byte) || len (uint32 LE) || bytes`. Tokens are encoded as uint32
little-endian, so ids that differ only above bit 8 (65 vs 321) never collide. Only full blocks are
hashed; a partial tail has no hash. Deterministic across processes and machines: no Python `hash()`,
no random seed (field case B05). Multimodal content enters as `MediaSpan`s: a block overlapping a span
carries the span's full digest and the overlap's offset within the span (B07, B08).

Source: the chained-hash design of vLLM's prefix caching (`hash_block_tokens`) and SGLang's radix cache,
with the fixes of the field cases B01, B04, B05, B07, B08, B09, B23, B28 (see docs/failure-classes.md).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.types import HASH_NBYTES, BlockHash, KVLayout, NamespaceId

HASH_VERSION = 1
"""Folded into every block hash: bump it when the scheme changes, so old and new never mix."""

MAX_TOKEN_ID = 2**32 - 1
_MIN_MEDIA_DIGEST_NBYTES = 16
ADAPTER_DIGEST_HEX_CHARS = 32
"""An adapter digest is BLAKE2b-128 of the adapter's files as lowercase hex (`kvpool.vllm.identity.directory_digest`)."""


def check_adapter_digest(value: str, what: str = "adapter_digest", *, allow_empty: bool = True) -> str:
    """`value` if it is an adapter's content digest (32 lowercase hex characters; "" for the base model
    where `allow_empty`); `ValueError` naming `what` otherwise: a display name ("my-lora") is refused,
    since two adapters loaded under one name must never share KV (B01)."""
    if value == "" and allow_empty:
        return value
    if (
        not isinstance(value, str)
        or len(value) != ADAPTER_DIGEST_HEX_CHARS
        or value.strip("0123456789abcdef")
    ):
        raise ValueError(
            f"{what} must be the adapter's content digest, {ADAPTER_DIGEST_HEX_CHARS} lowercase hex characters "
            f"(BLAKE2b-128 of its files, as kvpool.vllm.identity.directory_digest makes it), never a name; "
            f"got {value!r:.80}"
        )
    return value


def _field(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<I", len(payload)) + payload


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """Multimodal content occupying token positions `[start, start + length)` of a prompt.

    `digest` is the full content digest of the media item (at least 16 bytes), never a truncation.
    """

    digest: bytes
    start: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) < _MIN_MEDIA_DIGEST_NBYTES:
            raise ValueError(f"media digest must be >= {_MIN_MEDIA_DIGEST_NBYTES} bytes (full digest)")
        if self.start < 0 or self.length <= 0:
            raise ValueError(f"media span needs start >= 0 and length > 0, got {self.start}, {self.length}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace:
    """Everything that makes two KV caches incompatible. Its `digest()` is the root of every chain.

    - `model_id`: model identity (e.g. a HF repo name or a local name), non-empty.
    - `weights_version`: content digest of the weights (a new version = a new namespace, B28).
    - `layout`: the KV layout (dtype, block_size, layers, kv heads, head dim) (B23).
    - `cache_salt`: per-tenant salt, assigned server-side from the authenticated tenant (B09).
    - `adapter_digest`: LoRA/adapter identity, the content digest of its files (32 lowercase hex chars,
      `check_adapter_digest`), "" for the base model (B01); a name is refused.
    - `extra`: further (key, value) strings, sorted into the digest; `None` values are refused.
    """

    model_id: str
    weights_version: str
    layout: KVLayout
    cache_salt: str = ""
    adapter_digest: str = ""
    extra: tuple[tuple[str, str], ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError("Namespace.model_id must be a non-empty string")
        if not isinstance(self.weights_version, str) or not self.weights_version:
            raise ValueError("Namespace.weights_version must be a non-empty string")
        for name in ("cache_salt", "adapter_digest"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Namespace.{name} must be a string (use '' for none)")
        check_adapter_digest(self.adapter_digest, "Namespace.adapter_digest")
        for item in self.extra:
            if (
                not isinstance(item, tuple)
                or len(item) != 2
                or not all(isinstance(part, str) for part in item)
            ):
                raise ValueError(f"Namespace.extra items must be (str, str) pairs, got {item!r}")

    def digest(self) -> NamespaceId:
        """The 16-byte namespace id that travels in RPCs."""
        h = hashlib.blake2b(digest_size=HASH_NBYTES, person=b"kvpool-ns")
        h.update(_field(b"v", struct.pack("<I", HASH_VERSION)))
        h.update(_field(b"m", self.model_id.encode()))
        h.update(_field(b"w", self.weights_version.encode()))
        h.update(_field(b"l", self.layout.fingerprint().encode()))
        h.update(_field(b"s", self.cache_salt.encode()))
        h.update(_field(b"a", self.adapter_digest.encode()))
        for key, value in sorted(self.extra):
            h.update(_field(b"e", _field(b"k", key.encode()) + _field(b"v", value.encode())))
        return NamespaceId(h.digest())


@dataclass(frozen=True, slots=True)
class EngineNamespace:
    """What a vLLM engine's namespaces are built from besides a request's cache salt and adapter
    (`kvpool.vllm.identity`): a router rebuilds the request's namespace with `namespace(cache_salt)`, so
    its keys are the engine's by construction (field cases B30/B31: one key function)."""

    model_id: str
    weights_version: str
    layout_fingerprint: str
    engine: str  # vllm-<version>-<device>-<kernel>

    def namespace(self, cache_salt: str = "", adapter_digest: str = "") -> Namespace:
        """The namespace of a request with `cache_salt` and adapter (`""`: the base model); the engine's
        connector builds its namespaces with this same function. `ValueError` on a bad layout."""
        return Namespace(
            model_id=self.model_id,
            weights_version=self.weights_version,
            layout=KVLayout.from_fingerprint(self.layout_fingerprint),
            cache_salt=cache_salt,
            adapter_digest=adapter_digest,
            extra=(("engine", self.engine),),
        )


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Validate token ids and return them as a uint32 little-endian array.

    Raises `ValueError` for an empty input, a non-integer, a negative id or an id > 2**32 - 1.
    """
    if len(tokens) == 0:
        raise ValueError("tokens must not be empty")
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError) as exc:
        raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]: {exc}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        if arr.dtype == object:
            raise ValueError(f"token ids must be integers in [0, {MAX_TOKEN_ID}]")
        raise ValueError(f"tokens must be a 1-D sequence of integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"negative token id {int(arr.min())}")
    if int(arr.max()) > MAX_TOKEN_ID:
        raise ValueError(f"token id {int(arr.max())} exceeds {MAX_TOKEN_ID}")
    return arr.astype("<u4", copy=False)


def _block_extras(block_idx: int, block_size: int, media: Sequence[MediaSpan]) -> bytes:
    lo, hi = block_idx * block_size, (block_idx + 1) * block_size
    out = b""
    for span in media:
        s_lo, s_hi = span.start, span.start + span.length
        if s_lo < hi and lo < s_hi:
            overlap_start = max(lo, s_lo)
            out += _field(b"d", span.digest) + _field(b"o", struct.pack("<Q", overlap_start - s_lo))
            out += _field(b"q", struct.pack("<Q", overlap_start - lo))
    return out


def hash_blocks(
    namespace: NamespaceId | bytes,
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    media: Sequence[MediaSpan] = (),
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `tokens` (the partial tail gets none).

    Args:
        namespace: 16-byte namespace digest (`Namespace.digest()`).
        tokens: 1-D token ids, each in [0, 2**32 - 1]; non-empty.
        block_size: tokens per block (> 0).
        media: multimodal spans; each block overlapping one folds in (digest, offset).
    Returns:
        `len(tokens) // block_size` block hashes of 16 bytes each.
    Raises:
        ValueError: empty tokens, bad token id, block_size <= 0, namespace not 16 bytes.
    """
    if not isinstance(namespace, bytes) or len(namespace) != HASH_NBYTES:
        raise ValueError(f"namespace digest must be {HASH_NBYTES} bytes")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    arr = encode_tokens(tokens)
    raw = arr.tobytes()
    num_full = len(arr) // block_size
    stride = block_size * 4
    version = _field(b"v", struct.pack("<I", HASH_VERSION))
    parent = bytes(namespace)
    out: list[BlockHash] = []
    for i in range(num_full):
        h = hashlib.blake2b(digest_size=HASH_NBYTES, person=b"kvpool-blk")
        h.update(version)
        h.update(_field(b"p", parent))
        h.update(_field(b"t", raw[i * stride : (i + 1) * stride]))
        if media:
            extras = _block_extras(i, block_size, media)
            if extras:
                h.update(_field(b"x", extras))
        parent = h.digest()
        out.append(BlockHash(parent))
    return out


def parse_hash(value: bytes | str, what: str = "block hash") -> bytes:
    """Accept 16 raw bytes or 32 hex characters; raise `ValueError` naming `what` otherwise."""
    if isinstance(value, str):
        try:
            value = bytes.fromhex(value)
        except ValueError:
            value = b""
        if len(value) != HASH_NBYTES:  # one message for text, whatever is wrong with it
            raise ValueError(f"{what} must be {HASH_NBYTES * 2} hex characters")
    if not isinstance(value, bytes) or len(value) != HASH_NBYTES:
        raise ValueError(f"{what} must be {HASH_NBYTES} bytes")
    return value
