"""The C loops of the data plane (transfer/_kernels.c through transfer.xxh3.KERNELS): the same bytes and
checksums as the Python paths they replace, stop between blocks, refuse rows outside the segment."""

from __future__ import annotations

import importlib
import shutil
import sysconfig
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.capabilities import mark, skip
from transfer import shared_segment, xxh3
from transfer.shared_segment import SegmentMapping, SharedSegment, StopFlag
from transfer.xxh3 import KERNELS, address_of, addresses_of, checksum, checksum_many, checksums

needs_kernels = mark("kernels", "transfer._kernels not built (no C compiler)" if KERNELS is None else None)


def test_the_kernels_are_built_where_a_compiler_is() -> None:
    """A broken build must not silently leave a machine with a compiler on the slow paths."""
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        skip("kernels", "no C compiler here: the Python paths are the ones in use")
    assert KERNELS is not None


@needs_kernels
@pytest.mark.parametrize("avx2", [True, False], ids=["avx2", "binding"])
@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 20000), seed=st.integers(0, 2**32 - 1), cut=st.integers(0, 20000))
@example(n=240, seed=0, cut=16).via("the 129-240 B path whole, the 9-16 B path cut")
@example(n=241, seed=1, cut=128).via("the first long input, the 17-128 B path cut")
def test_both_xxh3_builds_hash_and_copy_as_the_binding(avx2: bool, n: int, seed: int, cut: int) -> None:
    """The extension's AVX2 build of XXH3 and the binding's functions, each driving the batch loops, give
    the binding's values for every length (XXH3 has separate paths up to 16, 128, 240 B and long inputs),
    whole and copied in 8 KiB pieces."""
    kernels = xxh3.Kernels(importlib.import_module("transfer._kernels"), xxh3._EXT, avx2=avx2)
    if kernels.simd != ("avx2" if avx2 else "binding"):
        skip("avx2", "this CPU or compiler has no AVX2 build")
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    src = np.frombuffer(data + bytes(8), dtype=np.uint8)  # never empty: an address to copy from
    parts = [src[: len(data)], src[: min(cut, len(data))], src[min(cut, len(data)) : len(data)]]
    want = [xxhash.xxh3_64_intdigest(p.tobytes()) for p in parts]
    got = np.zeros(3, dtype=np.uint64)
    kernels.hash_many(parts, got)
    assert got.tolist() == want
    dsts = [np.zeros(p.nbytes, dtype=np.uint8) for p in parts]
    offsets = np.array([0, 0, min(cut, len(data))], dtype=np.int64)
    got[:] = 0
    done = kernels.copy_verify(src.ctypes.data, src.nbytes, offsets, dsts, got, np.zeros(1, dtype=np.uint8))
    assert done == 3 and got.tolist() == want
    assert all(d.tobytes() == p.tobytes() for d, p in zip(dsts, parts, strict=True))


