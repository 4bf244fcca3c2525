"""Attention of a suffix over a cached prefix with two unmasked kernel calls merged by log-sum-exp.

On top of a cached prefix of P tokens, the S new queries of a prefill attend to all P prefix keys and
causally to the S suffix keys. transformers hands SDPA a `[S, P+S]` mask for that, and on CPU a masked
SDPA call runs its slow kernel over the whole rectangle: 3,229 tokens on an 832-token prefix took 1.41 s
against 0.97 s for all 4,061 from scratch, so a partial cache hit cost more than a miss. Split at P:
attention to the prefix needs no mask, attention within the suffix is plainly causal; both run the
flash kernel, which also returns each query row's log-sum-exp `l`, and the two partial results merge
exactly (softmax over the union of the key sets):

    o = (e^(l1 - m) o1 + e^(l2 - m) o2) / (e^(l1 - m) + e^(l2 - m)),   m = max(l1, l2)

Source: the partial-softmax merge of FlashAttention's online softmax (Dao et al., NeurIPS 2022), as used
for shared-prefix ("cascade") attention (FlashInfer `merge_state`, vLLM `merge_attn_states`).

The split applies only inside `prefix_prefill()` (the runner's prefill: one sequence, no padding, and
the runner refuses sliding-window and other non-full-attention models at load, so the mask transformers
built is exactly "prefix visible, suffix causal") and on CPU; every other call (decode
batches with padding masks, other devices, dropout) goes to transformers' SDPA path unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

ATTN_IMPLEMENTATION = "kvpool_sdpa"
"""The name registered with transformers' `AttentionInterface` (SDPA plus the prefix split above)."""
_PREFIX_PREFILL: contextvars.ContextVar[bool] = contextvars.ContextVar("kvpool_prefix_prefill", default=False)


@contextlib.contextmanager
def prefix_prefill() -> Iterator[None]:
    """Mark the forward calls inside as one unpadded sequence (queries = the last S of the keys)."""
    token = _PREFIX_PREFILL.set(True)
    try:
        yield
    finally:
        _PREFIX_PREFILL.reset(token)


def _flash_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention: (`[B, H, S, D]` output, `[B, H, S]` fp32 log-sum-exp of each row's scores)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, causal, scale=scale
    )
    return out, lse


def merged_prefix_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, num_groups: int, scale: float | None
) -> torch.Tensor:
    """Attention of `query` `[B, Hq, S, D]` over `key`/`value` `[B, Hkv, P+S, D]` (Hq = Hkv * num_groups,
    query head h uses key head h // num_groups, as transformers' `repeat_kv`): every prefix key visible,
    suffix keys causal. Returns `[B, Hq, S, D]` in the query's dtype. Requires P >= 1 and S >= 1."""
    b, hq, s, d = query.shape
    hkv, p = key.shape[1], key.shape[2] - s
    # Prefix part, unmasked: the num_groups query heads sharing a key head become extra query rows, so
    # the prefix keys are not copied per query head.
    packed = query.reshape(b, hkv, num_groups * s, d)
    o1, l1 = _flash_with_lse(packed, key[:, :, :p], value[:, :, :p], causal=False, scale=scale)
    o1, l1 = o1.reshape(b, hq, s, d), l1.reshape(b, hq, s)
    k2, v2 = key[:, :, p:], value[:, :, p:]
    if num_groups > 1:  # the suffix is short next to the prefix: expanding its heads is cheap
        k2 = k2.repeat_interleave(num_groups, dim=1)
        v2 = v2.repeat_interleave(num_groups, dim=1)
    o2, l2 = _flash_with_lse(query, k2, v2, causal=True, scale=scale)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m).unsqueeze(-1), torch.exp(l2 - m).unsqueeze(-1)
    out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
    return out.to(query.dtype)


def kvpool_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; returns (`[B, S, Hq, D]`, None) like its SDPA path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    s, kv_len = query.shape[2], key.shape[2]
    if (
        _PREFIX_PREFILL.get()
        and 1 < s < kv_len
        and query.device.type == "cpu"
        and not dropout
        and query.shape[0] == 1
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
    ):
        groups = query.shape[1] // key.shape[1]
        out = merged_prefix_attention(query, key, value, num_groups=groups, scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def register() -> str:
    """Register `kvpool_sdpa` (attention and its mask format: SDPA's) with transformers; returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, kvpool_sdpa_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION
