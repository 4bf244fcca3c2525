"""Build the connector's halves from vLLM's config: the pool layout, the engine's identity, the start-up
recompute model, the clients.

The start-up recompute model is FLOP-based (`RecomputeModel.from_flops`: `2·Ψ` per token plus attention
pairs, at a matmul rate measured on the engine's device at start); the scheduler then corrects it online
from the forwards the workers time (`kvpool.cost.online`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvpool.client.master_link import REFUSALS, HeartbeatReport, MasterLink, new_epoch
from kvpool.connector.connector import KVConnector
from kvpool.connector.local_tier import LocalTier
from kvpool.cost import RecomputeModel
from kvpool.errors import FailedPrecondition
from kvpool.types import KVLayout, NodeInfo, NodeLoad
from kvpool.vllm.identity import Namespaces, engine_identity, model_identity, resolve_model_dir
from kvpool.vllm.layout import CPU_VEC, NHD, PagedLayout
from kvpool.vllm.publisher import Publisher
from kvpool.vllm.scheduler import ReportedLinks, SchedulerHalf
from kvpool.vllm.settings import ConnectorSettings
from kvpool.vllm.worker import WorkerHalf

log = logging.getLogger(__name__)


def pool_layout(vllm_config: Any) -> KVLayout:
    """The pool block layout of this engine's KV. Raises `FailedPrecondition` for what the pool cannot hold:
    tensor/pipeline parallelism (each worker holds a shard of the heads), a quantized KV cache."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
        raise FailedPrecondition(
            f"kvpool's vLLM connector needs tensor_parallel_size=1 and pipeline_parallel_size=1, got "
            f"{pc.tensor_parallel_size} and {pc.pipeline_parallel_size}"
        )
    if cc.cache_dtype not in ("auto", None):
        raise FailedPrecondition(f"kvpool's vLLM connector needs kv_cache_dtype=auto, got {cc.cache_dtype!r}")
    return KVLayout(
        dtype=str(mc.dtype).removeprefix("torch."),
        block_size=int(cc.block_size),
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_dim=int(mc.get_head_size()),
    )


def engine_kernel(vllm_config: Any, layout: KVLayout) -> str:
    """The attention kernel whose cache layout and rounding this engine's KV has (e.g. "vec" on CPU)."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(getattr(torch, layout.dtype), layout.block_size, layout.head_dim))
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return str(getattr(backend, "name", backend) or "default").lower()


def recompute_from_flops(vllm_config: Any, flops_per_s: float = 0.0) -> RecomputeModel:
    """The FLOP model of this engine's prefill; `flops_per_s` 0: measured with a matmul of the model's
    MLP shape on the engine's device (about 0.1 s)."""
    mc = vllm_config.model_config
    hf = mc.hf_text_config
    h, hd = int(mc.get_hidden_size()), int(mc.get_head_size())
    nh, kvh = int(hf.num_attention_heads), int(mc.get_total_num_kv_heads())
    inter = int(getattr(hf, "intermediate_size", 4 * h))
    layers = int(mc.get_num_layers(vllm_config.parallel_config))
    per_layer = h * nh * hd + 2 * h * kvh * hd + nh * hd * h + 3 * h * inter
    if flops_per_s <= 0:
        flops_per_s = measure_matmul_flops(h, inter, getattr(torch, str(mc.dtype).removeprefix("torch.")))
    return RecomputeModel.from_flops(
        flop_params=layers * per_layer, num_layers=layers, attn_dim=nh * hd, flops_per_s=flops_per_s
    )


