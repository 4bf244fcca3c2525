"""Export the embedded model as a self-contained Hugging Face directory that vLLM serves with no download.

The directory holds the embedded model's files (config.json, model.safetensors, `kvpool_embedded.json`,
byte-identical to `embedded_model_dir(spec)`, hence the same weights digest and namespace), a
generation_config.json, and a Hugging Face *fast* tokenizer (tokenizer.json, tokenizer_config.json,
special_tokens_map.json) that gives the ids of kvpool's `ByteTokenizer`:

- `encode(text)` = [256 (BOS `<s>`), *UTF-8 bytes]; ids 0..255 are bytes, 257 is EOS `</s>`, 258 PAD `<pad>`.
  It is a `tokenizers` BPE whose vocab maps GPT-2's byte-level alphabet so that byte b is id b, with no
  merges, a ByteLevel pre-tokenizer (no prefix space, no regex split) and decoder, and a post-processor
  that prepends `<s>`. One difference remains: like every HF tokenizer it parses the literal strings
  `<s>`, `</s>` and `<pad>` in text as the special tokens, where `ByteTokenizer` encodes their bytes.
- `decode` skips the special ids and replaces invalid UTF-8, as `ByteTokenizer.decode` does.
- The chat template renders kvpool's documented template (`kvpool.router.model_info.simple_chat_prompt`)
  after BOS, so `/v1/chat/completions` of vLLM and of the kvpool router give the same prompt ids.

kvpool's own nodes load the directory too (`kvpool prefill --model DIR`); `load_tokenizer` then picks the
HF tokenizer, which gives the same ids as the byte tokenizer.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
from pathlib import Path
from typing import Any

from kvpool.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from kvpool.model.digest import weights_digest
from kvpool.model.embedded import DEFAULT_SPEC, MARKER_FILE, EmbeddedSpec, embedded_model_dir
from kvpool.model.tokenizer import BYTE_VOCAB

log = logging.getLogger(__name__)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_IDS = {BOS: 256, EOS: 257, PAD: 258}
MODEL_FILES = ("config.json", "model.safetensors", MARKER_FILE)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""kvpool's documented chat template (`simple_chat_prompt`): one `<|role|>\\n{content}\\n` per message."""


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 bytes to printable characters (the ByteLevel alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted = [b for b in range(256) if b not in printable]
    mapping = {b: chr(b) for b in printable}
    mapping.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return mapping


def build_byte_tokenizer() -> Any:
    """A `tokenizers.Tokenizer` with the ids of `ByteTokenizer` (BOS 256 prepended; EOS 257; PAD 258)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    mapping = byte_to_unicode()
    if set(mapping.values()) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise FailedPrecondition("this tokenizers version has another ByteLevel alphabet than GPT-2's")
    vocab = {char: byte for byte, char in mapping.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_IDS])
    got = {t: tok.token_to_id(t) for t in SPECIAL_IDS}
    if got != SPECIAL_IDS:
        raise FailedPrecondition(f"special tokens got ids {got}, expected {SPECIAL_IDS}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 $B:1", special_tokens=[(BOS, SPECIAL_IDS[BOS])]
    )
    return tok


def _tokenizer_config(spec: EmbeddedSpec) -> dict[str, Any]:
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in SPECIAL_IDS.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def export_model_dir(
    out_dir: Path, *, spec: EmbeddedSpec = DEFAULT_SPEC, force: bool = False, cache_dir: Path | None = None
) -> Path:
    """Write the embedded model `spec` with a HF fast tokenizer and chat template into `out_dir`.

    The weights come from `embedded_model_dir(spec, cache_dir=cache_dir)` (created on first use) and are
    copied byte for byte: the exported directory has the same weights digest, model id and namespace.

    Args:
        out_dir: the directory to write; created with its parents when missing.
        spec: the embedded model (its seed picks the weights version).
        force: write into an existing non-empty `out_dir`, replacing the files of the same names and
            leaving any other file in place.
        cache_dir: kvpool's cache root (default `$KVPOOL_CACHE_DIR` or `~/.cache/kvpool`).

    Returns:
        `out_dir`.

    Raises:
        AlreadyExists: `out_dir` is a file, or a non-empty directory and not `force`.
        InvalidArgument: `spec.vocab_size` is not 259 (256 bytes + BOS, EOS, PAD).
        FailedPrecondition: the written weights digest differs from the source's (a stray weight file in
            `out_dir` under `force`), or the `tokenizers` library builds other ids than expected.
    """
    out_dir = Path(out_dir)
    if spec.vocab_size != BYTE_VOCAB + len(SPECIAL_IDS):
        raise InvalidArgument(
            f"the byte tokenizer needs vocab_size {BYTE_VOCAB + len(SPECIAL_IDS)}, got {spec.vocab_size}"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise AlreadyExists(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise AlreadyExists(f"{out_dir} is not empty (force, or --force, writes into it)")
    tokenizer = build_byte_tokenizer()  # before any file is written: a failure leaves out_dir as it was
    source = embedded_model_dir(spec, cache_dir=cache_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        shutil.copyfile(source / name, out_dir / name)
    eos_pad = {
        "bos_token_id": SPECIAL_IDS[BOS],
        "eos_token_id": SPECIAL_IDS[EOS],
        "pad_token_id": SPECIAL_IDS[PAD],
    }
    _write_json(out_dir / "generation_config.json", eos_pad)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(out_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    digest = weights_digest(source)
    if weights_digest(out_dir) != digest:
        raise FailedPrecondition(f"{out_dir} holds other weight files than {source}: remove them")
    log.info("exported %s (weights %s) to %s", spec.name, digest, out_dir)
    return out_dir


def vllm_serve_command(model_dir: Path, *, served_model_name: str, master: str = "127.0.0.1:50051") -> str:
    """The shell command that serves `model_dir` with vLLM's OpenAI server on a CPU, offline, with kvpool's
    connector on the pool whose master is `master` (layout `kv1:float32:b64:l4:h4:d32`, kvpool's default).
    `VLLM_CPU_KVCACHE_SPACE` (GiB) sizes vLLM's CPU KV cache: its default takes ~92 % of the host's memory."""
    kv = json.dumps(
        {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"master": master},
        }
    )
    return (
        "HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 python -m vllm.entrypoints.openai.api_server"
        f" --model {shlex.quote(str(model_dir))} --dtype float32 --block-size 64 --max-model-len 8192"
        f" --served-model-name {shlex.quote(served_model_name)} --enable-prompt-tokens-details"
        f" --kv-transfer-config {shlex.quote(kv)}"
    )
