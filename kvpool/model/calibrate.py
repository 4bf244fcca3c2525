"""Calibrate the cost model's recompute time on this runner (a start-up micro-benchmark, cached on disk).

`calibrate_recompute(runner)` times `prefill(n_new tokens | n_ctx cached)` over a small grid, fits
`kvpool.cost.RecomputeModel` (overhead + per token + per attention pair; Mooncake FAST'25 arXiv
2407.00079, SGLang arXiv 2312.07104), and stores it as JSON under
`<cache_dir>/calibration/recompute-<weights_version[:16]>-<device fingerprint>.json`, so the next start on
the same model and machine reads it instead of measuring. On a fit failure it falls back to the FLOP
model (`RecomputeModel.from_flops`) with a measured effective FLOP/s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvpool.cost import RecomputeModel, RecomputeSample
from kvpool.errors import InvalidArgument
from kvpool.model.embedded import cache_root
from kvpool.model.runner import ModelRunner

log = logging.getLogger(__name__)

DEFAULT_CTX_POINTS = (0, 1024, 2048)
DEFAULT_NEW_POINTS = (64, 256, 768)


def device_fingerprint(device: str) -> str:
    """A short digest of what makes timings differ: device model, CPU, threads, torch version, dtype-free."""
    parts = [platform.machine(), torch.__version__, f"threads={torch.get_num_threads()}", device]
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        parts += [torch.cuda.get_device_name(idx), str(torch.cuda.get_device_capability(idx))]
    else:
        try:
            with open("/proc/cpuinfo") as f:
                parts += [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")][:1]
        except OSError:
            parts.append(platform.processor())
        parts.append(f"cpus={os.cpu_count()}")
    return hashlib.blake2b("|".join(parts).encode(), digest_size=8).hexdigest()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_prefill(runner: ModelRunner, ids: Sequence[int], prefix: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.prefill(ids, prefix)  # type: ignore[arg-type]
        _sync(runner.device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_samples(
    runner: ModelRunner,
    ctx_points: Sequence[int] = DEFAULT_CTX_POINTS,
    new_points: Sequence[int] = DEFAULT_NEW_POINTS,
    *,
    repeats: int = 2,
    seed: int = 0,
) -> list[RecomputeSample]:
    """Time `prefill(n_new | n_ctx)` for every grid point (best of `repeats`, after one warm-up)."""
    gen = torch.Generator().manual_seed(seed)
    total = max(ctx_points) + max(new_points)
    ids = torch.randint(0, min(runner.vocab_size, 256), (total,), generator=gen).tolist()
    runner.prefill(ids[:64])  # warm-up
    samples = []
    for n_ctx in ctx_points:
        prefix = runner.prefill(ids[:n_ctx])[1] if n_ctx else None
        for n_new in new_points:
            seconds = _time_prefill(runner, ids[n_ctx : n_ctx + n_new], prefix, repeats)
            samples.append(RecomputeSample(n_new=n_new, n_ctx=n_ctx, seconds=seconds))
    return samples


def measure_flops_per_s(runner: ModelRunner, n_tokens: int = 256, repeats: int = 2) -> float:
    """Effective FLOP/s of a cold prefill of `n_tokens` (dense `2·Ψ_layers` + attention FLOP / time)."""
    ids = [i % min(runner.vocab_size, 256) for i in range(n_tokens)]
    runner.prefill(ids[:16])
    seconds = _time_prefill(runner, ids, None, repeats)
    heads = int(runner.config.num_attention_heads) * runner.layout.head_dim
    flop = (
        2 * runner.num_layer_params * n_tokens
        + 4 * runner.layout.num_layers * heads * n_tokens * (n_tokens + 1) / 2
    )
    return flop / seconds


def flops_fallback(runner: ModelRunner) -> RecomputeModel:
    """The FLOP-based recompute model with this runner's measured effective FLOP/s."""
    return RecomputeModel.from_flops(
        flop_params=runner.num_layer_params,
        num_layers=runner.layout.num_layers,
        attn_dim=int(runner.config.num_attention_heads) * runner.layout.head_dim,
        flops_per_s=measure_flops_per_s(runner),
    )


MAX_CACHED_FIT_RMSE = 0.3
"""A fit with a larger relative RMS error (timings swamped by other work on the host) is neither cached
nor read back from the cache: the next start measures again."""


def _measure_and_fit(
    runner: ModelRunner, ctx_points: Sequence[int], new_points: Sequence[int], repeats: int
) -> tuple[RecomputeModel, list[RecomputeSample]]:
    samples = measure_samples(runner, ctx_points, new_points, repeats=repeats)
    try:
        return RecomputeModel.fit(samples), samples
    except InvalidArgument as exc:
        log.warning("recompute fit failed (%s); using the FLOP model", exc)
        return flops_fallback(runner), samples


def calibrate_recompute(
    runner: ModelRunner,
    *,
    cache_dir: Path | None = None,
    ctx_points: Sequence[int] = DEFAULT_CTX_POINTS,
    new_points: Sequence[int] = DEFAULT_NEW_POINTS,
    repeats: int = 2,
    refresh: bool = False,
) -> RecomputeModel:
    """The calibrated `RecomputeModel` of `runner` on its device: read from the disk cache, else measured.

    The cache key is (weights_version, dtype, device fingerprint, grid); `refresh=True` re-measures.
    Takes about 1-3 s with the default grid on the embedded model (2-core CPU). Falls back to the FLOP
    model if the fit fails. Raises `InvalidArgument` for an empty grid.
    """
    if not ctx_points or not new_points:
        raise InvalidArgument("calibration needs non-empty ctx_points and new_points")
    grid = hashlib.blake2b(repr((tuple(ctx_points), tuple(new_points))).encode(), digest_size=4).hexdigest()
    name = f"recompute-{runner.weights_version[:16]}-{runner.layout.dtype}-{device_fingerprint(runner.device)}-{grid}.json"
    path = (cache_dir or cache_root()) / "calibration" / name
    if path.is_file() and not refresh:
        try:
            cached = RecomputeModel.from_dict(json.loads(path.read_text())["model"])
            if cached.fit_rel_rmse <= MAX_CACHED_FIT_RMSE:
                return cached
            log.warning(
                "ignoring calibration %s: a %.0f%% fit error says it was measured under heavy load",
                path,
                cached.fit_rel_rmse * 100,
            )
        except (ValueError, KeyError) as exc:
            log.warning("ignoring unreadable calibration %s: %s", path, exc)
    model, samples = _measure_and_fit(runner, ctx_points, new_points, repeats)
    if model.fit_rel_rmse > MAX_CACHED_FIT_RMSE:  # a noisy machine: used now, measured again next start
        log.warning(
            "recompute fit error %.0f%%: not cached (the node corrects its level online)",
            model.fit_rel_rmse * 100,
        )
        return model
    record = {
        "model": model.to_dict(),
        "samples": [[s.n_new, s.n_ctx, s.seconds] for s in samples],
        "model_id": runner.model_id,
        "device": runner.device,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    log.info(
        "recompute calibrated for %s on %s: overhead %.2f ms, %.1f us/token, %.3g ns/pair (rel rmse %.1f%%)",
        runner.model_id,
        runner.device,
        model.overhead_s * 1e3,
        model.per_token_s * 1e6,
        model.per_pair_s * 1e9,
        model.fit_rel_rmse * 100,
    )
    return model
