"""What makes one vLLM engine's KV reusable by another: the namespace of a request (docs/design.md "Keys and hashing").

A namespace is built from
- the model: `model_id` (the kvpool marker's id, else the checkpoint directory's name) and
  `weights_version`, the content digest of its weight files (`kvpool.model.digest`), never a path;
- the pool's `KVLayout` (dtype, block size, layers, KV heads, head dim);
- the request's `cache_salt` (tenant isolation);
- the adapter: `adapter_digest` = content digest of every file in the LoRA directory (weights and config),
  never its name or integer id, so two adapters loaded under one name never share KV;
- the engine: `extra = (("engine", "vllm-<version>-<device>-<kernel>"),)`, because two engines' KV for the
  same tokens is not bit-identical (another attention kernel or ISA rounds differently).
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from kvpool.errors import FailedPrecondition, NotFound
from kvpool.hashing import EngineNamespace, Namespace
from kvpool.model.digest import weights_digest
from kvpool.model.embedded import read_marker
from kvpool.types import KVLayout


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """The local directory of `model` (a path, or a Hugging Face repo id already in the local cache).

    Raises `NotFound` when neither exists (kvpool never downloads: the digest must be of what vLLM loaded).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - any hub error means: not available locally
        raise NotFound(
            f"model {model!r} is neither a directory nor in the local Hugging Face cache: {exc}"
        ) from None


def model_identity(model_dir: Path) -> tuple[str, str]:
    """(model_id, weights_version) of a checkpoint directory, as kvpool's own runner names it."""
    marker = read_marker(model_dir)
    model_id = str(marker["model_id"]) if marker else model_dir.name
    return model_id, weights_digest(model_dir)


def directory_digest(path: Path) -> str:
    """BLAKE2b-128 hex over every regular file under `path` (relative names and bytes, sorted).

    Raises `NotFound` when `path` is not a directory or holds no file."""
    if not path.is_dir():
        raise NotFound(f"adapter directory {str(path)!r} does not exist")
    files = sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        raise NotFound(f"adapter directory {str(path)!r} holds no file")
    h = hashlib.blake2b(digest_size=16, person=b"kvpool-adapter")
    for file in files:
        h.update(str(file.relative_to(path)).encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def engine_identity(vllm_version: str, device_type: str, kernel: str) -> str:
    """`vllm-<version>-<device>-<kernel>`: e.g. `vllm-0.32.0-cpu-vec`."""
    return f"vllm-{vllm_version}-{device_type}-{kernel}"


class Namespaces:
    """The namespaces of one engine, by (cache_salt, adapter path). Thread-safe.

    Adapter digests are cached by the directory's (path, newest mtime, total size): a reload of new weights
    at the same path is a new digest, so the old adapter's KV is unreachable at once.
    """

    def __init__(self, *, model_id: str, weights_version: str, layout: KVLayout, engine: str) -> None:
        self.model_id = model_id
        self.weights_version = weights_version
        self.layout = layout
        self.engine = engine
        self._lock = threading.Lock()
        self._adapters: dict[tuple[str, int, int], str] = {}

    def adapter_digest(self, lora_path: str) -> str:
        path = Path(lora_path)
        try:
            stats = [p.stat() for p in path.rglob("*") if p.is_file()]
        except OSError as exc:
            raise NotFound(f"adapter {lora_path!r}: {exc}") from None
        key = (str(path), max((s.st_mtime_ns for s in stats), default=0), sum(s.st_size for s in stats))
        with self._lock:
            digest = self._adapters.get(key)
        if digest is None:
            digest = directory_digest(path)
            with self._lock:
                self._adapters[key] = digest
        return digest

    def namespace(self, *, cache_salt: str | None, lora_path: str | None) -> Namespace:
        """The namespace of a request. Raises `NotFound` for an adapter directory that is gone."""
        return self.base.namespace(cache_salt or "", self.adapter_digest(lora_path) if lora_path else "")

    @property
    def base(self) -> EngineNamespace:
        """What the engine registers with the master, so a router rebuilds the same namespaces."""
        return EngineNamespace(self.model_id, self.weights_version, self.layout.fingerprint(), self.engine)


def check_layout(mine: KVLayout, masters: str) -> None:
    """B23: one pool holds one layout. Raises `FailedPrecondition` naming both when they differ."""
    if mine.fingerprint() != masters:
        raise FailedPrecondition(
            f"this vLLM engine's KV layout {mine.fingerprint()} does not match the pool's {masters} "
            "(start the master and stores with --layout matching the engine's dtype and --block-size)"
        )
