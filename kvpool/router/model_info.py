"""What the router needs of the model, without torch: its namespace fields, tokenizer and chat template.

The router hashes prompts exactly as the nodes do, so it needs the same namespace (model id, weights
digest, KV layout). They are read from the model directory's `config.json` and weight files (the same
rules as `kvpool.model.runner.ModelRunner.load`; a test checks both agree), never by loading weights.

Chat template: a directory whose tokenizer has a chat template uses it (`apply_chat_template`). The
embedded byte-level model has none; its documented template is

    <|system|>\\n{content}\\n          (one block per message, in order; role = system|user|assistant|tool)
    <|user|>\\n{content}\\n
    <|assistant|>\\n                   (appended: the generation prompt)

encoded as UTF-8 bytes after BOS.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvpool.errors import InvalidArgument, NotFound
from kvpool.hashing import Namespace
from kvpool.model.digest import weights_digest
from kvpool.types import KVLayout, NamespaceId

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def simple_chat_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The documented template of a model without one (see the module docstring)."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model_id: str
    weights_version: str
    layout: KVLayout
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    tokenizer: Any
    synthetic: bool

    @classmethod
    def load(cls, model_dir: str | Path | None, *, block_size: int) -> ModelInfo:
        """Read `model_dir` (None = the embedded model). `NotFound` / `InvalidArgument` on a bad directory."""
        from kvpool.model.embedded import embedded_model_dir, read_marker
        from kvpool.model.tokenizer import load_tokenizer

        path = Path(model_dir) if model_dir is not None else embedded_model_dir()
        try:
            raw = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise NotFound(f"no config.json in model directory {path}") from None
        cfg = raw.get("text_config") or raw
        heads = int(cfg["num_attention_heads"])
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix("torch.")
        try:
            layout = KVLayout(
                dtype=dtype,
                block_size=block_size,
                num_layers=int(cfg["num_hidden_layers"]),
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
            )
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        marker = read_marker(path)
        eos = raw.get("eos_token_id", cfg.get("eos_token_id"))
        eos = eos[0] if isinstance(eos, list) and eos else eos
        conf = SimpleNamespace(
            bos_token_id=raw.get("bos_token_id", cfg.get("bos_token_id")),
            eos_token_id=eos,
            vocab_size=int(cfg["vocab_size"]),
        )
        return cls(
            model_id=marker["model_id"] if marker else path.name,
            weights_version=weights_digest(path),
            layout=layout,
            vocab_size=int(cfg["vocab_size"]),
            max_model_len=int(cfg.get("max_position_embeddings") or 32768),
            eos_token_id=eos,
            tokenizer=load_tokenizer(path, conf),
            synthetic=bool(marker and marker.get("synthetic")),
        )

    def namespace(self, cache_salt: str) -> Namespace:
        return Namespace(
            model_id=self.model_id,
            weights_version=self.weights_version,
            layout=self.layout,
            cache_salt=cache_salt,
        )

    def namespace_id(self, cache_salt: str) -> NamespaceId:
        return self.namespace(cache_salt).digest()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_bos=True))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    def chat_prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a chat: the tokenizer's own template when it has one, else `simple_chat_prompt`."""
        hf = getattr(self.tokenizer, "_tok", None)
        if hf is not None and getattr(hf, "chat_template", None):
            ids = hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return list(self.tokenizer.encode(simple_chat_prompt(messages), add_bos=True))
