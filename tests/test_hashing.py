"""Block hashing: determinism, chaining, isolation (field cases B01, B04, B05, B07, B08, B09, B23)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys

import pytest

from kvpool.hashing import HASH_VERSION, MediaSpan, Namespace, check_adapter_digest, hash_blocks
from kvpool.types import KVLayout

LAYOUT = KVLayout(dtype="float32", block_size=4, num_layers=4, num_kv_heads=2, head_dim=64)
P = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]


def ns(**kw: str) -> bytes:
    args: dict = {"model_id": "m", "weights_version": "w1", "layout": LAYOUT} | kw
    return Namespace(**args).digest()


# ---- the encoding as docs/design.md ("Keys and hashing") spells it out, written here from that text alone:
# the golden vectors are computed by this code, never copied from the implementation's output


def _spec_field(tag: str, payload: bytes) -> bytes:
    return tag.encode("ascii") + len(payload).to_bytes(4, "little") + payload


def _spec_blake(person: str, fields: list[bytes]) -> bytes:
    return hashlib.blake2b(b"".join(fields), digest_size=16, person=person.encode("ascii")).digest()


SPEC_VERSION = (1).to_bytes(4, "little")  # hash version 1


def spec_namespace(
    model_id: str, weights: str, layout_fp: str, salt: str = "", adapter: str = "", extra: tuple = ()
) -> bytes:
    fields = [_spec_field("v", SPEC_VERSION)]
    fields += [_spec_field(t, v.encode()) for t, v in (("m", model_id), ("w", weights), ("l", layout_fp))]
    fields += [_spec_field("s", salt.encode()), _spec_field("a", adapter.encode())]
    for key, value in sorted(extra):
        fields.append(_spec_field("e", _spec_field("k", key.encode()) + _spec_field("v", value.encode())))
    return _spec_blake("kvpool-ns", fields)


def spec_blocks(namespace: bytes, tokens: list[int], block_size: int, media: tuple = ()) -> list[bytes]:
    """`media`: (digest, start, length) spans."""
    out, parent = [], namespace
    for i in range(len(tokens) // block_size):
        ids = b"".join(t.to_bytes(4, "little") for t in tokens[i * block_size : (i + 1) * block_size])
        fields = [_spec_field("v", SPEC_VERSION), _spec_field("p", parent), _spec_field("t", ids)]
        extras = b""
        lo, hi = i * block_size, (i + 1) * block_size
        for digest, start, length in media:
            if start < hi and lo < start + length:
                first = max(lo, start)
                extras += _spec_field("d", digest) + _spec_field("o", (first - start).to_bytes(8, "little"))
                extras += _spec_field("q", (first - lo).to_bytes(8, "little"))
        if extras:
            fields.append(_spec_field("x", extras))
        parent = _spec_blake("kvpool-blk", fields)
        out.append(parent)
    return out


GOLDEN_NS = spec_namespace("m", "w1", "kv1:float32:b4:l4:h2:d64").hex()
GOLDEN_BLOCKS = [h.hex() for h in spec_blocks(bytes.fromhex(GOLDEN_NS), P, 4)]

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
    assert HASH_VERSION == 1  # a new version: spell it out in docs/design.md and here
    assert a == [GOLDEN_NS, *GOLDEN_BLOCKS] and len(a) == 3  # namespace + 2 full blocks


def test_every_namespace_field_and_extra_is_encoded_as_the_design_spells_out() -> None:
    adapter = "0123456789abcdef" * 2
    extra = (("zeta", "1"), ("engine", "vllm-x"), ("engine", "a"))
    got = Namespace(
        model_id="Qwen/é", weights_version="w2", layout=LAYOUT, cache_salt="tenant-a",
        adapter_digest=adapter, extra=extra,
    ).digest()  # fmt: skip
    assert got == spec_namespace("Qwen/é", "w2", "kv1:float32:b4:l4:h2:d64", "tenant-a", adapter, extra)


def test_multimodal_spans_are_encoded_as_the_design_spells_out() -> None:
    d1, d2 = bytes(range(32)), bytes(range(100, 120))
    tokens = list(range(1000, 1016))
    spans = ((d1, 2, 7), (d2, 6, 1))  # d1 covers blocks 0-2 (block 1 from its start), d2 block 1 only
    namespace = ns()
    got = hash_blocks(namespace, tokens, 4, media=[MediaSpan(d, start, n) for d, start, n in spans])
    assert got == spec_blocks(namespace, tokens, 4, spans)
    assert got != spec_blocks(namespace, tokens, 4)  # the spans count


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


LAYOUT_CHANGES = {
    "dtype": "float8_e4m3fn",
    "block_size": 8,
    "num_layers": 5,
    "num_kv_heads": 1,
    "head_dim": 128,
}


def test_the_layout_changes_cover_every_field() -> None:
    assert set(LAYOUT_CHANGES) == {f.name for f in dataclasses.fields(KVLayout)}


@pytest.mark.parametrize(("name", "value"), LAYOUT_CHANGES.items(), ids=list(LAYOUT_CHANGES))
def test_every_layout_field_is_part_of_the_fingerprint_and_the_namespace(name: str, value: object) -> None:
    """KV of another dtype, block size, layer count, kv head count or head dim is incompatible (B23): each
    one changed alone gives another fingerprint (which round-trips) and another namespace."""
    other = dataclasses.replace(LAYOUT, **{name: value})
    assert getattr(other, name) != getattr(LAYOUT, name)
    assert other.fingerprint() != LAYOUT.fingerprint()
    assert KVLayout.from_fingerprint(other.fingerprint()) == other
    assert Namespace(model_id="m", weights_version="w1", layout=other).digest() != ns()


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
