"""Block hashing: determinism, chaining, isolation (field cases B01, B04, B05, B07, B08, B09, B23)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.hashing import MediaSpan, Namespace, check_adapter_digest, hash_blocks
from kvpool.types import KVLayout

LAYOUT = KVLayout(dtype="float32", block_size=4, num_layers=4, num_kv_heads=2, head_dim=64)
P = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]


def ns(**kw: str) -> bytes:
    args: dict = {"model_id": "m", "weights_version": "w1", "layout": LAYOUT} | kw
    return Namespace(**args).digest()


# Pinned golden vector: a change to the scheme must bump HASH_VERSION and this constant together.
GOLDEN_NS = "9531314a6ffaa93dc4cafa3830daac70"
GOLDEN_H0 = "5f34310eadbea298d939df5e268f8030"

_SNIPPET = (
    "from kvpool.hashing import Namespace, hash_blocks\n"
    "from kvpool.types import KVLayout\n"
    "L = KVLayout(dtype='float32', block_size=4, num_layers=4, num_kv_heads=2, head_dim=64)\n"
    "n = Namespace(model_id='m', weights_version='w1', layout=L, extra=EXTRA).digest()\n"
    "print(n.hex(), *[h.hex() for h in hash_blocks(n, [11,12,13,14,21,22,23,24,31,32], 4)])\n"
)


def _hashes_in_subprocess(seed: str, extra: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET.replace("EXTRA", extra)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def test_deterministic_across_processes_and_pinned() -> None:
    a = _hashes_in_subprocess("1", "()")
    b = _hashes_in_subprocess("12345", "()")
    assert a == b
    assert a[0] == GOLDEN_NS and a[1] == GOLDEN_H0
    assert len(a) == 3  # namespace + 2 full blocks


def test_none_in_extra_is_refused_not_hashed() -> None:
    with pytest.raises(ValueError):
        Namespace(model_id="m", weights_version="w", layout=LAYOUT, extra=(("k", None),))  # type: ignore[arg-type]


def test_ten_tokens_block4_gives_two_hashes() -> None:
    hashes = hash_blocks(ns(), P, 4)
    assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    assert hash_blocks(ns(), P[:3], 4) == []


def test_changing_block_i_changes_i_onwards_only() -> None:
    tokens = list(range(1, 17))
    base = hash_blocks(ns(), tokens, 4)
    for i in range(4):
        changed = list(tokens)
        changed[i * 4 + 1] += 1000
        new = hash_blocks(ns(), changed, 4)
        assert new[:i] == base[:i]
        assert all(a != b for a, b in zip(new[i:], base[i:], strict=True))


def test_high_bits_of_token_ids_matter() -> None:
    assert hash_blocks(ns(), [65, 1, 2, 3], 4) != hash_blocks(ns(), [321, 1, 2, 3], 4)
    assert hash_blocks(ns(), [2**32 - 1, 1, 2, 3], 4) != hash_blocks(ns(), [2**31 - 1, 1, 2, 3], 4)


def test_adapters_and_salts_give_disjoint_chains() -> None:
    chains = [
        hash_blocks(ns(adapter_digest="a" * 32), P, 4),
        hash_blocks(ns(adapter_digest="b" * 32), P, 4),
        hash_blocks(ns(), P, 4),
        hash_blocks(ns(cache_salt="tenant-1"), P, 4),
        hash_blocks(ns(cache_salt="tenant-2"), P, 4),
        hash_blocks(ns(weights_version="w2"), P, 4),
    ]
    flat = [h for chain in chains for h in chain]
    assert len(set(flat)) == len(flat)


@pytest.mark.parametrize("bad", ["A", "my-lora", "a" * 31, "a" * 33, "A" * 32, "g" * 32, " " + "a" * 31])
def test_an_adapter_is_named_by_its_content_digest_never_a_name(bad: str) -> None:
    with pytest.raises(ValueError, match="adapter_digest must be the adapter's content digest"):
        ns(adapter_digest=bad)
    assert check_adapter_digest("0123456789abcdef" * 2) == "0123456789abcdef" * 2
    with pytest.raises(ValueError, match="^digest must be"):
        check_adapter_digest("", "digest", allow_empty=False)


def test_layout_is_part_of_the_namespace() -> None:
    fp8 = KVLayout(dtype="float8_e4m3fn", block_size=4, num_layers=4, num_kv_heads=2, head_dim=64)
    assert ns() != Namespace(model_id="m", weights_version="w1", layout=fp8).digest()


@pytest.mark.parametrize("bad", [[], [-1, 2, 3, 4], [2**32, 1, 2, 3], [1.5, 2, 3, 4], [2**70, 1, 2, 3]])
def test_bad_tokens_are_value_errors(bad: list) -> None:
    with pytest.raises(ValueError):
        hash_blocks(ns(), bad, 4)


@pytest.mark.parametrize("kwargs", [{"model_id": ""}, {"weights_version": ""}])
def test_empty_namespace_fields_rejected(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ns(**kwargs)


def test_bad_namespace_or_block_size() -> None:
    with pytest.raises(ValueError):
        hash_blocks(b"short", P, 4)
    with pytest.raises(ValueError):
        hash_blocks(ns(), P, 0)


def test_media_digest_and_offset_enter_the_key() -> None:
    img = 99
    tokens = [5, 6, 7, 8] + [img] * 8 + [9, 10, 11, 12]
    m1 = MediaSpan(digest=b"\xaa" * 14 + b"\x12\x34", start=4, length=8)
    m2 = MediaSpan(digest=b"\xbb" * 14 + b"\x12\x34", start=4, length=8)  # same low 16 bits
    h1 = hash_blocks(ns(), tokens, 4, media=[m1])
    h2 = hash_blocks(ns(), tokens, 4, media=[m2])
    assert h1[0] == h2[0]  # block 0 has no media
    assert h1[1] != h2[1] and h1[2] != h2[2] and h1[3] != h2[3]
    # the same digest at another offset gives another key
    shifted = MediaSpan(digest=m1.digest, start=8, length=8)
    assert hash_blocks(ns(), tokens, 4, media=[shifted])[2] != h1[2]
    with pytest.raises(ValueError):
        MediaSpan(digest=b"\x12\x34", start=0, length=4)
