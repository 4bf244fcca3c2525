"""The embedded default model: a small Llama (GQA) with SYNTHETIC weights drawn from a fixed seed.

It is created on first use, saved as a normal Hugging Face directory (config.json + model.safetensors +
`kvpool_embedded.json`) under `$KVPOOL_CACHE_DIR/models/<name>` (default `~/.cache/kvpool/models/<name>`)
and then loaded through the same code path as any checkpoint. Weights are drawn with numpy's PCG64 from
`seed` in a fixed parameter order, independent of transformers' own initialisers, so every node of one
machine type builds the same bytes and hence the same weights version. The weights are random: the model
emits byte soup. It exists to make the pool's economics real (a real forward, a real KV), not to talk.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MARKER_FILE = "kvpool_embedded.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddedSpec:
    """Shape of an embedded model. Default: 4 layers, hidden 256, 8 heads, 4 KV heads (head_dim 32), fp32.

    KV per token = layers * 2 * kv_heads * head_dim * 4 B = 4096 B for the default.
    Vocab = 256 bytes + BOS (256) + EOS (257) + PAD (258).
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    vocab_size: int = 259
    seed: int = 0

    @property
    def model_id(self) -> str:
        """The architecture's name (no seed: two seeds are two weights versions of one model)."""
        return (
            f"kvpool-tiny-llama-l{self.num_layers}-h{self.hidden_size}-a{self.num_heads}"
            f"-kv{self.num_kv_heads}-i{self.intermediate_size}"
        )

    @property
    def name(self) -> str:
        """Directory name: `model_id` plus the seed."""
        return f"{self.model_id}-s{self.seed}"


DEFAULT_SPEC = EmbeddedSpec()


def cache_root() -> Path:
    """`$KVPOOL_CACHE_DIR` or `~/.cache/kvpool`."""
    env = os.environ.get("KVPOOL_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvpool"


def _hf_config(spec: EmbeddedSpec) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        dtype="float32",
    )


def _synthetic_state(model: Any, seed: int) -> dict[str, Any]:
    """Draw every parameter from PCG64(seed) in sorted-name order: norms 1, matrices N(0, 1/fan_in)
    (embeddings N(0, 1), lm_head N(0, 4/fan_in) so logits are well separated and greedy has no near-ties)."""
    import numpy as np
    import torch

    rng = np.random.Generator(np.random.PCG64(seed))
    state = {}
    for name, param in sorted(model.state_dict().items()):
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            arr = np.ones(shape, dtype=np.float32)
        elif "embed_tokens" in name:
            arr = rng.standard_normal(shape, dtype=np.float32)
        else:
            std = (4.0 if "lm_head" in name else 1.0) / np.sqrt(shape[-1])
            arr = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        state[name] = torch.from_numpy(arr)
    return state


def create_embedded_model(spec: EmbeddedSpec, out_dir: Path) -> None:
    """Write the HF directory of `spec` into `out_dir` (which must not exist)."""
    import torch
    from transformers import LlamaForCausalLM

    config = _hf_config(spec)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    state = _synthetic_state(skeleton, spec.seed)
    model = LlamaForCausalLM(config)
    model.load_state_dict(state, strict=True)
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out_dir), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    marker = {"synthetic": True, "spec": asdict(spec), "tokenizer": "byte", "model_id": spec.model_id}
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def embedded_model_dir(spec: EmbeddedSpec = DEFAULT_SPEC, *, cache_dir: Path | None = None) -> Path:
    """The HF directory of the embedded model `spec`, creating it on first use.

    Safe against concurrent creators (build in a temp dir, then an atomic rename; the loser discards its
    copy). `cache_dir` defaults to `cache_root()`; the model lives at `<cache_dir>/models/<spec.name>`.
    """
    root = (cache_dir or cache_root()) / "models"
    final = root / spec.name
    if (final / MARKER_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=root))
    try:
        out = tmp / "m"
        create_embedded_model(spec, out)
        try:
            os.rename(out, final)
        except OSError:
            if not (final / MARKER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The embedded-model marker of `model_dir`, or None for an ordinary checkpoint."""
    path = model_dir / MARKER_FILE
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data
