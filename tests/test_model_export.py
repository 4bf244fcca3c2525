"""`kvpool model export`: the embedded model plus a HF fast tokenizer with kvpool's byte-level ids."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")

from typer.testing import CliRunner  # noqa: E402

from kvpool.cli.main import app  # noqa: E402
from kvpool.errors import AlreadyExists, InvalidArgument  # noqa: E402
from kvpool.model.digest import weights_digest  # noqa: E402
from kvpool.model.embedded import DEFAULT_SPEC, MARKER_FILE, EmbeddedSpec, embedded_model_dir  # noqa: E402
from kvpool.model.export import CHAT_TEMPLATE, export_model_dir  # noqa: E402
from kvpool.model.tokenizer import ByteTokenizer  # noqa: E402
from kvpool.router.model_info import ModelInfo, simple_chat_prompt  # noqa: E402

BYTES = ByteTokenizer(bos_token_id=256, eos_token_id=257, vocab_size=259)
TEXTS = [
    "hello world",
    "The quick brown fox, it's 42. (ok?)",
    "é",
    "naïve café",
    "日本語のテキスト",
    "emoji 🎉👩‍👩‍👧 flag 🇫🇷",
    "",
    " ",
    "  leading and trailing  ",
    "a\nb\r\n\tc\n\n",
    "<|user|>\nhi\n",
    "x" * 3000,
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvpool-cache")


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    return export_model_dir(tmp_path_factory.mktemp("export") / "model", cache_dir=cache_dir)


@pytest.fixture(scope="module")
def hf_tok(exported: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(exported))


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_the_byte_tokenizer(hf_tok: Any, text: str) -> None:
    assert hf_tok.encode(text) == BYTES.encode(text, add_bos=True)
    assert hf_tok(text)["input_ids"] == BYTES.encode(text, add_bos=True)
    assert hf_tok.encode(text, add_special_tokens=False) == BYTES.encode(text, add_bos=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(hf_tok: Any, text: str) -> None:
    ids = BYTES.encode(text) + [257, 258]
    assert hf_tok.decode(ids, skip_special_tokens=True) == BYTES.decode(ids) == text


def test_decode_of_arbitrary_bytes_equals_the_byte_tokenizer(hf_tok: Any) -> None:
    """A synthetic model emits any byte: invalid UTF-8 becomes U+FFFD exactly as `ByteTokenizer` does."""
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(259) for _ in range(rng.randrange(1, 24))]
        assert hf_tok.decode(ids, skip_special_tokens=True) == BYTES.decode(ids), ids


def test_vocab_and_special_tokens(hf_tok: Any) -> None:
    assert len(hf_tok) == DEFAULT_SPEC.vocab_size == 259
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (256, 257, 258)
    assert [hf_tok.convert_ids_to_tokens(i) for i in (256, 257, 258)] == ["<s>", "</s>", "<pad>"]


def test_literal_special_strings_are_special_tokens(hf_tok: Any) -> None:
    """The one documented difference from `ByteTokenizer`: HF parses `<s>` in text as BOS."""
    assert hf_tok.encode("<s>", add_special_tokens=False) == [256]
    assert BYTES.encode("<s>", add_bos=False) == [60, 115, 62]


def test_chat_template_is_kvpools_documented_one(hf_tok: Any, exported: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo\nthere"}]
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>" + simple_chat_prompt(messages)
    assert hf_tok.chat_template == CHAT_TEMPLATE
    info = ModelInfo.load(exported, block_size=64)  # the router takes the directory's template
    assert info.chat_prompt_ids(messages) == BYTES.encode(simple_chat_prompt(messages), add_bos=True)


def test_weights_and_namespace_equal_the_embedded_model(exported: Path, cache_dir: Path) -> None:
    source = embedded_model_dir(DEFAULT_SPEC, cache_dir=cache_dir)
    assert weights_digest(exported) == weights_digest(source)
    assert (exported / MARKER_FILE).read_bytes() == (source / MARKER_FILE).read_bytes()
    names = {p.name for p in exported.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        MARKER_FILE,
    } <= names
    gen = json.loads((exported / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (256, 257, 258)
    a, b = ModelInfo.load(exported, block_size=64), ModelInfo.load(source, block_size=64)
    assert a.namespace_id("") == b.namespace_id("") and a.synthetic


def test_kvpool_runner_loads_the_export(exported: Path, cache_dir: Path) -> None:
    from kvpool.model import ModelRunner, SamplingParams

    runner = ModelRunner.load(exported)
    info = ModelInfo.load(embedded_model_dir(DEFAULT_SPEC, cache_dir=cache_dir), block_size=64)
    assert runner.namespace().digest() == info.namespace_id("")
    ids = runner.encode("héllo 日本")
    assert ids == BYTES.encode("héllo 日本") and runner.decode(ids) == "héllo 日本"
    assert len(runner.generate(ids, params=SamplingParams(max_tokens=2))) == 2


def test_refuses_a_non_empty_directory_unless_forced(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(AlreadyExists):
        export_model_dir(out, cache_dir=cache_dir)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    export_model_dir(out, force=True, cache_dir=cache_dir)
    assert (out / "tokenizer.json").is_file() and (out / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(AlreadyExists):
        export_model_dir(tmp_path / "file", force=True, cache_dir=cache_dir)


def test_refuses_a_vocab_other_than_bytes_plus_three(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        export_model_dir(tmp_path / "m", spec=EmbeddedSpec(vocab_size=300))
    assert not (tmp_path / "m").exists()


def test_cli_export(tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(cache_dir))
    out = tmp_path / "cli-model"
    result = CliRunner().invoke(app, ["model", "export", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[0] == str(out.resolve())
    assert lines[1].startswith(
        "HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 python -m vllm.entrypoints.openai.api_server"
    )
    assert "--dtype float32 --block-size 64" in lines[1] and DEFAULT_SPEC.model_id in lines[1]
    assert '"kv_connector": "KVPoolConnector"' in lines[1] and '"master": "127.0.0.1:50051"' in lines[1]
    assert (out / "tokenizer.json").is_file()
    again = CliRunner().invoke(app, ["model", "export", str(out)])
    assert again.exit_code == 1 and "AlreadyExists" in again.output
    assert CliRunner().invoke(app, ["model", "export", str(out), "--force"]).exit_code == 0