def measure_matmul_flops(hidden: int, inter: int, dtype: torch.dtype, n_tokens: int = 256) -> float:
    """FLOP/s of a `[n_tokens, hidden] @ [hidden, inter]` matmul on the current platform's device."""
    from vllm.platforms import current_platform

    device = torch.device(current_platform.device_type)
    a = torch.randn(n_tokens, hidden, dtype=dtype, device=device)
    b = torch.randn(hidden, inter, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n_tokens * hidden * inter / max(best, 1e-9)


def build_scheduler(
    vllm_config: Any, settings: ConnectorSettings, layout: KVLayout, kernel: str, node_id: str
) -> SchedulerHalf:
    """Register the engine with the master (role `vllm`, `vllm-prefill` or `vllm-decode`, with its OpenAI
    URL; a layout the pool does not hold is refused, naming
    both) and build the decision half. An unreachable master is not fatal: the engine serves without the
    pool and registers when the master answers."""
    import vllm
    from vllm.platforms import current_platform

    from kvpool.client import MasterClient

    model_dir = resolve_model_dir(vllm_config.model_config.model, vllm_config.model_config.revision)
    model_id, weights_version = model_identity(model_dir)
    engine = engine_identity(vllm.__version__, current_platform.device_type, kernel)
    recompute = recompute_from_flops(vllm_config, settings.flops_per_s)
    master = MasterClient(settings.master, timeout_s=settings.master_timeout_s)
    connector = KVConnector(
        master=master,
        pool=None,
        transport=ReportedLinks(),
        node_id=node_id,
        block_size=layout.block_size,
        block_nbytes=layout.block_nbytes,
        recompute=recompute,
        local_tier=LocalTier(0),
        num_replicas=settings.num_replicas,
        lease_ttl_ms=settings.lease_ttl_ms,
        pull_timeout_s=settings.pull_timeout_s,
        margin=settings.cost_margin,
    )
    namespaces = Namespaces(model_id=model_id, weights_version=weights_version, layout=layout, engine=engine)
    # a router rebuilds this engine's namespaces from `engine_namespace`
    node = NodeInfo(node_id, settings.master_role, "", "", new_epoch(), settings.url, namespaces.base)
    link = MasterLink(
        master, node, layout_fingerprint=layout.fingerprint(), on_flush_epoch=connector.note_flush_epoch
    )
    try:
        link.start(require_master=False)
    except REFUSALS as exc:
        master.close()
        raise FailedPrecondition(
            f"the kvpool master at {settings.master} refused this engine: {exc}"
        ) from None
    log.info(
        "kvpool connector: engine %s as %s, model %s weights %s, layout %s, master %s",
        engine,
        node_id,
        model_id,
        weights_version[:12],
        layout.fingerprint(),
        settings.master,
    )
    half = SchedulerHalf(
        connector=connector,
        link=link,
        namespaces=namespaces,
        match_wait_s=settings.match_wait_s,
        load_async=settings.load_async,
        save_decode_blocks=settings.save_decode_blocks,
        pd_wait_s=settings.pd_wait_s,
    )
    # heartbeats carry the engine's requests in flight and KV usage
    link.report = lambda: HeartbeatReport(load=NodeLoad(**half.load()))
    return half


def build_worker(settings: ConnectorSettings, layout: KVLayout, kernel: str, node_id: str) -> WorkerHalf:
    """The transfer half: its own master link (bad-replica reports, publishes) and UCX transport."""
    from kvpool.client import MasterClient, PoolClient
    from transfer import UcxTransport

    transport = UcxTransport()
    connector = KVConnector(
        master=MasterClient(settings.master, timeout_s=settings.master_timeout_s),
        pool=PoolClient(settings.master, transport, block_nbytes=layout.block_nbytes),
        transport=transport,
        node_id=node_id,
        block_size=layout.block_size,
        block_nbytes=layout.block_nbytes,
        recompute=RecomputeModel(overhead_s=0.0, per_token_s=0.0, per_pair_s=0.0),
        local_tier=LocalTier(0),
        num_replicas=settings.num_replicas,
        lease_ttl_ms=settings.lease_ttl_ms,
        pull_timeout_s=settings.pull_timeout_s,
        margin=settings.cost_margin,
    )
    paged = PagedLayout(kind=CPU_VEC if kernel == "vec" else NHD, layout=layout)
    return WorkerHalf(
        connector=connector,
        paged=paged,
        publisher=Publisher(connector, max_bytes=settings.publish_max_bytes),
        kernel=kernel,
    )
