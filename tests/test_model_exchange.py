"""Exactness of KV block exchange: scatter(gather(KV)) + suffix compute == full recompute (issue 8).

Two architectures: the embedded default (4 layers, 8 heads, 4 KV heads, block 64) and a smaller one
(3 layers, hidden 192, 6 heads, 3 KV heads, block 16). fp32 on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvpool.errors import InvalidArgument  # noqa: E402
from kvpool.model import EmbeddedSpec, KVPrefix, ModelRunner, SamplingParams, embedded_model_dir  # noqa: E402

SMALL = EmbeddedSpec(num_layers=3, hidden_size=192, num_heads=6, num_kv_heads=3, intermediate_size=512)
TOL = 1e-4
MAX_DELTA: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: exact either way, and robust on a shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvpool-cache")


@pytest.fixture(scope="module", params=["default", "small"])
def runner(request: pytest.FixtureRequest, cache_dir: Path) -> ModelRunner:
    if request.param == "default":
        return ModelRunner.load(embedded_model_dir(cache_dir=cache_dir))
    return ModelRunner.load(embedded_model_dir(SMALL, cache_dir=cache_dir), block_size=16)


def _roundtrip(runner: ModelRunner, donor: KVPrefix, num_blocks: int) -> KVPrefix:
    blocks = runner.blocks_from_prefix(donor, 0, num_blocks)
    wire = [bytes(b) for b in blocks]  # through plain bytes, as the transport carries them
    assert all(len(b) == runner.layout.block_nbytes for b in wire)
    return runner.prefix_from_blocks(wire)


def _prompts(runner: ModelRunner, n: int = 24) -> list[tuple[list[int], list[int]]]:
    """(base, prompt) pairs: prompt shares a prefix of `base`, cut at aligned, unaligned and full points."""
    rng = np.random.default_rng(1234)
    bs = runner.layout.block_size
    bases = [rng.integers(0, 256, size=4 * bs + int(rng.integers(1, bs))).tolist() for _ in range(4)]
    out = []
    for i in range(n):
        base = bases[i % len(bases)]
        kind = i % 4
        if kind == 0:  # cut on a block boundary, new suffix
            cut = bs * int(rng.integers(1, 4))
        elif kind == 1:  # cut inside a block: the partial tail is recomputed
            cut = bs * int(rng.integers(1, 4)) + int(rng.integers(1, bs))
        elif kind == 2:  # the prompt is exactly a cached block-aligned prefix (B06)
            out.append((base, base[: bs * int(rng.integers(1, 4))]))
            continue
        else:  # the whole base plus more
            cut = len(base)
        suffix = rng.integers(0, 256, size=int(rng.integers(1, 2 * bs))).tolist()
        out.append((base, base[:cut] + suffix))
    return out


def _common_blocks(a: list[int], b: list[int], bs: int) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n // bs


def test_scatter_gather_suffix_equals_full_recompute(runner: ModelRunner) -> None:
    bs = runner.layout.block_size
    worst = 0.0
    hits = 0
    donors: dict[tuple[int, ...], KVPrefix] = {}
    for base, prompt in _prompts(runner):
        key = tuple(base)
        if key not in donors:
            donors[key] = runner.prefill(base)[1]
        donor = donors[key]
        k = _common_blocks(base, prompt, bs)
        hits += k
        prefix = _roundtrip(runner, donor, k)
        warm, warm_cache = runner.prefill_prompt(prompt, prefix)
        cold, cold_cache = runner.prefill(prompt)
        assert warm_cache.num_tokens == cold_cache.num_tokens == len(prompt)
        worst = max(worst, float((warm - cold).abs().max()))
        assert int(warm.argmax()) == int(cold.argmax())
    MAX_DELTA[runner.model_id] = worst
    print(f"\n{runner.model_id}: max |delta logits| = {worst:.3g} over 24 prompts")
    assert hits > 0
    assert worst <= TOL


def test_greedy_continuations_equal(runner: ModelRunner) -> None:
    bs = runner.layout.block_size
    params = SamplingParams(max_tokens=8)
    for base, prompt in _prompts(runner, 8)[4:]:
        _, donor = runner.prefill(base)
        prefix = _roundtrip(runner, donor, _common_blocks(base, prompt, bs))
        assert runner.generate(prompt, prefix, params) == runner.generate(prompt, None, params)


def test_fully_cached_prompt_computes_last_token(runner: ModelRunner) -> None:
    bs = runner.layout.block_size
    prompt = list(range(1, 2 * bs + 1))
    cold, cold_cache = runner.prefill(prompt)
    prefix = _roundtrip(runner, cold_cache, 2)
    assert prefix.num_tokens == len(prompt)
    warm, warm_cache = runner.prefill_prompt(prompt, prefix)
    assert warm_cache.num_tokens == len(prompt)
    assert float((warm - cold).abs().max()) <= TOL
    # The wrong way (re-running the last token on a cache that already holds it) differs: not vacuous.
    wrong, _ = runner.prefill(prompt[-1:], prefix)
    assert float((wrong - cold).abs().max()) > 1e-3


def test_partial_tail_never_gathered(runner: ModelRunner) -> None:
    bs = runner.layout.block_size
    _, cache = runner.prefill(list(range(1, bs + bs // 2)))
    assert len(runner.blocks_from_prefix(cache, 0, 1)) == 1
    with pytest.raises(InvalidArgument):
        runner.blocks_from_prefix(cache, 0, 2)
    with pytest.raises(InvalidArgument):
        runner.blocks_from_prefix(cache, 1, 0)


def test_wrong_block_length_refused(runner: ModelRunner) -> None:
    n = runner.layout.block_nbytes
    with pytest.raises(InvalidArgument, match="block 1"):
        runner.prefix_from_blocks([bytes(n), bytes(n - 1)])
    with pytest.raises(InvalidArgument):
        runner.prefix_from_blocks([np.zeros(n + 4, dtype=np.uint8)])


def test_blocks_are_contiguous_and_round_trip_bit_exact(runner: ModelRunner) -> None:
    bs = runner.layout.block_size
    _, cache = runner.prefill(list(range(3, 3 + 3 * bs)))
    blocks = runner.blocks_from_prefix(cache, 0, 3)
    for b in blocks:
        assert b.dtype == np.uint8 and b.flags.c_contiguous and b.nbytes == runner.layout.block_nbytes
    again = runner.blocks_from_prefix(runner.prefix_from_blocks(blocks), 0, 3)
    assert all(bytes(a) == bytes(b) for a, b in zip(blocks, again, strict=True))
    # Appending after a base prefix equals scattering everything at once.
    split = runner.prefix_from_blocks(blocks[1:], base=runner.prefix_from_blocks(blocks[:1]))
    assert [bytes(b) for b in runner.blocks_from_prefix(split, 0, 3)] == [bytes(b) for b in blocks]


def test_batched_decode_equals_one_by_one(runner: ModelRunner) -> None:
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, size=n).tolist() for n in (5, 37, 80, 130)]
    states = [runner.prefill(p) for p in prompts]
    solo_tokens = [runner.generate(p, params=SamplingParams(max_tokens=6)) for p in prompts]
    toks = [int(lg.argmax()) for lg, _ in states]
    caches = [c for _, c in states]
    batched_tokens: list[list[int]] = [[t] for t in toks]
    for _ in range(5):
        logits, caches = runner.decode_step(list(zip(caches, toks, strict=True)))
        toks = [int(x) for x in logits.argmax(dim=-1)]
        for seq, t in zip(batched_tokens, toks, strict=True):
            seq.append(t)
    assert batched_tokens == solo_tokens
    assert all(c.num_tokens == len(p) + 5 for c, p in zip(caches, prompts, strict=True))
    # Logits of one batched step vs the same requests alone.
    logits, _ = runner.decode_step([(c, 1) for _, c in states])
    alone = torch.stack([runner.decode_step([(c, 1)])[0][0] for _, c in states])
    assert float((logits - alone).abs().max()) <= TOL


def test_seeded_sampling_reproducible(runner: ModelRunner) -> None:
    prompt = runner.encode("the pool remembers")
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=12)
    a, b = runner.generate(prompt, params=p), runner.generate(prompt, params=p)
    assert a == b
    c = runner.generate(
        prompt, params=SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=12, max_tokens=12)
    )
    assert c != a


def test_scatter_of_rows_of_one_buffer_equals_scatter_of_copies(runner: ModelRunner) -> None:
    """A pull delivers blocks as back-to-back rows of one buffer (scattered without a gather copy); rows
    out of order, with a gap, or from two buffers take the copying path; all give the same prefix."""
    bs = runner.layout.block_size
    _, cache = runner.prefill(list(range(3, 3 + 4 * bs)))
    copies = [np.array(b) for b in runner.blocks_from_prefix(cache, 0, 4)]
    want = [bytes(b) for b in copies]
    rows = np.stack(copies)  # one buffer, 4 rows
    for blocks, order in (
        ([rows[0], rows[1], rows[2], rows[3]], [0, 1, 2, 3]),  # consecutive: no copy
        ([rows[1], rows[2]], [1, 2]),  # consecutive, not from the start
        ([rows[0], rows[2]], [0, 2]),  # a gap
        ([rows[2], rows[1]], [2, 1]),  # reversed
        ([rows[0], np.array(rows[1])], [0, 1]),  # two buffers
    ):
        got = runner.blocks_from_prefix(runner.prefix_from_blocks(blocks), 0, len(blocks))
        assert [bytes(b) for b in got] == [want[i] for i in order]


def test_prefill_on_a_prefix_never_writes_the_prefix(runner: ModelRunner) -> None:
    """The cache hands the prefix's tensors to the model without a copy; extending it must not write them."""
    bs = runner.layout.block_size
    prompt = list(range(3, 3 + 2 * bs + 5))
    _, cache = runner.prefill(prompt[: 2 * bs])
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    logits_a, _ = runner.prefill(prompt[2 * bs :], cache)
    logits_b, _ = runner.prefill(prompt[2 * bs :], cache)
    assert torch.equal(logits_a, logits_b)
    assert all(
        torch.equal(k, k0) and torch.equal(v, v0)
        for (k, v), (k0, v0) in zip(cache.layers, before, strict=True)
    )


