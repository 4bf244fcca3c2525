"""What a serving node holds: the model runner, its calibration, pool clients, the connector, the master link.

Built once at node start-up by `NodeRuntime.start`; shared by the prefill and decode servicers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.client.master_link import HeartbeatReport, MasterLink, new_epoch
from kvpool.connector.connector import KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.prompt import reusable_tokens
from kvpool.serving.common import ServingSettings
from kvpool.serving.metrics import LatencyMetric, MeteredTransport, ServingMetrics
from kvpool.types import NamespaceId, NodeInfo

if TYPE_CHECKING:
    import torch

    from kvpool.client import MasterClient, PoolClient
    from kvpool.connector.plan import LoadedPrefix
    from kvpool.cost import RecomputeModel
    from kvpool.model import KVPrefix, ModelRunner
    from kvpool.v1 import kvpool_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class NodeRuntime:
    settings: ServingSettings
    runner: ModelRunner
    recompute: RecomputeModel
    master: MasterClient
    pool: PoolClient
    transport: MeteredTransport
    connector: KVConnector
    link: MasterLink | None
    model_lock: threading.Lock
    role: str
    metrics: ServingMetrics

    @classmethod
    def start(
        cls, settings: ServingSettings, *, role: str, latency: LatencyMetric | None = None
    ) -> NodeRuntime:
        """Load the model, calibrate, connect to the master and the pool. `link` starts later (`attach_link`).
        `latency`: the role's latency histogram in its metrics (None: none)."""
        from kvpool.client import MasterClient, PoolClient
        from kvpool.cost.compute_queue import ComputeQueue
        from kvpool.model import ModelRunner, calibrate_recompute
        from transfer import UcxTransport

        runner = ModelRunner.load(settings.model, device=settings.device, block_size=settings.block_size)
        if runner.synthetic:
            log.info("model %s: SYNTHETIC weights (embedded demo model, random but fixed)", runner.model_id)
        recompute = calibrate_recompute(runner)
        master = MasterClient(settings.master, timeout_s=2.0)
        metrics = ServingMetrics(role, latency)
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
            forwards=ComputeQueue(),  # loads run outside `model_lock`: they overlap the forwards queued
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

    def attach_link(
        self,
        grpc_address: str,
        report: Callable[[], HeartbeatReport] | None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        """Register with the master and start heartbeating (each carries `report()`); raises the master's
        refusal (e.g. `AlreadyExists`: a live node holds this node id) or that it cannot be reached.
        `on_fatal(message)`: a later re-registration was refused."""
        node = NodeInfo(self.settings.node_id, self.role, grpc_address, "", new_epoch())
        link = MasterLink(
            self.master,
            node,
            layout_fingerprint=self.runner.layout.fingerprint(),
            report=report,
            on_heartbeat=self.connector.report_local_events,
            on_reconnect=self.connector.breaker.probe_soon,  # the master is back: probe the pool now
            on_fatal=on_fatal,
            on_flush_epoch=self.connector.note_flush_epoch,  # moved: a namespace was invalidated
        )
        self.link = link  # GetInfo answers with this epoch from the registration on
        link.start()

    def info(self) -> pb.GetInfoResponse:
        """`kvpool.v1.GetInfoResponse` for this node (epoch 0 and no address until the link registered)."""
        from kvpool.v1 import kvpool_pb2 as pb

        me = self.link.node if self.link is not None else None
        node = pb.NodeEndpoint(
            node_id=self.settings.node_id,
            role=self.role,
            grpc_address=me.grpc_address if me is not None else "",
            epoch=me.epoch if me is not None else 0,
        )
        return pb.GetInfoResponse(node=node, layout_fingerprint=self.runner.layout.fingerprint())

    def namespace(self, cache_salt: str) -> NamespaceId:
        """The namespace digest for this model and tenant salt (registered with the master once)."""
        ns = self.runner.namespace(cache_salt=cache_salt)
        if self.link is None:
            return ns.digest()
        return self.link.namespaces.namespace(ns)

    def compute_prompt(self, tokens: Sequence[int], loaded: LoadedPrefix) -> tuple[torch.Tensor, KVPrefix]:
        """Scatter a load's blocks and prefill the rest of `tokens` (>= the last token) on them.

        Returns `(logits, prefix)` as `ModelRunner.prefill_prompt`; the forward's time is folded into
        the connector's online recompute calibration, and the load's queued forward (`loaded.forward_id`)
        leaves the connector's compute queue. Callers hold `model_lock`.
        """
        forwards = self.connector.forwards
        if forwards is not None:
            forwards.start(loaded.forward_id)
        try:
            prefix = self.runner.prefix_from_blocks(loaded.blocks) if loaded.blocks else None
            n_ctx = reusable_tokens(prefix.num_tokens if prefix is not None else 0, len(tokens))
            t0 = time.perf_counter()
            out = self.runner.prefill_prompt(tokens, prefix)
            self.connector.calibration.observe_compute(len(tokens) - n_ctx, n_ctx, time.perf_counter() - t0)
            return out
        finally:
            if forwards is not None:
                forwards.release(loaded.forward_id)

    def load_info(self) -> dict[str, float]:
        """Calibration figures for heartbeats (`NodeLoad` fields): the recompute model decisions use now."""
        r = self.connector.recompute
        return {
            "recompute_s_per_token": r.per_token_s,
            "recompute_s_per_token_ctx": r.per_pair_s,
            "recompute_overhead_s": r.overhead_s,
        }

    def close(self) -> None:
        if self.link is not None:
            self.link.stop()
        self.connector.close()  # the queued lease releases, while the master client is open
        try:
            self.transport.close()
        finally:
            self.master.close()
            self.pool.close()
