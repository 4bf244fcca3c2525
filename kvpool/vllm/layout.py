"""Copy KV between vLLM's paged per-layer blocks and pool blocks, with torch ops (no per-element loops).

A pool block is `[num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]` in the model's dtype (docs/design.md
"Keys and hashing", block layout). vLLM keeps one tensor per attention layer, laid out by its attention backend:

- `cpu_vec` (vLLM's CPU backend, "vec" kernel ISA): `[num_blocks, ...]`, one block of one layer holding,
  per KV head, K *transposed* `[head_dim, block_size]` followed by V `[block_size, head_dim]` (measured:
  the kernel views the cache as `[B, H, 2*bs, hd]`; K matches HF's post-RoPE keys to 7e-6 in fp32).
- `nhd` (FlashAttention-style GPU backends): `[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`.

Blocks move per layer: out, one `index_select` and one strided copy; in, one indexed strided write per K
and V straight into the engine's blocks; so the cost is a few torch calls per layer per batch of blocks. Device tensors are staged through host
memory: the pool side is always a CPU buffer. Any other backend or shape is refused at start
(`UnsupportedLayout`), never guessed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.errors import FailedPrecondition
from kvpool.types import KVLayout

CPU_VEC = "cpu_vec"
NHD = "nhd"
KINDS = (CPU_VEC, NHD)


class UnsupportedLayout(FailedPrecondition):
    """vLLM's KV cache tensors are in a layout this connector does not convert."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PagedLayout:
    """How one engine's per-layer KV tensors are laid out: `kind` (one of `KINDS`) and the pool's `layout`."""

    kind: str
    layout: KVLayout

    def check(self, kv_caches: Sequence[torch.Tensor]) -> int:
        """Validate the engine's per-layer tensors against this layout; returns the number of blocks.

        Raises `UnsupportedLayout` naming the first mismatch (layer count, dtype, shape, strides)."""
        lay = self.layout
        if len(kv_caches) != lay.num_layers:
            raise UnsupportedLayout(
                f"vLLM registered {len(kv_caches)} KV layers, the pool's layout has {lay.num_layers}"
            )
        want_dtype = getattr(torch, lay.dtype)
        num_blocks = -1
        for i, kv in enumerate(kv_caches):
            if kv.dtype != want_dtype:
                raise UnsupportedLayout(f"layer {i}: KV dtype {kv.dtype}, pool layout {lay.fingerprint()}")
            if self.kind == CPU_VEC:
                ok = kv.dim() >= 2 and kv.is_contiguous() and kv[0].numel() == self._per_block
                n = int(kv.shape[0]) if kv.dim() else 0
            elif self.kind == NHD:
                want = (2, -1, lay.block_size, lay.num_kv_heads, lay.head_dim)
                ok = kv.dim() == 5 and all(w in (-1, s) for w, s in zip(want, kv.shape, strict=True))
                n = int(kv.shape[1]) if kv.dim() == 5 else 0
            else:
                raise UnsupportedLayout(f"unknown paged layout kind {self.kind!r}; expected one of {KINDS}")
            if not ok:
                raise UnsupportedLayout(
                    f"layer {i}: KV tensor {tuple(kv.shape)} stride {kv.stride()} is not a {self.kind} "
                    f"cache of {lay.fingerprint()}"
                )
            if num_blocks not in (-1, n):
                raise UnsupportedLayout(f"layer {i} has {n} blocks, layer 0 has {num_blocks}")
            num_blocks = n
        return num_blocks

    @property
    def _per_block(self) -> int:
        lay = self.layout
        return lay.num_kv_heads * 2 * lay.block_size * lay.head_dim

    def gather(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
        """Copy vLLM blocks `block_ids` out as pool blocks.

        Returns a C-contiguous CPU tensor `[len(block_ids), num_layers, 2, H, bs, hd]` in the layout's dtype
        (its rows are the pool blocks' bytes). The engine's tensors are only read."""
        lay = self.layout
        n = len(block_ids)
        out = torch.empty((n, *lay.shape), dtype=getattr(torch, lay.dtype), device="cpu")
        if n == 0:
            return out
        H, bs, hd = lay.num_kv_heads, lay.block_size, lay.head_dim
        for li, kv in enumerate(kv_caches):
            ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv.device)
            if self.kind == CPU_VEC:
                per_head = kv.view(kv.shape[0], H, 2, bs * hd)
                out[:, li, 0].copy_(per_head[:, :, 0].unflatten(-1, (hd, bs))[ids].transpose(-1, -2))
                out[:, li, 1].copy_(per_head[:, :, 1].unflatten(-1, (bs, hd))[ids])
            else:
                for j in (0, 1):
                    out[:, li, j].copy_(kv[j].index_select(0, ids).to("cpu").permute(0, 2, 1, 3))
        return out

    def scatter(
        self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int], blocks: torch.Tensor
    ) -> None:
        """Write pool blocks into vLLM blocks `block_ids`, in place.

        `blocks`: a CPU tensor viewable as `[len(block_ids), num_layers, 2, H, bs, hd]` in the layout's dtype
        (e.g. `torch.from_numpy(run_buffer).view(dtype)`). Raises `ValueError` on a size mismatch."""
        lay = self.layout
        n = len(block_ids)
        if n == 0:
            return
        if blocks.numel() != n * lay.block_nbytes // lay.dtype_nbytes:
            raise ValueError(f"{blocks.numel()} elements for {n} blocks of {lay.fingerprint()}")
        src = blocks.reshape(n, *lay.shape)
        H, bs, hd = lay.num_kv_heads, lay.block_size, lay.head_dim
        for li, kv in enumerate(kv_caches):
            ids = torch.as_tensor(block_ids, dtype=torch.long, device=kv.device)
            if self.kind == CPU_VEC:  # one strided pass per K and V, straight into the engine's blocks
                per_head = kv.view(kv.shape[0], H, 2, bs * hd)
                per_head[:, :, 0].unflatten(-1, (hd, bs))[ids] = src[:, li, 0].transpose(-1, -2)
                per_head[:, :, 1].unflatten(-1, (bs, hd))[ids] = src[:, li, 1]
            else:
                for j in (0, 1):
                    kv[j].index_copy_(
                        0, ids, src[:, li, j].permute(0, 2, 1, 3).to(kv.device, non_blocking=True)
                    )
        if kv_caches and kv_caches[0].device.type == "cuda":
            torch.cuda.current_stream(kv_caches[0].device).synchronize()  # the staging buffer is freed next
