"""Tokenizers: a byte-level one for the embedded model, and a wrapper around a HF tokenizer directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvpool.errors import InvalidArgument

BYTE_VOCAB = 256
"""Ids 0..255 are raw UTF-8 bytes; specials follow."""


class Tokenizer(Protocol):
    """Text <-> token ids. `encode` prepends BOS when the model has one (and `add_bos`)."""

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS, EOS, PAD (ids 256, 257, 258 for the embedded model).

    `decode` skips ids >= 256 and replaces invalid UTF-8 (a synthetic model emits arbitrary bytes).
    """

    def __init__(self, *, bos_token_id: int | None, eos_token_id: int | None, vocab_size: int) -> None:
        if vocab_size < BYTE_VOCAB:
            raise InvalidArgument(f"a byte tokenizer needs vocab_size >= {BYTE_VOCAB}, got {vocab_size}")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < BYTE_VOCAB).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `transformers.AutoTokenizer` loaded from the model directory."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_bos))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(model_dir: Path, config: Any) -> Tokenizer:
    """The directory's own tokenizer when it has one, else a byte-level tokenizer from `config`'s ids."""
    if any((model_dir / name).is_file() for name in _HF_TOKENIZER_FILES):
        return HFTokenizer(model_dir)
    eos = config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ByteTokenizer(
        bos_token_id=config.bos_token_id, eos_token_id=eos, vocab_size=int(config.vocab_size)
    )
