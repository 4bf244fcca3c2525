"""The model section of a prefill/decode node's settings (no torch import)."""

from __future__ import annotations

from pathlib import Path

from pydantic import field_validator

from kvpool.config import KVPoolSettings


def check_device(value: str) -> str:
    """`value` if torch can name it as a device; else `ValueError` (a settings error naming `device`, before
    a node loads its model and opens its ports)."""
    import torch

    try:
        torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    return value


class ModelSettings(KVPoolSettings):
    """How a node loads its model runner. Env: `KVPOOL_MODEL_DIR`, `KVPOOL_DEVICE`, ...

    - `model_dir`: a Hugging Face causal-LM directory; `None` = the embedded synthetic default.
    - `device`: "cpu", "cuda", "cuda:1", ... (never hard-coded elsewhere).
    - `block_size`: tokens per KV block (64 by default).
    - `dtype`: KV/model dtype ("float32", "bfloat16", ...); `None` = the checkpoint's own (fp32 embedded).
    - `batch_invariant`: when on, decode computes every request alone, so a request's logits do not depend
      on which other requests share its step (field case B27). Off by default. It does NOT make a warm
      (cache-hit) run bit-identical to a cold run in general: that holds only where the kernels agree
      (we measured it for fp32 on CPU; see README "Model runner and cost model").
    """

    model_dir: Path | None = None
    device: str = "cpu"
    block_size: int = 64
    dtype: str | None = None
    batch_invariant: bool = False

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return check_device(value)
