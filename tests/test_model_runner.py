"""Loading, namespaces, architecture refusal, tokenizer and settings of the model runner (issue 8)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from kvpool.errors import FailedPrecondition, InvalidArgument, NotFound  # noqa: E402
from kvpool.model import (  # noqa: E402
    EmbeddedSpec,
    ModelRunner,
    ModelSettings,
    SamplingParams,
    embedded_model_dir,
)
from kvpool.model.runner import weights_digest  # noqa: E402

TINY = EmbeddedSpec(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)


def test_two_weights_versions_get_different_namespaces(tmp_path: Path) -> None:
    a = ModelRunner.load(embedded_model_dir(TINY, cache_dir=tmp_path), block_size=16)
    spec_b = EmbeddedSpec(**{**{f: getattr(TINY, f) for f in TINY.__slots__}, "seed": 1})
    b = ModelRunner.load(embedded_model_dir(spec_b, cache_dir=tmp_path), block_size=16)
    assert a.model_id == b.model_id and a.layout == b.layout
    assert a.weights_version != b.weights_version
    assert a.namespace().digest() != b.namespace().digest()
    assert a.namespace().digest() != a.namespace(cache_salt="tenant-1").digest()
    assert a.synthetic and "SYNTHETIC" in a.describe()


def test_embedded_model_is_deterministic(tmp_path: Path) -> None:
    d1 = embedded_model_dir(TINY, cache_dir=tmp_path / "one")
    d2 = embedded_model_dir(TINY, cache_dir=tmp_path / "two")
    assert d1 != d2 and weights_digest(d1) == weights_digest(d2)
    assert embedded_model_dir(TINY, cache_dir=tmp_path / "one") == d1  # reused, not rebuilt


def test_default_layout_and_tokenizer(tmp_path: Path) -> None:
    r = ModelRunner.load(embedded_model_dir(cache_dir=tmp_path))
    assert r.layout.fingerprint() == "kv1:float32:b64:l4:h4:d32"
    assert r.layout.token_nbytes == 4096 and r.vocab_size == 259 and r.eos_token_id == 257
    ids = r.encode("héllo")
    assert ids[0] == 256 and r.decode(ids) == "héllo"
    assert r.device == "cpu"


def test_import_cost_model_and_package_do_not_import_torch() -> None:
    code = "import kvpool.cost, kvpool.model, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _write_config(path: Path, config: object) -> Path:
    path.mkdir(parents=True)
    config.save_pretrained(str(path))  # type: ignore[attr-defined]
    return path


@pytest.mark.parametrize(
    ("name", "match"),
    [("mistral_sliding", "sliding-window"), ("deepseek_v3", "MLA|latent"), ("mamba", "recurrent")],
)
def test_unsupported_architectures_refused(tmp_path: Path, name: str, match: str) -> None:
    import transformers

    configs = {
        "mistral_sliding": lambda: transformers.MistralConfig(sliding_window=16),
        "deepseek_v3": lambda: transformers.DeepseekV3Config(),
        "mamba": lambda: transformers.MambaConfig(),
    }
    path = _write_config(tmp_path / name, configs[name]())
    with pytest.raises(FailedPrecondition, match=match):
        ModelRunner.load(path)


def test_missing_dir_and_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        ModelRunner.load(tmp_path / "nothing")
    d = embedded_model_dir(TINY, cache_dir=tmp_path)
    with pytest.raises(InvalidArgument):
        ModelRunner.load(d, block_size=0)
    with pytest.raises(InvalidArgument):
        ModelRunner.load(d, dtype="int8")
    r = ModelRunner.load(d, block_size=16)
    with pytest.raises(InvalidArgument):
        r.prefill([])
    with pytest.raises(InvalidArgument):
        r.prefill([r.vocab_size])
    with pytest.raises(InvalidArgument):
        r.decode_step([])


def test_batch_invariant_flag_exists_and_is_off_by_default(tmp_path: Path) -> None:
    """B27: no promise of cold == warm token equality unless a batch-invariant mode is enabled."""
    assert ModelSettings().batch_invariant is False
    assert inspect.signature(ModelRunner.load).parameters["batch_invariant"].default is False
    r = ModelRunner.load(embedded_model_dir(TINY, cache_dir=tmp_path), block_size=16, batch_invariant=True)
    assert r.batch_invariant
    _, c1 = r.prefill([1, 2, 3])
    _, c2 = r.prefill(list(range(4, 40)))
    logits, caches = r.decode_step([(c1, 5), (c2, 6)])
    alone, _ = r.decode_step([(c1, 5)])
    assert bool((logits[0] == alone[0]).all())  # bit-identical whatever the batch
    assert [c.num_tokens for c in caches] == [4, 37]


def test_sampling_params_validated() -> None:
    for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -1}, {"max_tokens": 0}):
        with pytest.raises(InvalidArgument):
            SamplingParams(**bad)  # type: ignore[arg-type]
