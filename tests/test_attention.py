"""Prefix attention split in two unmasked calls (kvpool/model/attention.py) equals masked SDPA."""

from __future__ import annotations

import pytest
import torch

from kvpool.model.attention import merged_prefix_attention


def _masked_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    s, kv_len = q.shape[2], k.shape[2]
    p = kv_len - s
    mask = torch.ones(s, kv_len, dtype=torch.bool)
    mask[:, p:] = torch.tril(torch.ones(s, s, dtype=torch.bool))
    k, v = k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float()
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)


@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "prefix_len", "suffix_len"),
    [(8, 4, 100, 37), (8, 8, 5, 3), (4, 1, 64, 64), (8, 4, 1, 2), (2, 2, 300, 2)],
)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_merged_attention_equals_the_masked_kernel(
    q_heads: int, kv_heads: int, prefix_len: int, suffix_len: int, dtype: torch.dtype, tol: float
) -> None:
    gen = torch.Generator().manual_seed(q_heads * 1000 + prefix_len)
    q = torch.randn(1, q_heads, suffix_len, 32, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, prefix_len + suffix_len, 32, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, prefix_len + suffix_len, 32, generator=gen).to(dtype)
    out = merged_prefix_attention(q, k, v, num_groups=q_heads // kv_heads, scale=None)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _masked_reference(q, k, v, q_heads // kv_heads)
    assert float((out.float() - ref).abs().max()) < tol


def test_scale_is_applied_to_both_parts() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (5, 12, 12))
    out = merged_prefix_attention(q, k, v, num_groups=1, scale=0.05)
    ref = _masked_reference(q * (0.05 * 16**0.5), k, v, 1)  # SDPA's default scale is 1/sqrt(16)
    assert float((out - ref).abs().max()) < 1e-5
