"""`kvpool.vllm.layout.PagedLayout`: vLLM's paged per-layer KV tensors <-> pool blocks, without vLLM.

The engine-side tensors are built here from known K and V, independently of the code under test:
- `cpu_vec` (vLLM's CPU backend, "vec" kernel): a layer is `[num_blocks, H, bs, 2*hd]`, contiguous; per
  block and KV head, K transposed `[hd, bs]` is followed by V `[bs, hd]`;
- `nhd`: a layer is `[2 (K, V), num_blocks, bs, H, hd]`.
A pool block is `[L, 2, H, bs, hd]`; `gather` returns `[n, L, 2, H, bs, hd]`. Every comparison is bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import FailedPrecondition
from kvpool.types import KVLayout
from kvpool.vllm.layout import CPU_VEC, KINDS, NHD, PagedLayout, UnsupportedLayout

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits (so -0.0 != 0.0 and NaN payloads count)."""
    return t.contiguous().view(_INT[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def layout(dtype: str = "float32", *, bs: int = 4, L: int = 2, H: int = 3, hd: int = 5) -> KVLayout:
    return KVLayout(dtype=dtype, block_size=bs, num_layers=L, num_kv_heads=H, head_dim=hd)


def random_kv(lay: KVLayout, num_blocks: int, seed: int, *, raw_bits: bool = False) -> torch.Tensor:
    """Known K/V of every engine block: `[num_blocks, L, 2, H, bs, hd]` (the pool layout per block).
    `raw_bits`: arbitrary bit patterns (NaNs, infinities, subnormals, -0.0 included)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, *lay.shape)
    dtype = getattr(torch, lay.dtype)
    if raw_bits:
        it = _INT[torch.empty((), dtype=dtype).element_size()]
        info = torch.iinfo(it)
        return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(it).view(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def to_cpu_vec(kv: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer `[num_blocks, H, bs, 2*hd]` tensors in the vec kernel's order (built with explicit indexing)."""
    nb, L, _, H, bs, hd = kv.shape
    layers = []
    for li in range(L):
        flat = torch.empty((nb, H, 2 * bs * hd), dtype=kv.dtype)
        for h in range(H):
            k = kv[:, li, 0, h]  # [nb, bs, hd]
            v = kv[:, li, 1, h]
            for d in range(hd):  # K transposed: element (d, t) at d * bs + t
                flat[:, h, d * bs : (d + 1) * bs] = k[:, :, d]
            for t in range(bs):  # V: element (t, d) at bs*hd + t * hd + d
                flat[:, h, bs * hd + t * hd : bs * hd + (t + 1) * hd] = v[:, t, :]
        layers.append(flat.view(nb, H, bs, 2 * hd))
    return layers


def to_nhd(kv: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer `[2, num_blocks, bs, H, hd]` contiguous tensors."""
    L = kv.shape[1]
    return [kv[:, li].permute(1, 0, 3, 2, 4).contiguous() for li in range(L)]


TO_ENGINE = {CPU_VEC: to_cpu_vec, NHD: to_nhd}


def test_cpu_vec_builder_matches_the_documented_element_order() -> None:
    """The helper's own convention, pinned element by element on a tiny cache."""
    lay = layout(bs=3, L=1, H=2, hd=2)
    kv = random_kv(lay, 2, seed=1)
    (cache,) = to_cpu_vec(kv)
    assert cache.shape == (2, 2, 3, 4) and cache.is_contiguous()
    flat = cache.reshape(2, -1)
    bs, hd = 3, 2
    for b in range(2):
        for h in range(2):
            base = h * 2 * bs * hd
            for t in range(bs):
                for d in range(hd):
                    assert flat[b, base + d * bs + t] == kv[b, 0, 0, h, t, d]
                    assert flat[b, base + bs * hd + t * hd + d] == kv[b, 0, 1, h, t, d]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_returns_pool_blocks(kind: str, dtype: str) -> None:
    lay = layout(dtype)
    kv = random_kv(lay, 7, seed=2)
    caches = TO_ENGINE[kind](kv)
    before = [c.clone() for c in caches]
    paged = PagedLayout(kind=kind, layout=lay)
    assert paged.check(caches) == 7

    ids = [5, 0, 3, 3]  # any order, repeats allowed
    out = paged.gather(caches, ids)
    assert out.shape == (4, *lay.shape) and out.dtype == getattr(torch, dtype)
    assert out.is_contiguous() and out.device.type == "cpu"
    assert same_bits(out, kv[ids])
    assert all(same_bits(a, b) for a, b in zip(caches, before, strict=True))  # only read
    # one pool block's bytes are one row: what the worker publishes
    raw = out.view(torch.uint8).reshape(4, -1)
    assert raw.shape[1] == lay.block_nbytes
    assert torch.equal(raw[0], kv[5].contiguous().view(torch.uint8).reshape(-1))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scatter_writes_only_the_chosen_blocks(kind: str, dtype: str) -> None:
    lay = layout(dtype)
    old = random_kv(lay, 8, seed=3)
    new = random_kv(lay, 3, seed=4)
    caches = TO_ENGINE[kind](old)
    paged = PagedLayout(kind=kind, layout=lay)
    ids = [6, 1, 4]

    paged.scatter(caches, ids, new)

    want = old.clone()
    want[ids] = new
    expected = TO_ENGINE[kind](want)
    assert all(same_bits(a, b) for a, b in zip(caches, expected, strict=True))
    assert same_bits(paged.gather(caches, list(range(8))), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_through_pool_bytes(kind: str, dtype: str) -> None:
    """gather from engine A, as raw bytes (what the pool stores), scatter into other block ids of engine B,
    gather again: bit-exact, as the worker does it (`torch.from_numpy(uint8 run).view(dtype)`)."""
    lay = layout(dtype, bs=8, L=3, H=2, hd=4)
    paged = PagedLayout(kind=kind, layout=lay)
    a = TO_ENGINE[kind](random_kv(lay, 6, seed=5, raw_bits=True))
    b_before = random_kv(lay, 9, seed=6)
    b = TO_ENGINE[kind](b_before)

    src_ids, dst_ids = [2, 0, 5], [8, 3, 4]
    blocks = paged.gather(a, src_ids)
    run = blocks.view(torch.uint8).reshape(-1).numpy().copy()  # the pool's bytes, a flat uint8 run
    paged.scatter(b, dst_ids, torch.from_numpy(run).view(getattr(torch, dtype)))

    assert same_bits(paged.gather(b, dst_ids), blocks)
    untouched = [i for i in range(9) if i not in dst_ids]
    assert same_bits(paged.gather(b, untouched), b_before[untouched])


@pytest.mark.parametrize("kind", KINDS)
def test_scatter_then_gather_is_identity(kind: str) -> None:
    lay = layout("float32")
    paged = PagedLayout(kind=kind, layout=lay)
    caches = TO_ENGINE[kind](torch.zeros((4, *lay.shape)))
    blocks = random_kv(lay, 2, seed=7, raw_bits=True)
    paged.scatter(caches, [3, 1], blocks)
    assert same_bits(paged.gather(caches, [3, 1]), blocks)


@pytest.mark.parametrize("kind", KINDS)
def test_no_blocks(kind: str) -> None:
    lay = layout()
    paged = PagedLayout(kind=kind, layout=lay)
    kv = random_kv(lay, 3, seed=8)
    caches = TO_ENGINE[kind](kv)
    out = paged.gather(caches, [])
    assert out.shape == (0, *lay.shape)
    paged.scatter(caches, [], torch.empty((0, *lay.shape)))
    assert same_bits(paged.gather(caches, [0, 1, 2]), kv)


def test_scatter_size_mismatch_raises_value_error() -> None:
    lay = layout()
    paged = PagedLayout(kind=CPU_VEC, layout=lay)
    caches = to_cpu_vec(random_kv(lay, 3, seed=9))
    with pytest.raises(ValueError):
        paged.scatter(caches, [0, 1], random_kv(lay, 1, seed=10))


# ---- check() -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_check_accepts_the_layout_and_counts_blocks(kind: str) -> None:
    lay = layout("bfloat16")
    assert PagedLayout(kind=kind, layout=lay).check(TO_ENGINE[kind](random_kv(lay, 11, seed=0))) == 11


def _refused(kind: str, lay: KVLayout, caches: list[torch.Tensor], match: str) -> None:
    with pytest.raises(UnsupportedLayout, match=match) as info:
        PagedLayout(kind=kind, layout=lay).check(caches)
    assert isinstance(info.value, FailedPrecondition)


@pytest.mark.parametrize("kind", KINDS)
def test_check_refuses_a_wrong_dtype(kind: str) -> None:
    lay = layout("float32")
    caches = TO_ENGINE[kind](random_kv(layout("bfloat16"), 4, seed=0))
    _refused(kind, lay, caches, "layer 0: KV dtype torch.bfloat16")


@pytest.mark.parametrize("kind", KINDS)
def test_check_refuses_a_wrong_layer_count(kind: str) -> None:
    lay = layout(L=3)
    caches = TO_ENGINE[kind](random_kv(layout(L=2), 4, seed=0))
    _refused(kind, lay, caches, "registered 2 KV layers, the pool's layout has 3")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "other",
    [dict(bs=8), dict(H=2), dict(hd=4)],
    ids=["block_size", "kv_heads", "head_dim"],
)
def test_check_refuses_a_wrong_shape(kind: str, other: dict[str, int]) -> None:
    lay = layout()
    caches = TO_ENGINE[kind](random_kv(layout("float32", **other), 4, seed=0))
    _refused(kind, lay, caches, f"layer 0: KV tensor .* is not a {kind} cache of {lay.fingerprint()}")


def test_check_refuses_a_cpu_vec_cache_that_is_not_contiguous() -> None:
    lay = layout()
    wide = to_cpu_vec(random_kv(lay, 8, seed=0))
    _refused(CPU_VEC, lay, [c[::2] for c in wide], "is not a cpu_vec cache")


def test_check_refuses_an_nhd_cache_of_the_wrong_rank() -> None:
    lay = layout()
    caches = [c[0] for c in to_nhd(random_kv(lay, 4, seed=0))]  # K only: [nb, bs, H, hd]
    _refused(NHD, lay, caches, "is not a nhd cache")


@pytest.mark.parametrize("kind", KINDS)
def test_check_refuses_layers_with_different_block_counts(kind: str) -> None:
    lay = layout()
    caches = TO_ENGINE[kind](random_kv(lay, 4, seed=0))
    caches[1] = TO_ENGINE[kind](random_kv(lay, 5, seed=0))[1]
    _refused(kind, lay, caches, "layer 1 has 5 blocks, layer 0 has 4")


def test_check_refuses_an_unknown_kind() -> None:
    lay = layout()
    _refused("hnd", lay, to_nhd(random_kv(lay, 2, seed=0)), "unknown paged layout kind 'hnd'")


# ---- property ------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    bs=st.integers(1, 8),
    L=st.integers(1, 3),
    H=st.integers(1, 3),
    hd=st.integers(1, 6),
    num_blocks=st.integers(1, 6),
    data=st.data(),
)
def test_gather_scatter_property(
    kind: str, dtype: str, bs: int, L: int, H: int, hd: int, num_blocks: int, data: st.DataObject
) -> None:
    lay = layout(dtype, bs=bs, L=L, H=H, hd=hd)
    paged = PagedLayout(kind=kind, layout=lay)
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    kv = random_kv(lay, num_blocks, seed, raw_bits=True)
    caches = TO_ENGINE[kind](kv)
    assert paged.check(caches) == num_blocks

    ids = data.draw(st.permutations(range(num_blocks)), label="order")
    ids = ids[: data.draw(st.integers(0, num_blocks), label="n")]
    assert same_bits(paged.gather(caches, ids), kv[ids])

    new = random_kv(lay, len(ids), seed + 1, raw_bits=True)
    paged.scatter(caches, ids, np_view(new, dtype))
    want = kv.clone()
    want[ids] = new
    assert all(same_bits(a, b) for a, b in zip(caches, TO_ENGINE[kind](want), strict=True))


def np_view(blocks: torch.Tensor, dtype: str) -> torch.Tensor:
    """`blocks` as the worker hands them to scatter: a flat uint8 numpy run viewed as the layout's dtype."""
    if blocks.numel() == 0:  # an empty uint8 array cannot be viewed as a wider dtype
        return blocks
    run = np.ascontiguousarray(blocks.contiguous().view(torch.uint8).reshape(-1).numpy())
    return torch.from_numpy(run).view(getattr(torch, dtype))
