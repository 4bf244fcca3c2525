"""`KVPoolConnector`: kvpool as the KV pool of a vLLM V1 engine (vLLM's `KVConnectorBase_V1`).

    python -m vllm.entrypoints.openai.api_server --model DIR --block-size 64 \\
        --kv-transfer-config '{"kv_connector": "KVPoolConnector", "kv_connector_module_path": "kvpool.vllm",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"master": "HOST:PORT"}}'

vLLM builds one instance per role: the scheduler half (`kvpool.vllm.scheduler`) in the EngineCore process
and a worker half (`kvpool.vllm.worker`) in each worker; this facade builds the half and delegates. The
pool is best effort: a failed pull is recomputed (the connector sets `kv_load_failure_policy="recompute"`),
a master that is down or slow costs hits, never requests. Tensor and pipeline parallelism are refused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvpool.vllm.build import build_scheduler, build_worker, engine_kernel, pool_layout
from kvpool.vllm.meta import KVPoolMetadata, KVPoolWorkerMetadata
from kvpool.vllm.settings import ConnectorSettings

log = logging.getLogger(__name__)


def _log_like_vllm() -> None:
    """kvpool's INFO lines in vLLM's log (vLLM configures only its own logger)."""
    root = logging.getLogger("kvpool")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%m-%d %H:%M:%S")
        )
        root.addHandler(handler)
        root.setLevel(logging.INFO)


class KVPoolConnector(KVConnectorBase_V1):
    """vLLM V1 KV connector over a kvpool cluster (`kv_connector_extra_config`: `ConnectorSettings`).

    Raises at construction (the engine does not start): `InvalidArgument` for a bad extra config,
    `FailedPrecondition` for a layout the pool does not hold (naming both) or an unsupported parallel setup.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_like_vllm()
        config = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra(config.kv_connector_extra_config)
        if config.kv_load_failure_policy != "recompute":
            log.info(
                "kvpool: kv_load_failure_policy=recompute (a failed pull is recomputed, never a failed request)"
            )
            config.kv_load_failure_policy = "recompute"
        layout = pool_layout(vllm_config)
        kernel = engine_kernel(vllm_config, layout)
        node_id = settings.node_id or f"vllm-{config.engine_id}"
        self._sched = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = build_scheduler(vllm_config, settings, layout, kernel, node_id)
        else:
            self._worker = build_worker(settings, layout, kernel, node_id)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPoolMetadata:
        assert self._sched is not None
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._sched is not None
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.request_finished(request, block_ids)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._sched is not None:
            self._sched.kv_cache_manager = kv_cache_manager

    # ---- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its load ended

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are copied out after the forward (`wait_for_save`)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVPoolWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.build_worker_meta()

    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
