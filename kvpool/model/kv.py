"""KV prefixes and the exchange between a model cache and pool blocks.

A pool block holds the KV of `block_size` consecutive tokens over all layers, one contiguous buffer of
`layout.block_nbytes` bytes laid out as `[num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]` in
`layout.dtype` (native byte order, little-endian on every supported host). Keys are stored after RoPE,
exactly as the model's cache holds them, so a scattered prefix continues at position `num_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvpool.errors import InvalidArgument
from kvpool.types import KVLayout

BlockBytes = bytes | bytearray | memoryview | np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class KVPrefix:
    """The KV cache of the first `num_tokens` tokens of one sequence. Immutable: never written in place.

    `layers[i] = (keys, values)`, each `[1, num_kv_heads, num_tokens, head_dim]` on the model's device in
    the model's dtype; `layers == ()` when `num_tokens == 0`.
    """

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    num_tokens: int

    @classmethod
    def empty(cls) -> KVPrefix:
        return cls((), 0)

    @classmethod
    def from_cache(cls, cache: Any) -> KVPrefix:
        """Snapshot a transformers `DynamicCache` (shares its tensors; the cache must not be reused)."""
        layers = tuple((layer.keys, layer.values) for layer in cache.layers)
        n = int(layers[0][0].shape[2]) if layers else 0
        return cls(layers, n)

    def to_cache(self, config: Any) -> Any:
        """A fresh `DynamicCache` over this prefix's tensors (no copy), for a forward to extend; the forward
        concatenates into new tensors, so this prefix is never written."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=config)
        if len(cache.layers) == len(self.layers) and all(
            type(layer) is DynamicLayer for layer in cache.layers
        ):
            # Hand our tensors to the cache without the copy `update` makes (a cat onto an empty
            # tensor): the forward's own `update` concatenates into a new tensor, never writing ours.
            for layer, (k, v) in zip(cache.layers, self.layers, strict=True):
                assert isinstance(layer, DynamicLayer)  # narrowed for mypy; checked above
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            return cache
        for i, (k, v) in enumerate(self.layers):
            cache.update(k, v, i)
        return cache

    def truncated(self, num_tokens: int) -> KVPrefix:
        """The prefix of the first `num_tokens` tokens (views; no copy). Raises `InvalidArgument`."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise InvalidArgument(f"cannot truncate a {self.num_tokens}-token prefix to {num_tokens}")
        if num_tokens == self.num_tokens:
            return self
        if num_tokens == 0:
            return KVPrefix.empty()
        return KVPrefix(
            tuple((k[:, :, :num_tokens], v[:, :, :num_tokens]) for k, v in self.layers), num_tokens
        )

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


def _torch_dtype(layout: KVLayout) -> torch.dtype:
    dtype = getattr(torch, layout.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgument(f"torch has no dtype {layout.dtype!r}")
    return dtype


def gather_blocks(prefix: KVPrefix, layout: KVLayout, start_block: int, end_block: int) -> list[np.ndarray]:
    """Copy blocks `[start_block, end_block)` of `prefix` out in the pool layout.

    Returns `end_block - start_block` C-contiguous CPU `uint8` arrays of `layout.block_nbytes` each (views
    of one buffer). Only full blocks: raises `InvalidArgument` if `end_block * block_size > num_tokens`,
    the range is reversed/negative, or the prefix's shape disagrees with `layout`.
    """
    bs = layout.block_size
    if not 0 <= start_block <= end_block or end_block * bs > prefix.num_tokens:
        raise InvalidArgument(
            f"blocks [{start_block}, {end_block}) are not full blocks of a {prefix.num_tokens}-token prefix "
            f"(block_size {bs})"
        )
    nb = end_block - start_block
    if nb == 0:
        return []
    _check_shape(prefix, layout)
    lo, hi = start_block * bs, end_block * bs
    per_layer = []
    for k, v in prefix.layers:
        kv = torch.stack((k[0, :, lo:hi], v[0, :, lo:hi]))  # [2, H, nb*bs, D]
        kv = kv.reshape(2, layout.num_kv_heads, nb, bs, layout.head_dim).permute(2, 0, 1, 3, 4)
        per_layer.append(kv)  # [nb, 2, H, bs, D]
    out = torch.stack(per_layer, dim=1).to("cpu").contiguous()  # [nb, L, 2, H, bs, D]
    raw = out.reshape(nb, -1).view(torch.uint8).numpy()  # [nb, block_nbytes]
    return [raw[i] for i in range(nb)]


def _check_shape(prefix: KVPrefix, layout: KVLayout) -> None:
    if len(prefix.layers) != layout.num_layers:
        raise InvalidArgument(f"prefix has {len(prefix.layers)} layers, layout {layout.num_layers}")
    k = prefix.layers[0][0]
    want = (1, layout.num_kv_heads, prefix.num_tokens, layout.head_dim)
    if tuple(k.shape) != want or k.dtype != _torch_dtype(layout):
        raise InvalidArgument(
            f"prefix keys {tuple(k.shape)} {k.dtype} do not match layout {layout.fingerprint()}"
        )


def _as_uint8(block: BlockBytes) -> np.ndarray:
    if isinstance(block, np.ndarray):
        return np.ascontiguousarray(block).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(block).cast("B"), dtype=np.uint8)


def _consecutive(arrays: Sequence[np.ndarray], nb_bytes: int) -> np.ndarray | None:
    """One flat view over `arrays` when they are back-to-back rows of one buffer (as a pull delivers
    them), so scattering skips a copy; None otherwise."""
    first = arrays[0]
    base = first.base
    if not isinstance(base, np.ndarray) or not base.flags.c_contiguous or base.dtype != np.uint8:
        return None
    start = first.ctypes.data - base.ctypes.data
    if start < 0 or start + len(arrays) * nb_bytes > base.nbytes:
        return None
    addr = first.ctypes.data
    for i, arr in enumerate(arrays):
        if arr.base is not base or arr.ctypes.data != addr + i * nb_bytes:
            return None
    return base.reshape(-1)[start : start + len(arrays) * nb_bytes]


def scatter_blocks(
    blocks: Sequence[BlockBytes], layout: KVLayout, device: str | torch.device, base: KVPrefix | None = None
) -> KVPrefix:
    """Build a prefix from pool blocks, appended after `base` (default: empty).

    Each block must be exactly `layout.block_nbytes` bytes in the pool layout (bytes, bytearray,
    memoryview or a numpy array of any dtype/shape with that many bytes); raises `InvalidArgument`
    naming the first block of the wrong length (field case B23: every read checks the byte length).
    The result has `base.num_tokens + len(blocks) * block_size` tokens on `device`.
    """
    base = base or KVPrefix.empty()
    if not blocks:
        return base
    nb_bytes = layout.block_nbytes
    arrays = [_as_uint8(block) for block in blocks]
    for i, arr in enumerate(arrays):
        if arr.size != nb_bytes:
            raise InvalidArgument(
                f"block {i} has {arr.size} bytes, layout {layout.fingerprint()} needs {nb_bytes}"
            )
    buf = _consecutive(arrays, nb_bytes)
    if buf is None:
        buf = np.empty(len(arrays) * nb_bytes, dtype=np.uint8)
        for i, arr in enumerate(arrays):
            buf[i * nb_bytes : (i + 1) * nb_bytes] = arr
    nb, bs = len(blocks), layout.block_size
    t = torch.from_numpy(buf).view(_torch_dtype(layout)).reshape(len(blocks), *layout.shape)
    t = t.to(device)  # [nb, L, 2, H, bs, D]
    layers = []
    for li in range(layout.num_layers):
        kv = t[:, li].permute(1, 2, 0, 3, 4).reshape(2, 1, layout.num_kv_heads, nb * bs, layout.head_dim)
        k, v = kv[0], kv[1]
        if base.num_tokens:
            bk, bv = base.layers[li]
            k, v = torch.cat((bk, k), dim=2), torch.cat((bv, v), dim=2)
        layers.append((k, v))
    return KVPrefix(tuple(layers), base.num_tokens + nb * bs)
