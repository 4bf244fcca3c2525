"""What a serving node holds: the model runner, its calibration, pool clients, the connector, the agent.

Built once at node start-up by `NodeRuntime.start`; shared by the prefill and decode servicers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.connector.agent import NodeAgent
from kvpool.connector.connector import KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.serving.common import ServingSettings
from kvpool.serving.metrics import MeteredTransport, ServingMetrics
from kvpool.types import NamespaceId

log = logging.getLogger(__name__)


def sampling_from_proto(msg: Any) -> Any:
    """`kvpool.v1.SamplingParams` → `kvpool.model.SamplingParams` (validated: `InvalidArgument`)."""
    from kvpool.model import SamplingParams

    return SamplingParams(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p) if msg.top_p else 1.0,
        top_k=int(msg.top_k),
        seed=int(msg.seed) if msg.has_seed else None,
        max_tokens=int(msg.max_tokens) if msg.max_tokens else 16,
        stop_token_ids=tuple(int(t) for t in msg.stop_token_ids),
    )


def make_step_generator(params: Any, step: int) -> Any:
    """A generator for output position `step` (None for greedy); see `kvpool.serving.common.step_seed`."""
    if params.greedy:
        return None
    import random

    import torch

    from kvpool.serving.common import step_seed

    seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
    return torch.Generator(device="cpu").manual_seed(step_seed(seed, step))


@dataclass
class NodeRuntime:
    settings: ServingSettings
    runner: Any
    recompute: Any
    master: Any
    pool: Any
    transport: Any
    connector: KVConnector
    agent: NodeAgent | None
    model_lock: threading.Lock
    role: str
    metrics: ServingMetrics

    @classmethod
    def start(cls, settings: ServingSettings, *, role: str, grpc_address_fn: Any = None) -> NodeRuntime:
        """Load the model, calibrate, connect to the master and the pool. `agent` starts later (`attach`)."""
        from kvpool.client import MasterClient, PoolClient
        from kvpool.model import ModelRunner, calibrate_recompute
        from transfer import UcxTransport

        runner = ModelRunner.load(settings.model, device=settings.device, block_size=settings.block_size)
        if runner.synthetic:
            log.info("model %s: SYNTHETIC weights (embedded demo model, random but fixed)", runner.model_id)
        recompute = calibrate_recompute(runner)
        master = MasterClient(settings.master, timeout_s=2.0)
        metrics = ServingMetrics(role)
        transport = MeteredTransport(
            UcxTransport(
                endpoints_per_peer=settings.pull_endpoints_per_peer,
                blocks_per_message=settings.pull_blocks_per_message,
            ),
            metrics,
        )
        pool = PoolClient(settings.master, transport, block_nbytes=runner.layout.block_nbytes)
        connector = KVConnector(
            master=master,
            pool=pool,
            transport=transport,
            node_id=settings.node_id,
            block_size=runner.layout.block_size,
            block_nbytes=runner.layout.block_nbytes,
            recompute=recompute,
            local_tier=LocalTier(settings.local_tier_bytes),
            num_replicas=settings.num_replicas,
            lease_ttl_ms=settings.lease_ttl_ms,
            pull_timeout_s=settings.pull_timeout_s,
            margin=settings.cost_margin,
        )
        metrics.watch_breaker(connector.breaker)
        return cls(
            settings,
            runner,
            recompute,
            master,
            pool,
            transport,
            connector,
            None,
            threading.Lock(),
            role,
            metrics,
        )

    def attach_agent(self, grpc_address: str, load_fn: Any, on_fatal: Any = None) -> None:
        """Register with the master and start heartbeating; raises the master's refusal (e.g. `AlreadyExists`:
        a live node holds this node id). `on_fatal(message)`: a later re-registration was refused."""
        agent = NodeAgent(
            self.master,
            node_id=self.settings.node_id,
            role=self.role,
            grpc_address=grpc_address,
            layout_fingerprint=self.runner.layout.fingerprint(),
            load_fn=load_fn,
            on_heartbeat=self.connector.report_local_events,
            on_reconnect=self.connector.breaker.probe_soon,  # the master is back: probe the pool now
            on_fatal=on_fatal,
            on_flush_epoch=self.connector.note_flush_epoch,  # moved: a namespace was invalidated
        )
        self.agent = agent  # GetInfo answers with this epoch from the registration on
        agent.start()

    def info(self) -> Any:
        """`kvpool.v1.GetInfoResponse` for this node (epoch 0 and no address until the agent registered)."""
        from kvpool.v1 import kvpool_pb2 as pb

        agent = self.agent
        node = pb.NodeEndpoint(
            node_id=self.settings.node_id,
            role=self.role,
            grpc_address=agent.grpc_address if agent is not None else "",
            epoch=agent.epoch if agent is not None else 0,
        )
        return pb.GetInfoResponse(node=node, layout_fingerprint=self.runner.layout.fingerprint())

    def namespace(self, cache_salt: str) -> NamespaceId:
        """The namespace digest for this model and tenant salt (registered with the master once)."""
        ns = self.runner.namespace(cache_salt=cache_salt)
        if self.agent is None:
            return ns.digest()
        return self.agent.namespace(ns)

    def compute_prompt(self, tokens: Sequence[int], loaded: Any) -> tuple[Any, Any]:
        """Scatter a load's blocks and prefill the rest of `tokens` (>= the last token) on them.

        Returns `(logits, prefix)` as `ModelRunner.prefill_prompt`; the forward's time is folded into
        the connector's online recompute calibration. Callers hold `model_lock`.
        """
        prefix = self.runner.prefix_from_blocks(loaded.blocks) if loaded.blocks else None
        n_ctx = min(prefix.num_tokens if prefix is not None else 0, len(tokens) - 1)
        t0 = time.perf_counter()
        out = self.runner.prefill_prompt(tokens, prefix)
        self.connector.calibration.observe_compute(len(tokens) - n_ctx, n_ctx, time.perf_counter() - t0)
        return out

    def load_info(self) -> dict[str, Any]:
        """Calibration figures for heartbeats (`NodeLoad` fields): the recompute model decisions use now."""
        r = self.connector.recompute
        return {"recompute_s_per_token": r.per_token_s, "recompute_s_per_token_ctx": r.per_pair_s,
                "recompute_overhead_s": r.overhead_s}  # fmt: skip

    def close(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        try:
            self.transport.close()
        finally:
            self.master.close()
            self.pool.close()