def test_suffix_on_a_prefix_takes_the_merged_attention_with_the_masked_result(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A suffix on a cached prefix runs attention as two unmasked calls merged by log-sum-exp
    (kvpool/model/attention.py; the masked kernel made partial hits slower than misses); logits and KV
    equal those of transformers' masked SDPA path."""
    import contextlib

    from kvpool.model import attention
    from kvpool.model import runner as runner_module

    rng = np.random.default_rng(7)
    tokens = rng.integers(0, runner.vocab_size, 700).tolist()
    _, prefix = runner.prefill(tokens[:100])
    calls: list[int] = []
    real = attention.merged_prefix_attention

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "merged_prefix_attention", counted)
    logits, merged = runner.prefill(tokens[100:], prefix)
    assert len(calls) == runner.layout.num_layers  # once per layer
    monkeypatch.setattr(runner_module, "prefix_prefill", contextlib.nullcontext)  # the masked SDPA path
    ref_logits, ref = runner.prefill(tokens[100:], prefix)
    assert len(calls) == runner.layout.num_layers
    assert merged.num_tokens == ref.num_tokens == len(tokens)
    assert float((logits - ref_logits).abs().max()) < 1e-4
    for (k1, v1), (k2, v2) in zip(merged.layers, ref.layers, strict=True):
        assert float((k1 - k2).abs().max()) < 1e-4 and float((v1 - v2).abs().max()) < 1e-4
    assert logits.argmax() == ref_logits.argmax()
