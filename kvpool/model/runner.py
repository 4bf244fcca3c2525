"""The model runner: load a checkpoint (or the embedded model), prefill, batched decode, KV exchange.

Shapes: token ids are Python ints; logits are fp32 `[vocab]` (prefill) or `[batch, vocab]` (decode);
KV is held in `KVPrefix` (see kv.py) on the runner's device in the model's dtype.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvpool.errors import FailedPrecondition, InvalidArgument, NotFound
from kvpool.hashing import Namespace
from kvpool.model.arch import check_architecture, kv_dims
from kvpool.model.attention import prefix_prefill
from kvpool.model.attention import register as register_prefix_attention
from kvpool.model.digest import weights_digest
from kvpool.model.embedded import embedded_model_dir, read_marker
from kvpool.model.kv import BlockBytes, KVPrefix, gather_blocks, scatter_blocks
from kvpool.model.sampling import make_generator, sample_next
from kvpool.model.settings import DEFAULT_MAX_MODEL_LEN
from kvpool.model.tokenizer import Tokenizer, load_tokenizer
from kvpool.prompt import reusable_tokens
from kvpool.sampling import SamplingParams
from kvpool.types import KVLayout

log = logging.getLogger(__name__)
_FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"


def _resolve_dtype(dtype: str | None, config: Any) -> torch.dtype:
    name = dtype or str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise InvalidArgument(f"unknown model dtype {name!r}")
    return value


def _layout_and_config(path: Path, block_size: int, dtype: str | None) -> tuple[KVLayout, Any]:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise NotFound(f"no config.json in model directory {path}")
    config = AutoConfig.from_pretrained(str(path))
    check_architecture(config)
    torch_dtype = _resolve_dtype(dtype, config)
    num_layers, kv_heads, head_dim = kv_dims(config)
    try:
        layout = KVLayout(
            dtype=str(torch_dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=num_layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return layout, config


def model_layout(model_dir: str | Path | None, *, block_size: int = 64, dtype: str | None = None) -> KVLayout:
    """The KV layout `ModelRunner.load(model_dir, block_size=..., dtype=...)` will have, from the model
    directory's `config.json` alone (no weights are read; None = the embedded model, created on first
    use). Raises what `load` raises before it reads weights: `NotFound`, `FailedPrecondition`,
    `InvalidArgument`."""
    path = Path(model_dir) if model_dir is not None else embedded_model_dir()
    return _layout_and_config(path, block_size, dtype)[0]


class ModelRunner:
    """One loaded causal LM with full attention on every layer, and its KV layout.

    Attributes: `layout` (KVLayout), `model_id`, `weights_version` (digest of the weight files), `device`,
    `synthetic` (True for the embedded model: its weights are random), `vocab_size`, `eos_token_id`,
    `bos_token_id`, `num_params`, `batch_invariant` (decode computes each request alone; B27),
    `max_model_len` (tokens of context: prompt + generated).
    Not thread-safe: one forward at a time (callers serialise).
    """

    def __init__(
        self,
        *,
        model: Any,
        config: Any,
        tokenizer: Tokenizer,
        layout: KVLayout,
        model_id: str,
        weights_version: str,
        device: str,
        synthetic: bool,
        batch_invariant: bool = False,
    ) -> None:
        self._model = model
        self.config = config
        self.tokenizer = tokenizer
        self.layout = layout
        self.model_id = model_id
        self.weights_version = weights_version
        self.device = device
        self.synthetic = synthetic
        self.batch_invariant = batch_invariant
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN)
        eos = config.eos_token_id
        self.eos_token_id: int | None = eos[0] if isinstance(eos, list) and eos else eos
        self.bos_token_id: int | None = config.bos_token_id
        self.num_params = sum(p.numel() for p in model.parameters())
        self.num_layer_params = sum(p.numel() for p in model.model.layers.parameters())

    @classmethod
    def load(
        cls,
        model_dir: Path | str | None = None,
        *,
        device: str = "cpu",
        block_size: int = 64,
        dtype: str | None = None,
        model_id: str | None = None,
        batch_invariant: bool = False,
        attn_implementation: str = "sdpa",
    ) -> ModelRunner:
        """Load a HF causal-LM directory (None = the embedded synthetic default, created on first use).

        Raises `NotFound` (no config.json / weights), `FailedPrecondition` (sliding-window, MLA, hybrid or
        recurrent architecture), `InvalidArgument` (bad dtype or block_size).
        """
        from transformers import AutoModelForCausalLM

        if torch.device(device).type == "cpu":
            # transformers' SDPA path expands grouped KV heads with `repeat_kv` (a copy of the whole cache
            # per layer per forward) whenever a mask is present; torch's CPU kernel takes grouped heads
            # natively (`enable_gqa`), which halves the memory traffic of a suffix over a long prefix.
            # CUDA keeps the default: there a masked GQA call falls back to the math kernel.
            os.environ.setdefault(_FORCE_GQA_ENV, "1")

        path = Path(model_dir) if model_dir is not None else embedded_model_dir()
        layout, config = _layout_and_config(path, block_size, dtype)
        torch_dtype = getattr(torch, layout.dtype)
        version = weights_digest(path)
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        if attn_implementation == "sdpa":  # SDPA, with a prefill over a cached prefix split in two
            attn_implementation = register_prefix_attention()  # unmasked calls (kvpool/model/attention.py)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch_dtype, attn_implementation=attn_implementation
            )
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        model.to(device)  # type: ignore[arg-type]
        model.eval()
        marker = read_marker(path)
        runner = cls(
            model=model,
            config=model.config,
            tokenizer=load_tokenizer(path, model.config),
            layout=layout,
            model_id=model_id or (marker["model_id"] if marker else path.name),
            weights_version=version,
            device=device,
            synthetic=bool(marker and marker.get("synthetic")),
            batch_invariant=batch_invariant,
        )
        runner._probe()
        log.info("%s", runner.describe())
        return runner

    def describe(self) -> str:
        """One line for logs and banners; says plainly when the weights are synthetic."""
        kind = (
            "SYNTHETIC random weights (embedded demo model; output is not language)"
            if self.synthetic
            else "checkpoint"
        )
        return (
            f"model {self.model_id} [{kind}] weights {self.weights_version[:12]} on {self.device}, "
            f"{self.num_params / 1e6:.2f}M params, KV {self.layout.fingerprint()} "
            f"({self.layout.token_nbytes} B/token, {self.layout.block_nbytes} B/block)"
        )

    def _probe(self) -> None:
        """Run 2 tokens and check the cache really is per-token full-attention KV of `layout`'s shape."""
        _, prefix = self.prefill([0, 1])
        want = (1, self.layout.num_kv_heads, 2, self.layout.head_dim)
        if len(prefix.layers) != self.layout.num_layers or any(
            tuple(k.shape) != want or tuple(v.shape) != want for k, v in prefix.layers
        ):
            raise FailedPrecondition(
                f"{self.model_id}: the model's cache does not match {self.layout.fingerprint()}"
            )

    def namespace(self, *, cache_salt: str = "", adapter_digest: str = "") -> Namespace:
        """The namespace of this model's blocks (model id, weights digest, layout, salt, adapter)."""
        return Namespace(
            model_id=self.model_id,
            weights_version=self.weights_version,
            layout=self.layout,
            cache_salt=cache_salt,
            adapter_digest=adapter_digest,
        )

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def _check_ids(self, token_ids: Sequence[int]) -> torch.Tensor:
        if len(token_ids) == 0:
            raise InvalidArgument(
                "prefill needs at least one token (the last prompt token is always computed)"
            )
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise InvalidArgument(f"token ids must be in [0, {self.vocab_size})")
        return ids.to(self.device)

    def prefill(
        self, token_ids: Sequence[int], prefix: KVPrefix | None = None
    ) -> tuple[torch.Tensor, KVPrefix]:
        """Compute `token_ids` (>= 1 of them) on top of `prefix` (positions continue at `prefix.num_tokens`).

        Returns the last position's logits (fp32 `[vocab]`) and a new prefix of
        `prefix.num_tokens + len(token_ids)` tokens; `prefix` itself is unchanged.
        """
        ids = self._check_ids(token_ids)
        # On top of a prefix, attention to it and within the new tokens run as two unmasked kernel calls
        # (kvpool/model/attention.py): the masked kernel made a partial hit slower than a miss.
        return self._forward(ids, prefix or KVPrefix.empty())

    def _forward(self, ids: torch.Tensor, prefix: KVPrefix) -> tuple[torch.Tensor, KVPrefix]:
        cache = prefix.to_cache(self.config)
        pos = torch.arange(prefix.num_tokens, prefix.num_tokens + len(ids), device=self.device)
        with torch.inference_mode(), prefix_prefill():
            out = self._model(
                input_ids=ids[None], position_ids=pos[None], cache=cache, use_cache=True, logits_to_keep=1
            )
        return out.logits[0, -1].float(), KVPrefix.from_cache(out.cache)

    def prefill_prompt(
        self, prompt_ids: Sequence[int], prefix: KVPrefix | None = None
    ) -> tuple[torch.Tensor, KVPrefix]:
        """Prefill a whole prompt whose first `prefix.num_tokens` tokens are cached in `prefix`.

        The last prompt token is always computed (field case B06): a prefix covering the whole prompt is
        truncated to `len(prompt_ids) - 1` tokens first, never re-run on top of itself.
        """
        if len(prompt_ids) == 0:
            raise InvalidArgument("empty prompt")
        prefix = prefix or KVPrefix.empty()
        if prefix.num_tokens > len(prompt_ids):
            raise InvalidArgument(f"prefix of {prefix.num_tokens} tokens is longer than the prompt")
        reused = reusable_tokens(prefix.num_tokens, len(prompt_ids))
        return self.prefill(prompt_ids[reused:], prefix.truncated(reused))

    def decode_step(self, batch: Sequence[tuple[KVPrefix, int]]) -> tuple[torch.Tensor, list[KVPrefix]]:
        """One decode step for several requests: each `(cache, last_token)` appends `last_token`.

        Caches of different lengths are left-padded with zeros and masked; each request's position id is
        its own `num_tokens`. Returns fp32 logits `[batch, vocab]` and the extended prefixes (inputs are
        unchanged). With `batch_invariant`, requests are computed one by one instead.
        """
        if not batch:
            raise InvalidArgument("decode_step needs at least one request")
        if len(batch) == 1 or self.batch_invariant:
            results = [self.prefill([tok], prefix) for prefix, tok in batch]
            return torch.stack([r[0] for r in results]), [r[1] for r in results]
        ids = self._check_ids([tok for _, tok in batch])
        lens = [p.num_tokens for p, _ in batch]
        width = max(lens)
        b, lay = len(batch), self.layout
        dtype = getattr(torch, lay.dtype)
        from transformers import DynamicCache

        cache = DynamicCache(config=self.config)
        if width:
            for li in range(lay.num_layers):
                shape = (b, lay.num_kv_heads, width, lay.head_dim)
                keys = torch.zeros(shape, dtype=dtype, device=self.device)
                values = torch.zeros(shape, dtype=dtype, device=self.device)
                for i, (prefix, _) in enumerate(batch):
                    if prefix.num_tokens:
                        keys[i, :, width - prefix.num_tokens :] = prefix.layers[li][0][0]
                        values[i, :, width - prefix.num_tokens :] = prefix.layers[li][1][0]
                cache.update(keys, values, li)
        mask = torch.zeros((b, width + 1), dtype=torch.long, device=self.device)
        for i, n in enumerate(lens):
            mask[i, width - n :] = 1
        pos = torch.tensor(lens, dtype=torch.long, device=self.device)[:, None]
        with torch.inference_mode():
            out = self._model(
                input_ids=ids[:, None], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True
            )
        new = [(layer.keys[:, :, -1:], layer.values[:, :, -1:]) for layer in out.cache.layers]
        prefixes = []
        for i, (prefix, _) in enumerate(batch):
            layers = []
            for li, (nk, nv) in enumerate(new):
                k_i, v_i = nk[i : i + 1], nv[i : i + 1]
                if prefix.num_tokens:
                    k_i = torch.cat((prefix.layers[li][0], k_i), dim=2)
                    v_i = torch.cat((prefix.layers[li][1], v_i), dim=2)
                layers.append((k_i, v_i))
            prefixes.append(KVPrefix(tuple(layers), prefix.num_tokens + 1))
        return out.logits[:, -1].float(), prefixes

    def prefix_from_blocks(self, blocks: Sequence[BlockBytes], base: KVPrefix | None = None) -> KVPrefix:
        """Scatter pool blocks (each `layout.block_nbytes` bytes) into a prefix after `base`; see kv.py."""
        return scatter_blocks(blocks, self.layout, self.device, base)

    def blocks_from_prefix(self, prefix: KVPrefix, start_block: int, end_block: int) -> list[np.ndarray]:
        """Gather full blocks `[start_block, end_block)` as contiguous CPU uint8 arrays; see kv.py."""
        return gather_blocks(prefix, self.layout, start_block, end_block)

    def generate(
        self,
        prompt_ids: Sequence[int],
        prefix: KVPrefix | None = None,
        params: SamplingParams | None = None,
        generator: torch.Generator | None = None,
    ) -> list[int]:
        """Prefill (reusing `prefix` for the prompt's first tokens) then decode one request.

        Stops after `params.max_tokens` tokens or at EOS / a stop token (not included in the result).
        """
        params = params or SamplingParams()
        if generator is None and not params.greedy:
            generator = make_generator(params)
        logits, cache = self.prefill_prompt(prompt_ids, prefix)
        stops = set(params.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        out: list[int] = []
        while True:
            tok = sample_next(logits, params, generator)
            if tok in stops:
                break
            out.append(tok)
            if len(out) >= params.max_tokens:
                break
            step_logits, caches = self.decode_step([(cache, tok)])
            logits, cache = step_logits[0], caches[0]
        return out


def load_runner(
    model_dir: Path | str | None = None,
    *,
    device: str = "cpu",
    block_size: int = 64,
    dtype: str | None = None,
    batch_invariant: bool = False,
) -> ModelRunner:
    """Same as `ModelRunner.load` (kept as a function for CLI wiring)."""
    return ModelRunner.load(
        model_dir, device=device, block_size=block_size, dtype=dtype, batch_invariant=batch_invariant
    )
