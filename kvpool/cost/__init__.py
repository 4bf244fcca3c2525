"""Transfer-vs-recompute cost model: should a node pull a cached prefix or recompute it?

No torch import here (the router and admin CLI use it); the runner's micro-benchmark lives in
`kvpool.model.calibrate`. Moving a prefix costs `alpha_link + M_kv / beta_link`; recomputing it costs the
calibrated prefill time `t_recompute(n_new, n_ctx)`. A node pulls the leading blocks that minimise
`load(k) + compute(rest | context k)`, with a safety margin on the load.

Sources: Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs" (arXiv
2312.07104) for prefix reuse through a radix cache; Qin et al., "Mooncake: A KVCache-centric
Disaggregated Architecture for LLM Serving" (FAST'25, arXiv 2407.00079) for pulling KV from a pool when
transfer beats recompute; Kaplan et al. 2020 (arXiv 2001.08361) for forward FLOPs per token
`2·N + 2·n_layer·n_ctx·d_attn`.
"""

from kvpool.cost.decision import ReuseDecision, decide_reuse, load_deadline_s
from kvpool.cost.inflight import InFlight, PullLedger, PullTicket
from kvpool.cost.link import LOCAL_LINK, LinkEstimate, LinkLike, t_transfer_s
from kvpool.cost.recompute import RecomputeModel, RecomputeSample, attention_pairs

__all__ = [
    "InFlight",
    "LOCAL_LINK",
    "LinkEstimate",
    "LinkLike",
    "PullLedger",
    "PullTicket",
    "RecomputeModel",
    "RecomputeSample",
    "ReuseDecision",
    "attention_pairs",
    "decide_reuse",
    "load_deadline_s",
    "t_transfer_s",
]
