"""The pull decision: how many leading hit blocks to load, and how long a load may take.

For a prompt of `prompt_len` tokens whose first `h` full blocks are cached (the first `num_local_blocks`
of them in this node's own memory), loading `k <= h` blocks costs

    load(k)    = t_transfer(min(k, L)·B, local_link) + t_transfer(Q + max(0, k − L)·B, link)  (B = block_nbytes)
    compute(k) = t_recompute(n_new, n_ctx)  with  n_new = max(1, prompt_len − k·block_size),
                                                 n_ctx = prompt_len − n_new

The prompt's last token is always computed (field case B06): a fully covered prompt computes 1 token on
the cache truncated to `prompt_len − 1`. Remote blocks travel in one batched request (one alpha). Load and
compute are not overlapped (a conservative sum; Mooncake overlaps them layer-wise). We pick
`k* = argmin (1 + margin)·load(k) + compute(k)` (ties: fewer loads). Sources: SGLang (arXiv 2312.07104),
Mooncake (FAST'25, arXiv 2407.00079).

`Q` (`queued_bytes`) is what pulls already in flight on the same link still have to move
(`kvpool.cost.inflight.PullLedger`). A remote load waits behind it, so a burst of requests on one prefix
stops pulling once the queue makes that slower than recomputing (field case B39). Q counts only when
k > L: a local-only load crosses no link.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvpool.cost.link import LOCAL_LINK, LinkLike, t_transfer_s
from kvpool.cost.recompute import RecomputeModel
from kvpool.errors import InvalidArgument
from kvpool.prompt import reusable_tokens

DEFAULT_MARGIN = 0.25
"""Loads are predicted 25 % slower than calibrated when compared with recompute (a safety margin)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReuseDecision:
    """One pull decision and its predictions (seconds). `to_dict()` feeds metrics and benchmarks.

    - `num_load_blocks`: leading blocks to load (`num_local_used` from this node, the rest pulled).
    - `reused_tokens` / `computed_tokens`: from cache / computed (`computed_tokens >= 1`).
    - `predicted_load_s`, `predicted_compute_s`, `predicted_total_s` (= load + compute, no margin),
      `predicted_recompute_all_s` (no reuse at all), `predicted_saving_s` (= recompute_all − total).
    - `load_deadline_s`: abandon the pull after this long and recompute the rest (see `load_deadline_s`).
    - `reason`: "no_hit" | "load_all" | "load_partial" | "recompute_cheaper".
    - `queued_bytes`: bytes of pulls in flight on the link the prediction waited behind.
    """

    num_hit_blocks: int
    num_load_blocks: int
    num_local_used: int
    num_remote_used: int
    reused_tokens: int
    computed_tokens: int
    predicted_load_s: float
    predicted_compute_s: float
    predicted_total_s: float
    predicted_recompute_all_s: float
    predicted_saving_s: float
    load_deadline_s: float
    margin: float
    reason: str
    queued_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _load_s(
    k: int, local: int, block_nbytes: int, link: LinkLike, local_link: LinkLike, queued: int = 0
) -> float:
    n_local = min(k, local)
    remote = (k - n_local) * block_nbytes
    wire = queued + remote if remote else 0  # nothing remote: no round trip and no queue to wait behind
    return t_transfer_s(n_local * block_nbytes, local_link) + t_transfer_s(wire, link)


def load_deadline_s(
    predicted_load_s: float,
    predicted_compute_s: float,
    predicted_recompute_all_s: float,
    *,
    min_s: float = 0.002,
) -> float:
    """How long a load may run before it is abandoned (then the missing span is recomputed).

    The pull was chosen because `load + compute_rest < recompute_all`; once it has run
    `recompute_all − compute_rest` seconds every predicted saving is gone, so waiting longer can only lose.
    Abandoning there bounds the worst case at about `2 × recompute_all`. Never below the predicted load
    itself nor `min_s` (timer granularity).
    """
    budget = predicted_recompute_all_s - predicted_compute_s
    return max(min_s, predicted_load_s, budget)


def decide_reuse(
    num_hit_blocks: int,
    block_size: int,
    prompt_len: int,
    block_nbytes: int,
    link: LinkLike,
    recompute: RecomputeModel,
    *,
    num_local_blocks: int = 0,
    local_link: LinkLike = LOCAL_LINK,
    margin: float = DEFAULT_MARGIN,
    queued_bytes: int = 0,
) -> ReuseDecision:
    """Choose how many leading hit blocks to load (see the module docstring for the cost terms).

    Args:
        num_hit_blocks: leading full blocks the pool holds for this prompt (`h`).
        block_size: tokens per block; prompt_len: tokens in the prompt (>= 1).
        block_nbytes: bytes per block (`KVLayout.block_nbytes`).
        link: calibrated remote link (`alpha_s`, `beta_bytes_per_s`); recompute: calibrated prefill model.
        num_local_blocks: how many of the leading hit blocks are in this node's memory (<= h).
        local_link: cost of a node-local block (default free).
        margin: relative safety margin on load time (>= 0).
        queued_bytes: bytes pulls in flight on `link` still have to move (>= 0; see the module docstring).
    Raises:
        InvalidArgument: negative counts or bytes, `h·block_size > prompt_len`, `num_local_blocks > h`,
            bad margin.
    """
    h, bs = num_hit_blocks, block_size
    if prompt_len < 1 or bs < 1 or block_nbytes < 1:
        raise InvalidArgument("prompt_len, block_size and block_nbytes must be >= 1")
    if h < 0 or h * bs > prompt_len:
        raise InvalidArgument(f"{h} hit blocks of {bs} tokens do not fit a {prompt_len}-token prompt")
    if not 0 <= num_local_blocks <= h:
        raise InvalidArgument(f"num_local_blocks must be in [0, {h}], got {num_local_blocks}")
    if not margin >= 0.0:
        raise InvalidArgument(f"margin must be >= 0, got {margin!r}")
    if queued_bytes < 0:
        raise InvalidArgument(f"queued_bytes must be >= 0, got {queued_bytes}")
    q = queued_bytes

    def compute_s(k: int) -> tuple[int, float]:
        n_new = prompt_len - reusable_tokens(k * bs, prompt_len)  # >= 1: the last token (B06)
        return n_new, recompute.t_recompute_s(n_new, prompt_len - n_new)

    recompute_all = recompute.t_recompute_s(prompt_len, 0)
    best_k, best_score = 0, recompute_all
    for k in range(1, h + 1):
        load_k = _load_s(k, num_local_blocks, block_nbytes, link, local_link, q)
        score = (1.0 + margin) * load_k + compute_s(k)[1]
        if score < best_score:
            best_k, best_score = k, score
    load = _load_s(best_k, num_local_blocks, block_nbytes, link, local_link, q)
    n_new, compute = compute_s(best_k)
    if h == 0:
        reason = "no_hit"
    elif best_k == 0:
        reason = "recompute_cheaper"
    else:
        reason = "load_all" if best_k == h else "load_partial"
    return ReuseDecision(
        num_hit_blocks=h,
        num_load_blocks=best_k,
        num_local_used=min(best_k, num_local_blocks),
        num_remote_used=best_k - min(best_k, num_local_blocks),
        reused_tokens=prompt_len - n_new,
        computed_tokens=n_new,
        predicted_load_s=load,
        predicted_compute_s=compute,
        predicted_total_s=load + compute,
        predicted_recompute_all_s=recompute_all,
        predicted_saving_s=recompute_all - load - compute,
        load_deadline_s=load_deadline_s(load, compute, recompute_all),
        margin=margin,
        reason=reason,
        queued_bytes=q,
    )
