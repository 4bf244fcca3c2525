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

`W` (`compute_wait_s`) is how long this request waits for the model whatever it decides: the forwards
queued ahead of it on this node (`kvpool.cost.compute_queue.ComputeQueue`). A load runs during that wait,
so a choice finishes after `max((1 + margin)·load(k), W) + compute(k)` and recomputing after
`W + compute(0)`: a load the queue hides costs nothing, and a burst whose link queue makes pulling slower
than one recompute still pulls while the forwards ahead take longer (field case B39; Mooncake's conductor
counts the prefill queue in TTFT the same way, FAST'25 §6). `W = 0` (a node that knows no queue, or an
idle one) is the plain comparison above.
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
    - `predicted_load_s`, `predicted_compute_s`, `predicted_total_s` (decision to first token:
      max(load, compute_wait) + compute, no margin), `predicted_recompute_all_s` (the forward with no
      reuse, no wait), `predicted_saving_s` (= compute_wait + recompute_all − total).
    - `load_deadline_s`: abandon the pull after this long and recompute the rest (see `load_deadline_s`).
    - `reason`: "no_hit" | "load_all" | "load_partial" | "recompute_cheaper".
    - `queued_bytes`: bytes of pulls in flight on the link the prediction waited behind.
    - `compute_wait_s`: seconds of forwards queued ahead on the model, which a load overlaps.
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
    compute_wait_s: float = 0.0

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
    compute_wait_s: float = 0.0,
    min_s: float = 0.002,
) -> float:
    """How long a load may run before it is abandoned (then the missing span is recomputed).

    The pull was chosen because `max(load, wait) + compute_rest < wait + recompute_all`; once it has run
    `wait + recompute_all − compute_rest` seconds every predicted saving is gone, so waiting longer can
    only lose. Abandoning there bounds the worst case at about `wait + 2 × recompute_all`. Never below the
    predicted load itself nor `min_s` (timer granularity).
    """
    budget = compute_wait_s + predicted_recompute_all_s - predicted_compute_s
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
    compute_wait_s: float = 0.0,
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
        compute_wait_s: seconds of forwards queued ahead of this request on the model (>= 0, finite),
            which a load overlaps (see the module docstring).
    Raises:
        InvalidArgument: negative counts or bytes, `h·block_size > prompt_len`, `num_local_blocks > h`,
            bad margin, a negative or non-finite `compute_wait_s`.
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
    if not 0.0 <= compute_wait_s < float("inf"):
        raise InvalidArgument(f"compute_wait_s must be finite and >= 0, got {compute_wait_s!r}")
    q, wait = queued_bytes, compute_wait_s

    def compute_s(k: int) -> tuple[int, float]:
        n_new = prompt_len - reusable_tokens(k * bs, prompt_len)  # >= 1: the last token (B06)
        return n_new, recompute.t_recompute_s(n_new, prompt_len - n_new)

    recompute_all = recompute.t_recompute_s(prompt_len, 0)
    best_k, best_score = 0, wait + recompute_all
    for k in range(1, h + 1):
        load_k = _load_s(k, num_local_blocks, block_nbytes, link, local_link, q)
        score = max((1.0 + margin) * load_k, wait) + compute_s(k)[1]
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
        predicted_total_s=max(load, wait) + compute,
        predicted_recompute_all_s=recompute_all,
        predicted_saving_s=wait + recompute_all - max(load, wait) - compute,
        load_deadline_s=load_deadline_s(load, compute, recompute_all, compute_wait_s=wait),
        margin=margin,
        reason=reason,
        queued_bytes=q,
        compute_wait_s=wait,
    )
