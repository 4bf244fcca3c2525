"""The model runner shared by prefill and decode nodes: loading, tokenizing, KV block exchange, sampling.

Torch and transformers are imported only when a name that needs them is first used (`import kvpool.model`
stays cheap, so `kvpool admin` starts fast). Exports:

- `ModelRunner` (runner.py): load a HF causal-LM dir or the embedded default, prefill, batched decode,
  gather/scatter of pool blocks `[num_layers, 2, num_kv_heads, block_size, head_dim]`.
- `KVPrefix` (kv.py): an immutable KV cache of the first `num_tokens` tokens of a sequence.
- `SamplingParams`, `sample_next`, `make_generator` (sampling.py).
- `load_runner`, `embedded_model_dir`, `EmbeddedSpec`, `DEFAULT_SPEC` (embedded.py, runner.py).
- `calibrate_recompute`, `measure_flops_per_s` (calibrate.py): fit the cost model's recompute time.
- `ModelSettings` (settings.py): the model section of a node's config (`batch_invariant` is off by default).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ModelRunner": "kvpool.model.runner",
    "load_runner": "kvpool.model.runner",
    "KVPrefix": "kvpool.model.kv",
    "SamplingParams": "kvpool.model.sampling",
    "sample_next": "kvpool.model.sampling",
    "make_generator": "kvpool.model.sampling",
    "embedded_model_dir": "kvpool.model.embedded",
    "EmbeddedSpec": "kvpool.model.embedded",
    "DEFAULT_SPEC": "kvpool.model.embedded",
    "calibrate_recompute": "kvpool.model.calibrate",
    "measure_flops_per_s": "kvpool.model.calibrate",
    "ModelSettings": "kvpool.model.settings",
    "ByteTokenizer": "kvpool.model.tokenizer",
}

__all__ = [
    "DEFAULT_SPEC",
    "ByteTokenizer",
    "EmbeddedSpec",
    "KVPrefix",
    "ModelRunner",
    "ModelSettings",
    "SamplingParams",
    "calibrate_recompute",
    "embedded_model_dir",
    "load_runner",
    "make_generator",
    "measure_flops_per_s",
    "sample_next",
]

if TYPE_CHECKING:
    from kvpool.model.calibrate import calibrate_recompute, measure_flops_per_s
    from kvpool.model.embedded import DEFAULT_SPEC, EmbeddedSpec, embedded_model_dir
    from kvpool.model.kv import KVPrefix
    from kvpool.model.runner import ModelRunner, load_runner
    from kvpool.model.sampling import SamplingParams, make_generator, sample_next
    from kvpool.model.settings import ModelSettings
    from kvpool.model.tokenizer import ByteTokenizer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
