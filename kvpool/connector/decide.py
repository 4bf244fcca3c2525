"""One load's decision: the cost model fed with what the request waits behind (field case B39).

`decide_plan` fills a `LoadPlan`'s choice (how many leading hit blocks to reuse) and its predictions from
`kvpool.cost.decide_reuse`, given the two queues a request meets on a busy node:

- the pull queue of the store links it would load over (`PullLedger`, `kvpool.connector.convoy`): its load
  finishes behind the pulls already decided, at the throughput the link was seen to drain under contention;
- the compute queue of this node's model (`ComputeQueue`): the forwards decided before it run first,
  whatever it decides, and its load runs meanwhile.

A benchmark's forced decision (`KVPOOL_FORCE_DECISION`) overrides the choice and keeps the cost model's
predictions and reason. The connector sets the deadline and registers the pull (`KVConnector._decide`).
"""

from __future__ import annotations

from kvpool.connector.convoy import busiest, contended, peer_bytes
from kvpool.connector.plan import LoadPlan, forced_decision
from kvpool.cost import (
    LOCAL_LINK,
    LinkLike,
    PullLedger,
    RecomputeModel,
    ReuseDecision,
    decide_reuse,
    t_transfer_s,
)
from kvpool.cost.compute_queue import ComputeQueue
from kvpool.cost.online import OnlineCalibration
from kvpool.prompt import reusable_tokens


def decide_plan(
    plan: LoadPlan,
    link: LinkLike | None,
    *,
    pulls: PullLedger,
    forwards: ComputeQueue | None,
    calibration: OnlineCalibration,
    block_size: int,
    block_nbytes: int,
    margin: float,
) -> tuple[ReuseDecision, str]:
    """Set `plan.num_load_blocks`, `plan.link` and the stats' predictions for a plan with a hit.

    `link`: the calibrated link to the pool's stores (None: only local blocks to load). Returns the cost
    model's decision and the forced decision in effect ("auto" | "pull" | "recompute").
    """
    stats = plan.stats
    num_pool, num_local = plan.num_pool_blocks, plan.num_local_blocks
    num_hit = max(num_pool, num_local)
    queue = busiest(pulls, peer_bytes(plan, block_nbytes, min(num_local, num_pool), num_pool))
    wait_s = forwards.ahead_s() if forwards is not None else 0.0
    eff_link: LinkLike = contended(calibration.link(link), queue) if link is not None else LOCAL_LINK
    decision = decide_reuse(
        num_hit,
        block_size,
        stats.num_prompt_tokens,
        block_nbytes,
        eff_link,
        calibration.recompute,
        num_local_blocks=num_local,
        margin=margin,
        queued_bytes=queue.nbytes if link is not None else 0,
        compute_wait_s=wait_s,
    )
    stats.predicted_pull_s = decision.predicted_load_s
    stats.predicted_recompute_s = decision.predicted_recompute_all_s
    stats.predicted_compute_s = forward_s(num_hit, stats.num_prompt_tokens, block_size, calibration.recompute)
    stats.reason = decision.reason
    stats.num_pulls_in_flight, stats.queued_bytes = queue.num_pulls, decision.queued_bytes
    stats.compute_wait_s = wait_s
    k = decision.num_load_blocks
    force = forced_decision()
    if force != "auto":
        k = num_hit if force == "pull" else 0
        own = (k - min(k, num_local)) * block_nbytes
        stats.predicted_pull_s = t_transfer_s(own + decision.queued_bytes if own else 0, eff_link)
        stats.reason = f"forced_{force} (auto: {decision.reason})"
    plan.num_load_blocks = k
    plan.link = link
    stats.decision = "recompute" if k == 0 else ("pull" if plan.pull_end > plan.pull_start else "local")
    return decision, force


def forward_s(
    num_load_blocks: int, num_prompt_tokens: int, block_size: int, recompute: RecomputeModel
) -> float:
    """Predicted forward (seconds) of a prompt whose first `num_load_blocks` blocks are reused: the tokens
    after them (at least the last one, B06) on the reused context."""
    n_new = num_prompt_tokens - reusable_tokens(num_load_blocks * block_size, num_prompt_tokens)
    return recompute.t_recompute_s(n_new, num_prompt_tokens - n_new)
