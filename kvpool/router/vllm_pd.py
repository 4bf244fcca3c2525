"""Prefill/decode over vLLM engines through the pool: the router's placement and calls (OpenAI HTTP).

vLLM engines with kvpool's connector register at the master as `vllm-prefill`, `vllm-decode` or `vllm`
(both), with their OpenAI URL and namespace base (`kvpool.client.EngineNamespace`). Per request:

1. **Tokens, as the engine renders them** (field case B30): the prompt (completions) or the messages
   with the body's template options (chat) go to a prefill engine's `POST /tokenize`, which applies
   vLLM's own chat template; the router never hashes a rendering the engine does not use.
2. **Peek**: the request's namespace is rebuilt from the engine's registration and the tenant's salt with
   the connector's own function (B31), its full blocks hashed, and the master asked how many leading
   blocks the pool holds (no hit counted, no lease).
3. **Placement**: the routing policy (`kvpool.router.policy`, the same as for kvpool's nodes) over the
   prefill engines (their heartbeat load and this router's requests in flight; their own prefix caches are
   not visible, so `local_blocks` is 0). When the pool holds every reusable block already, the prefill
   hop is skipped: the decode engine loads the prompt from the pool.
4. **Prefill**: the body with `max_tokens` 1, not streamed. Its response's `kv_transfer_params["kvpool"]`
   says what the connector queued for publishing (`num_saved_blocks`).
5. **Decode**: the client's body, with `kv_transfer_params = {"kvpool_prefill": that report}`, to the
   least-loaded decode engine; its connector waits (at most its `pd_wait_s`) for those blocks to be
   committed, loads or recomputes per the cost model (`kvpool.vllm.pd`), and its response (or stream)
   goes to the client unchanged. A prefill whose publish failed costs the decode a recompute.

Failover as for kvpool's nodes (`kvpool.router.nodes`): an engine that cannot be reached before anything
was sent to the client goes into back-off and the call is retried on another engine; a decode engine
that dies mid-stream ends that stream with one error event and is avoided by later requests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.client.types import NodeStatus
from kvpool.errors import DeadlineExceeded, KVPoolError, Unavailable
from kvpool.hashing import hash_blocks
from kvpool.prompt import max_reusable_blocks
from kvpool.router.metrics import RouterMetrics
from kvpool.router.nodes import NodeView
from kvpool.router.policy import Choice, RouteRequest, RoutingPolicy
from kvpool.router.settings import RouterSettings
from kvpool.router.state import Inflight, node_states, serving_nodes
from kvpool.types import KVLayout

log = logging.getLogger(__name__)

PREFILL_ROLES = ("vllm-prefill", "vllm")
DECODE_ROLES = ("vllm-decode", "vllm")
PREFILL_KEY = "kvpool_prefill"  # kvpool.vllm.pd.PREFILL_KEY (the router imports nothing of kvpool.vllm)
CHAT_TEMPLATE_KEYS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "add_special_tokens",
)


@dataclass(slots=True)
class Placement:
    """Where one request goes: the prefill engine (None: the pool holds the prompt, no prefill hop), the
    policy's choice, the prompt's length and the leading blocks the pool holds."""

    prefill: NodeStatus | None
    choice: Choice | None
    prompt_tokens: int
    pool_blocks: int
    max_blocks: int


class VllmEngines(NodeView):
    """The vLLM engines of the cluster and the placement of requests on them. Thread-safe; `start` it."""

    def __init__(self, settings: RouterSettings, master: Any, metrics: RouterMetrics | None = None) -> None:
        super().__init__(settings, master, metrics or RouterMetrics())
        self.policy = RoutingPolicy(settings.policy, seed=settings.seed)
        self._policy_lock = threading.Lock()
        self.inflight = Inflight()  # prefill: until its response
        self.decode_inflight = Inflight()  # decode: until the last byte

    def start(self) -> VllmEngines:
        try:
            self.refresh()
        except Unavailable as exc:
            log.warning("no node list yet: %s", exc)
        self.start_refresh()
        return self

    def close(self) -> None:
        self.stop_refresh()

    def engines(self, roles: Sequence[str], exclude: Collection[str] = ()) -> list[NodeStatus]:
        """Live engines of `roles` with a URL but `exclude`; those in back-off left out unless all are."""
        nodes = [n for n in self.nodes() if n.node.role in roles]
        live = {n.node.node_id: n for role in roles for n in serving_nodes(nodes, role) if n.node.url}
        out = [n for i, n in sorted(live.items()) if i not in exclude]
        return [n for n in out if not self.in_backoff(n)] or out

    def health(self) -> dict[str, Any]:
        """`/health`'s body (`NodeView.health_report`): the master is asked now; while it does not answer,
        the last known engines are counted and the report says degraded."""
        self.check_master()
        return self.health_report(len(self.engines(PREFILL_ROLES)), len(self.engines(DECODE_ROLES)))

    # ---- placement --------------------------------------------------------------------------------
    def pool_blocks(self, engine: NodeStatus, tokens: Sequence[int], cache_salt: str) -> tuple[int, int]:
        """(leading blocks of `tokens` the pool holds in the engine's namespace for `cache_salt`, the most
        that can be reused). A master that does not answer (no peeks until it answers a refresh again), or
        an engine without a namespace, is 0 hits."""
        base = engine.node.engine_namespace
        if base is None or not tokens:
            return 0, 0
        layout = KVLayout.from_fingerprint(base.layout_fingerprint)
        max_blocks = max_reusable_blocks(len(tokens), layout.block_size)
        if max_blocks == 0:
            return 0, 0
        digest = base.namespace(cache_salt).digest()
        hashes = hash_blocks(digest, list(tokens), layout.block_size)[:max_blocks]
        if self.master_state.down:  # no peeks until the background refresh reaches it again
            self.metrics.unpeeked.inc()
            return 0, max_blocks
        try:
            match = self.master.match(digest, hashes, count_hit=False, lease_ttl_ms=0)
        except KVPoolError as exc:
            if isinstance(exc, Unavailable | DeadlineExceeded):
                self.master_failed(exc)
            log.debug("peek failed (%s): placing without hits", exc)
            self.metrics.unpeeked.inc()
            return 0, max_blocks
        return match.num_matched, max_blocks

    def place(
        self, tokens: Sequence[int] | None, cache_salt: str, exclude: Collection[str] = ()
    ) -> Placement:
        """Choose the prefill engine for a prompt (`tokens` None: not tokenized, placed by load); counted in
        flight until `prefill_done`. `Unavailable` when no prefill engine is live."""
        prefill = self.engines(PREFILL_ROLES, exclude)
        if not prefill:
            raise Unavailable("no live vLLM prefill engine")
        n_tokens = len(tokens) if tokens is not None else 0
        pool, max_blocks = self.pool_blocks(prefill[0], tokens, cache_salt) if tokens else (0, 0)
        if max_blocks and pool >= max_blocks:
            return Placement(None, None, n_tokens, pool, max_blocks)  # the decode loads it all from the pool
        base = prefill[0].node.engine_namespace
        layout = KVLayout.from_fingerprint(base.layout_fingerprint) if base is not None else None
        req = RouteRequest(
            prompt_len=max(1, n_tokens),
            block_size=layout.block_size if layout else 16,
            block_nbytes=layout.block_nbytes if layout else 0,
            pool_blocks=pool,
        )
        with self._policy_lock:
            states = node_states(prefill, None, self.inflight, 0)  # engines' own caches unseen
            choice = self.policy.choose(req, states)
            node = next(n for n in prefill if n.node.node_id == choice.node_id)
            self.inflight.begin(node.node.node_id, node.node.epoch, choice.prediction.service_s)
        return Placement(node, choice, n_tokens, pool, max_blocks)

    def prefill_done(self, placement: Placement) -> None:
        """End the prefill's in-flight count (once per `place` that chose an engine)."""
        if placement.prefill is not None and placement.choice is not None:
            n = placement.prefill.node
            self.inflight.end(n.node_id, n.epoch, placement.choice.prediction.service_s)

    def pick_decode(self, exclude: Collection[str] = ()) -> NodeStatus:
        """The least-loaded decode engine (this router's streams there or its reported requests, whichever
        is larger), ties by id; `Unavailable` when none is live."""
        decode = self.engines(DECODE_ROLES, exclude)
        if not decode:
            raise Unavailable("no live vLLM decode engine")

        def load(n: NodeStatus) -> tuple[int, str]:
            return max(
                self.decode_inflight.get(n.node.node_id, n.node.epoch)[0], n.load.queue_len
            ), n.node.node_id

        return min(decode, key=load)


def prefill_body(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """The prefill engine's request: the client's with one token, not streamed (its KV is what counts)."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "kv_transfer_params")}
    out["max_tokens"] = 1
    if kind == "chat":
        out["max_completion_tokens"] = 1
    out["n"] = 1
    return out


def decode_body(body: dict[str, Any], report: dict[str, Any] | None) -> dict[str, Any]:
    """The decode engine's request: the client's, carrying the prefill's publish report (if any)."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if report is not None:
        out["kv_transfer_params"] = {PREFILL_KEY: report}
    return out


def tokenize_body(body: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """vLLM's `/tokenize` request rendering the prompt as the engine will (None: nothing to tokenize)."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        out = {"model": body.get("model"), "messages": messages}
        out |= {k: body[k] for k in CHAT_TEMPLATE_KEYS if k in body}
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"tokens": prompt}  # already token ids: no call needed
    if isinstance(prompt, str):
        return {"model": body.get("model"), "prompt": prompt}
    return None
