"""The model section of a prefill/decode node's settings (no torch import)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import field_validator

from kvpool.config import KVPoolSettings
from kvpool.errors import InvalidArgument, NotFound

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_MODEL_LEN = 32_768
"""A model's context when its config.json names no `max_position_embeddings` (the runner's and router's)."""


def check_device(value: str) -> str:
    """`value` if torch can name it as a device and this machine can use it; else `ValueError` (a settings
    error naming `device`, before a node loads its model and opens its ports, or a command starts any)."""
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{value!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    reason = unusable_device_reason(dev)
    if reason:
        raise ValueError(f"{value!r} is a torch device this machine cannot use: {reason}")
    return value


def unusable_device_reason(dev: torch.device) -> str | None:
    """Why this machine cannot put tensors on `dev`, or None when it can (torch can name every device its
    build knows: `cuda` on a CPU-only build, `cuda:3` on a 1-GPU host, `mps` off a Mac)."""
    import torch

    if dev.type == "cpu":
        return None
    module = getattr(torch, dev.type, None)  # torch.cuda, torch.mps, torch.xpu, ...
    if dev.type == "cuda":
        built = torch.backends.cuda.is_built()
    elif dev.type == "mps":
        module, built = torch.backends.mps, torch.backends.mps.is_built()
    else:
        built = module is not None
    is_available = getattr(module, "is_available", None)
    if not built or is_available is None:
        return f"this torch ({torch.__version__}) has no {dev.type} support"
    if not is_available():
        return f"no {dev.type} device is available"
    device_count = getattr(getattr(torch, dev.type, None), "device_count", None)
    count = int(device_count()) if device_count is not None else 1
    if dev.index is not None and dev.index >= count:
        return f"index {dev.index} is out of range: this machine has {count} {dev.type} device(s)"
    return None


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


def model_context_len(model_dir: str | Path | None) -> int:
    """`max_position_embeddings` of a model directory's config.json (None = the embedded model), read
    without torch or loading weights; `NotFound` without a config.json (as the runner), `InvalidArgument`
    when it is not JSON."""
    if model_dir is None:
        from kvpool.model.embedded import DEFAULT_SPEC

        return DEFAULT_SPEC.max_position_embeddings
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotFound(f"no config.json in model directory {path.parent}") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"cannot read {path}: {exc}") from None
    cfg = (raw.get("text_config") or raw) if isinstance(raw, dict) else {}
    return int(cfg.get("max_position_embeddings") or DEFAULT_MAX_MODEL_LEN)
