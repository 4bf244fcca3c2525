"""Which architectures fit the pool's block layout, checked from the config before weights are loaded.

The pool stores one KV block as `[num_layers, 2, num_kv_heads, block_size, head_dim]` for every layer
and every token. That is wrong for:
- sliding-window / chunked attention (a layer keeps only the last W tokens; field case B26),
- MLA (DeepSeek-V2/V3: a compressed latent, not per-head K/V),
- hybrid / recurrent layers (Mamba, RWKV, Jamba...: a state, not a per-token KV),
- encoder-decoder models and KV sharing between layers.
Such models are refused with `FailedPrecondition` rather than served wrongly.
"""

from __future__ import annotations

from typing import Any

from kvpool.errors import FailedPrecondition

_RECURRENT_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "jamba",
        "rwkv",
        "recurrent_gemma",
        "zamba",
        "zamba2",
        "bamba",
        "falcon_h1",
        "nemotron_h",
        "granitemoehybrid",
        "qwen3_next",
        "lfm2",
        "plamo2",
        "minimax",
    }
)
_RECURRENT_ATTRS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices", "ssm_cfg")


def check_architecture(config: Any) -> None:
    """Raise `FailedPrecondition` naming the reason if `config`'s KV does not fit the block layout."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = str(getattr(cfg, "model_type", "") or "")
    name = model_type or type(cfg).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise FailedPrecondition(f"{name}: encoder-decoder models are not supported (decoder-only only)")
    if model_type in _RECURRENT_MODEL_TYPES or any(getattr(cfg, a, None) for a in _RECURRENT_ATTRS):
        raise FailedPrecondition(
            f"{name}: hybrid/recurrent layers keep a state, not per-token KV; the pool cannot serve it"
        )
    if getattr(cfg, "kv_lora_rank", None) or model_type.startswith("deepseek_v"):
        raise FailedPrecondition(
            f"{name}: multi-head latent attention (MLA) caches a compressed latent, not per-head K/V; "
            "the pool's block layout does not fit it"
        )
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise FailedPrecondition(
            f"{name}: sliding-window attention (window {cfg.sliding_window}) is not supported: "
            "prefix reuse needs every layer to keep every token (field case B26)"
        )
    if getattr(cfg, "attention_chunk_size", None):
        raise FailedPrecondition(f"{name}: chunked local attention is not supported")
    if getattr(cfg, "kv_sharing_modes", None) or getattr(cfg, "num_kv_shared_layers", 0):
        raise FailedPrecondition(f"{name}: KV sharing between layers is not supported")
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise FailedPrecondition(
                f"{name}: layer types {other} are not full attention; only all-full-attention models fit"
            )
    for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not getattr(cfg, attr, None):
            raise FailedPrecondition(f"{name}: config lacks {attr}; cannot derive the KV layout")


def kv_dims(config: Any) -> tuple[int, int, int]:
    """`(num_layers, num_kv_heads, head_dim)` of an all-full-attention decoder config."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(cfg.num_hidden_layers), kv_heads, head_dim