@pytest.fixture(params=["kernels", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both implementations: the C loops (where built) and the Python fallback."""
    if request.param == "kernels" and KERNELS is None:
        skip("kernels", "transfer._kernels not built")
    if request.param == "python":
        monkeypatch.setattr(shared_segment, "KERNELS", None)
        monkeypatch.setattr(xxh3, "KERNELS", None)
    yield request.param


@pytest.fixture(scope="module")
def segment() -> Iterator[tuple[SharedSegment, SegmentMapping]]:
    seg = SharedSegment(4 << 20)
    seg.array[:] = np.random.default_rng(7).integers(0, 256, seg.nbytes, dtype=np.uint8)
    m = SegmentMapping.attach(seg.descriptor)
    yield seg, m
    m.close()


def _parts(
    seg: SharedSegment, layout: list[tuple[int, int]]
) -> tuple[np.ndarray, list[tuple[memoryview, int, int]], list[int]]:
    """Destinations packed in one buffer (some adjacent, some apart) for (offset, nbytes) sources."""
    out = np.zeros(sum(n for _, n in layout) + 64 * len(layout), dtype=np.uint8)
    parts, starts, at = [], [], 0
    for k, (off, n) in enumerate(layout):
        at += 3 if k % 3 == 2 else 0  # every third destination starts apart (and unaligned)
        starts.append(at)
        want = checksum(seg.array[off : off + n]) if off >= 0 and off + n <= seg.nbytes else 0
        parts.append((memoryview(out)[at : at + n], off, want))
        at += n
    return out, parts, starts


LAYOUT = [(0, 65536), (65536, 65536), (131072, 1 << 20), (5, 4099), (3 << 20, 0), (1 << 21, 8), (17, 1)]


def test_copy_verify_copies_and_checks_every_block(
    path: str, segment: tuple[SharedSegment, SegmentMapping]
) -> None:
    seg, m = segment
    out, parts, starts = _parts(seg, LAYOUT)
    res = m.copy_verify(parts)
    assert all(ok for ok, _, _ in res), res
    for (off, n), at, (_, cs, _) in zip(LAYOUT, starts, res, strict=True):
        assert np.array_equal(out[at : at + n], seg.array[off : off + n])
        assert cs == xxhash.xxh3_64_intdigest(seg.array[off : off + n].tobytes())


def test_copy_verify_reports_mismatches_and_out_of_range_parts_alone(
    path: str, segment: tuple[SharedSegment, SegmentMapping]
) -> None:
    seg, m = segment
    layout = [(0, 4096), (seg.nbytes - 100, 4096), (8192, 4096), (-8, 16)]
    _, parts, _ = _parts(seg, layout)
    parts[2] = (parts[2][0], parts[2][1], parts[2][2] ^ 1)  # the store "sent" another checksum
    res = m.copy_verify(parts)
    assert res[0][0] and res[0][1] == parts[0][2]
    assert not res[1][0] and "outside" in res[1][2]
    assert not res[2][0] and "checksum mismatch" in res[2][2] and res[2][1] == parts[2][2] ^ 1
    assert not res[3][0] and "outside" in res[3][2]


def test_a_set_stop_flag_copies_nothing(path: str, segment: tuple[SharedSegment, SegmentMapping]) -> None:
    seg, m = segment
    out, parts, _ = _parts(seg, LAYOUT[:3])
    stop = StopFlag()
    stop.set()
    assert stop.is_set()
    res = m.copy_verify(parts, stop)
    assert all(not ok and err == "read abandoned" for ok, _, err in res)
    assert not out.any()  # no byte landed


@needs_kernels
def test_the_kernel_stops_between_blocks_and_says_how_far_it_got(
    segment: tuple[SharedSegment, SegmentMapping],
) -> None:
    """Stopped mid-way: blocks before the stop are whole, none after it is touched."""
    assert KERNELS is not None
    seg, m = segment
    n, nb = 64, 64 << 10
    out = np.zeros((n, nb), dtype=np.uint8)
    offsets = np.arange(n, dtype=np.int64) * nb
    got = np.zeros(n, dtype=np.uint64)
    stop = StopFlag()
    assert KERNELS.copy_verify(m.address, seg.nbytes, offsets[:3], list(out[:3]), got[:3], stop.byte) == 3
    stop.set()
    assert KERNELS.copy_verify(m.address, seg.nbytes, offsets[3:], list(out[3:]), got[3:], stop.byte) == 0
    assert np.array_equal(out[:3].reshape(-1), seg.array[: 3 * nb]) and not out[3:].any()
    assert got[:3].tolist() == [checksum(seg.array[k * nb : (k + 1) * nb]) for k in range(3)]


@needs_kernels
def test_the_kernels_refuse_bad_blocks_and_buffers_before_touching_memory(
    segment: tuple[SharedSegment, SegmentMapping],
) -> None:
    assert KERNELS is not None
    seg, m = segment
    out = np.zeros((2, 16), dtype=np.uint8)
    got = np.zeros(2, dtype=np.uint64)
    stop = np.zeros(1, dtype=np.uint8)
    for bad_offset in (seg.nbytes - 8, -1, 1 << 62):
        with pytest.raises(ValueError, match="outside"):
            KERNELS.copy_verify(
                m.address, seg.nbytes, np.array([0, bad_offset], np.int64), list(out), got, stop
            )
        assert not out.any()  # the good first block was not copied either
    for dsts in ([out[0], bytes(16)], [out[0], np.zeros((4, 8), np.uint8)[:, ::2]]):  # read-only; strided
        with pytest.raises(ValueError, match="C-contiguous"):
            KERNELS.copy_verify(m.address, seg.nbytes, np.zeros(2, np.int64), dsts, got, stop)
    with pytest.raises(ValueError, match="got"):
        KERNELS.copy_verify(m.address, seg.nbytes, np.zeros(1, np.int64), [out[0]], got, stop)
    with pytest.raises(ValueError, match="offsets"):
        KERNELS.copy_verify(m.address, seg.nbytes, np.zeros(3, np.int64), list(out), got, stop)
    with pytest.raises(TypeError):
        KERNELS.hash_many(42, got)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got"):
        KERNELS.hash_many([b"abc"], got)


def test_checksum_many_matches_one_by_one(path: str) -> None:
    rng = np.random.default_rng(3)
    blocks = [rng.integers(0, 256, n, dtype=np.uint8) for n in [0, 1, 7, 4096, 65536, (1 << 20) + 3, 100]]
    blocks.append(memoryview(blocks[4])[3:1003])  # unaligned
    blocks.append(np.zeros((8, 8), dtype=np.float32))  # any dtype: its bytes
    want = [xxhash.xxh3_64_intdigest(np.asarray(b).tobytes()) for b in blocks]
    assert checksum_many(blocks) == want
    assert checksums(blocks) == want
    assert checksum_many([]) == [] and checksum_many(blocks[1:2]) == want[1:2]
    with pytest.raises(ValueError, match="C-contiguous"):
        checksum_many([blocks[3], np.zeros((8, 8), dtype=np.uint8)[:, ::2]])


@needs_kernels
def test_large_jobs_stream_through_the_bounce_buffer_and_land_whole() -> None:
    """Over 8 MiB in one call: the non-temporal path, with unaligned destinations and odd sizes."""
    assert KERNELS is not None
    seg = SharedSegment(12 << 20)
    seg.array[:] = np.random.default_rng(9).integers(0, 256, seg.nbytes, dtype=np.uint8)
    m = SegmentMapping.attach(seg.descriptor)
    try:
        layout = [(0, 3 << 20), (3 << 20, (3 << 20) + 5), (1, (3 << 20) - 77), (9 << 20, 8191), (7, 0)]
        out = np.zeros(sum(n for _, n in layout) + 64, dtype=np.uint8)
        dsts, starts, at = [], [], 3  # the first destination is not 16-byte aligned
        for _, n in layout:
            dsts.append(out[at : at + n])
            starts.append(at)
            at += n + 1
        got = np.zeros(len(dsts), dtype=np.uint64)
        offsets = np.array([off for off, _ in layout], dtype=np.int64)
        assert KERNELS.copy_verify(m.address, seg.nbytes, offsets, dsts, got, StopFlag().byte) == 5
        for (off, n), start, cs in zip(layout, starts, got.tolist(), strict=True):
            assert np.array_equal(out[start : start + n], seg.array[off : off + n])
            assert cs == xxhash.xxh3_64_intdigest(seg.array[off : off + n].tobytes())
        gaps = [2] + [start + n for start, (_, n) in zip(starts, layout, strict=True)]
        assert not out[gaps].any()  # nothing written between blocks
    finally:
        m.close()


def test_addresses_of_matches_address_of(path: str) -> None:
    arr = np.zeros((6, 100), dtype=np.uint8)
    views = [memoryview(r) for r in arr] + [memoryview(arr[2])[7:9], memoryview(b"read-only bytes")]
    assert addresses_of(views) == [address_of(v) for v in views]
    assert addresses_of(views)[:2] == [arr.ctypes.data, arr.ctypes.data + 100]
    with pytest.raises(ValueError, match="C-contiguous"):
        addresses_of(views[:4] + [memoryview(np.zeros((4, 8), np.uint8)[:, ::2])])
