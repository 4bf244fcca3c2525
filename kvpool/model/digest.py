"""The weights version of a model directory: a content digest of its weight files (no torch import).

Shared by the model runner (nodes) and the router, which must compute identical namespaces.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvpool.errors import NotFound


def weights_digest(model_dir: Path) -> str:
    """BLAKE2b-128 hex over the weight files (`*.safetensors`, else `*.bin`), names and bytes, sorted.

    Raises `NotFound` when the directory holds no weight file.
    """
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not files:
        raise NotFound(f"no weight files (*.safetensors, *.bin) in {model_dir}")
    h = hashlib.blake2b(digest_size=16, person=b"kvpool-weights")
    for path in files:
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()
