"""Recompute calibration on a real (tiny) runner: fitted, cached on disk, FLOP fallback (issue 8)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvpool.cost import RecomputeModel, decide_reuse  # noqa: E402
from kvpool.cost.link import LinkEstimate  # noqa: E402
from kvpool.model import EmbeddedSpec, ModelRunner, calibrate_recompute, embedded_model_dir  # noqa: E402
from kvpool.model import calibrate as calibrate_mod  # noqa: E402

TINY = EmbeddedSpec(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
GRID = {"ctx_points": (0, 256), "new_points": (16, 64, 192), "repeats": 1}


def test_calibration_fits_and_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ModelRunner.load(embedded_model_dir(TINY, cache_dir=tmp_path), block_size=16)
    model = calibrate_recompute(runner, cache_dir=tmp_path, **GRID)  # type: ignore[arg-type]
    assert model.source in ("calibrated", "flops")
    assert model.t_recompute_s(512, 0) > model.t_recompute_s(64, 0) > 0
    files = list((tmp_path / "calibration").glob("recompute-*.json"))
    if model.fit_rel_rmse > calibrate_mod.MAX_CACHED_FIT_RMSE:  # measured under heavy load: not cached
        assert files == []
        return
    assert len(files) == 1 and runner.weights_version[:16] in files[0].name

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(calibrate_mod, "measure_samples", boom)
    assert calibrate_recompute(runner, cache_dir=tmp_path, **GRID) == model  # type: ignore[arg-type]
    # The decision uses it: a free link always loads.
    d = decide_reuse(
        4, 16, 70, runner.layout.block_nbytes, LinkEstimate(alpha_s=0, beta_bytes_per_s=1e15), model
    )
    assert d.num_load_blocks == 4


def test_flops_fallback_on_runner(tmp_path: Path) -> None:
    runner = ModelRunner.load(embedded_model_dir(TINY, cache_dir=tmp_path), block_size=16)
    flops = calibrate_mod.measure_flops_per_s(runner, n_tokens=128, repeats=1)
    assert flops > 1e6
    m = calibrate_mod.flops_fallback(runner)
    assert isinstance(m, RecomputeModel) and m.source == "flops" and m.per_token_s > 0


def test_a_noisy_cached_fit_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fit measured under heavy load (large fit error) is neither trusted from the cache nor written."""
    import json

    runner = ModelRunner.load(embedded_model_dir(TINY, cache_dir=tmp_path), block_size=16)
    good = RecomputeModel(
        overhead_s=0.001, per_token_s=1e-5, per_pair_s=1e-9, source="calibrated", fit_rel_rmse=0.05
    )
    noisy = RecomputeModel(
        overhead_s=0.4, per_token_s=1.6e-3, per_pair_s=0.0, source="calibrated", fit_rel_rmse=0.5
    )
    fits = iter([(noisy, []), (good, [])])
    calls = []

    def fake(*args: object, **kwargs: object) -> tuple[RecomputeModel, list[object]]:
        calls.append(1)
        return next(fits)

    monkeypatch.setattr(calibrate_mod, "_measure_and_fit", fake)
    assert calibrate_recompute(runner, cache_dir=tmp_path, **GRID) == noisy  # type: ignore[arg-type]
    assert len(calls) == 1
    assert not list((tmp_path / "calibration").glob("recompute-*.json"))  # and cached nothing
    assert calibrate_recompute(runner, cache_dir=tmp_path, **GRID) == good  # type: ignore[arg-type]
    (path,) = (tmp_path / "calibration").glob("recompute-*.json")
    # a noisy file written by an older version is ignored too
    path.write_text(json.dumps({"model": noisy.to_dict()}))
    monkeypatch.setattr(calibrate_mod, "_measure_and_fit", lambda *a, **k: (good, []))
    assert calibrate_recompute(runner, cache_dir=tmp_path, **GRID) == good  # type: ignore[arg-type]
