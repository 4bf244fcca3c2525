"""The connector's worker half (each vLLM worker process): pull planned blocks in, copy saved blocks out.

Rules:
- **Loads are asynchronous.** `start_load_kv` hands each `LoadSpec` to a loader thread: `KVConnector.pull`
  (checksums and generations verified, one retry on another replica, B18) and then one scatter into vLLM's
  blocks. The request is reported in `finished_recving` once its load ended, whatever the outcome; the vLLM
  blocks after the leading intact run are reported in `get_block_ids_with_load_errors` in that same pass,
  so vLLM recomputes exactly from there (`kv_load_failure_policy="recompute"`).
- **Saves copy out right after the forward.** `wait_for_save` gathers the step's full blocks into host
  memory (the engine's tensors are only read, and only then: nothing reads a block after the step that
  owned it) and queues them on the `Publisher`; the network never touches the engine step. A request whose
  last saves are `final` is reported in `finished_sending` once they were copied, so vLLM frees its
  blocks only then (B16).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvpool.connector.connector import KVConnector
from kvpool.vllm.layout import CPU_VEC, NHD, PagedLayout
from kvpool.vllm.meta import KVPoolMetadata, KVPoolWorkerMetadata, LoadSpec, PullSample, SaveSpec
from kvpool.vllm.publisher import Publisher, PublishJob

log = logging.getLogger(__name__)

LOADING_SWITCH_INTERVAL_S = 0.0002
"""The interpreter's thread switch interval while background loads run. Between steps an engine whose
requests all wait for loads spins in Python, and at the default 5 ms each hand-off of a pull (loader thread,
UCX loop, hashing threads) waits for it: a 5 MB pull took 1.5-2 s instead of tens of ms."""

FINISHED_KEEP_STEPS = 64
"""Engine steps a finished request's id is remembered, waiting for its final save to be copied out."""

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(names: list[str]) -> list[str]:
    """Attention layer names in model order (`model.layers.{i}.self_attn.attn`: by the first index)."""

    def key(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.search(name)
        return (int(m.group(1)) if m else -1, name)

    return sorted(names, key=key)


class WorkerHalf:
    """Owns the transfer connector (pulls, publishes) and the engine's registered KV tensors."""

    def __init__(
        self, *, connector: KVConnector, paged: PagedLayout, publisher: Publisher, kernel: str
    ) -> None:
        self.connector = connector
        self.paged = paged
        self.publisher = publisher
        self.kernel = kernel
        self.kv_caches: list[torch.Tensor] = []
        self._loader = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvpool-load")
        self._lock = threading.Lock()
        self._loads: dict[str, Future[tuple[list[int], int, PullSample | None, float]]] = {}
        self._load_errors: set[int] = set()
        self._finished_seen: dict[str, int] = {}  # finished request id -> the step it was seen in
        self._steps = 0
        self._saved_final: set[str] = set()
        self._report = KVPoolWorkerMetadata()
        self._t_bind = 0.0
        self._switch_interval_s = sys.getswitchinterval()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the per-layer tensors in model order; raises `UnsupportedLayout` when they are not the
        pool layout's (layer count, dtype, shape) or the engine's kernel is not one this connector reads."""
        names = layer_order(list(kv_caches))
        tensors = [kv_caches[n] for n in names]
        device = tensors[0].device.type if tensors else "cpu"
        kind = CPU_VEC if device == "cpu" else NHD
        if kind == CPU_VEC and self.kernel != "vec":
            from kvpool.vllm.layout import UnsupportedLayout

            raise UnsupportedLayout(
                f"vLLM's CPU attention kernel is {self.kernel!r}; kvpool reads the 'vec' kernel's cache layout "
                "(use a block size that is a multiple of 32, head_dim a multiple of 32, and no AMX bf16)"
            )
        self.paged = PagedLayout(kind=kind, layout=self.paged.layout)
        num_blocks = self.paged.check(tensors)
        self.kv_caches = tensors
        log.info(
            "kvpool connector: %d KV layers, %d blocks each, %s layout on %s",
            len(tensors),
            num_blocks,
            kind,
            device,
        )
        self._loader.submit(self._warm_links)

    def _warm_links(self) -> None:
        """Connect to every live store now and measure the links (a UCX connect and a probe, up to a second
        each), so the first pull does not pay for it and the scheduler's decisions have links to use."""
        try:
            nodes = self.connector.master.list_nodes()
        except Exception as exc:  # noqa: BLE001 - the master is down: links are measured on first use
            log.debug("no store list for link calibration: %s", exc)
            return
        for n in nodes:
            if n.node.role == "store" and n.alive and n.node.data_address:
                self._note_link(n.node.data_address)

    def _note_link(self, peer: str) -> None:
        """Report the transport's current estimate of `peer` (connecting and probing it first if needed)."""
        try:
            link = self.connector.transport.link(peer)
        except Exception as exc:  # noqa: BLE001 - an unreachable store: no estimate
            log.debug("no link estimate for %s: %s", peer, exc)
            return
        with self._lock:
            self._report.links[peer] = (link.alpha_s, link.beta_bytes_per_s)

    def bind(self, meta: KVPoolMetadata) -> None:
        self._t_bind = time.perf_counter()

    # ---- loads -------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        for spec in meta.loads:
            if spec.sync:  # this step's forward reads the blocks: load them now
                failed, n_intact, sample, load_s = self._load(spec)
                with self._lock:
                    self._record_load(spec.request_id, failed, n_intact, sample, load_s)
                continue
            with self._lock:
                if not self._loads:
                    self._switch_interval_s = sys.getswitchinterval()
                    sys.setswitchinterval(LOADING_SWITCH_INTERVAL_S)
                self._loads[spec.request_id] = self._loader.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> tuple[list[int], int, PullSample | None, float]:
        """Pull and scatter one request's blocks; returns (failed vLLM block ids, intact chain blocks, sample,
        seconds the load took)."""
        plan, rid = spec.plan, spec.request_id
        n_ok = 0
        t0 = time.perf_counter()
        try:
            pulled = self.connector.pull(plan, request_id=rid)
            n_ok = len(pulled)
            if n_ok:
                run = pulled[0].base if pulled[0].base is not None else pulled[0]
                buf = torch.from_numpy(run.reshape(-1)[: n_ok * self.connector.block_nbytes])
                self.paged.scatter(
                    self.kv_caches, spec.block_ids[:n_ok], buf.view(getattr(torch, self.paged.layout.dtype))
                )
        except Exception:  # noqa: BLE001 - a failed load is recomputed, never a failed request
            log.exception("[%s] load failed: recomputing %d blocks", rid, len(spec.block_ids) - n_ok)
            n_ok = 0
        finally:
            self.connector.release(plan, request_id=rid)
        load_s = time.perf_counter() - t0  # the pull and the copy into vLLM's blocks: what a load costs
        failed = spec.block_ids[n_ok:]
        s = plan.stats
        sample = None
        if plan.link is not None and n_ok == len(spec.block_ids) and n_ok:
            sample = PullSample(
                nbytes=s.pulled_bytes,
                seconds=load_s,
                alpha_s=plan.link.alpha_s,
                beta_bytes_per_s=plan.link.beta_bytes_per_s,
                request_id=rid,
            )
        log.info(
            "[%s] loaded %d of %d blocks from the pool in %.3fs (predicted %.3fs)",
            rid,
            n_ok,
            len(spec.block_ids),
            s.pull_s,
            s.predicted_pull_s,
        )
        for peer in set(plan.addresses.values()):
            self._note_link(peer)
        return failed, plan.pull_start + n_ok, sample, load_s

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        recving: set[str] = set()
        for rid in finished_req_ids:
            self.publisher.forget(rid)
        with self._lock:
            self._steps += 1
            for rid in finished_req_ids:
                self._finished_seen.setdefault(rid, self._steps)
            sending = self._saved_final & self._finished_seen.keys()
            self._saved_final -= sending
            # a finished request's final save arrives in the same step as its id; keep ids a while for
            # overlapping batches, then forget them (they would grow with every request served)
            self._finished_seen = {
                rid: step
                for rid, step in self._finished_seen.items()
                if rid not in sending and self._steps - step < FINISHED_KEEP_STEPS
            }
            done = [(rid, f) for rid, f in self._loads.items() if f.done()]
            for rid, fut in done:
                del self._loads[rid]
                recving.add(rid)
                self._record_load(rid, *fut.result())
            if done and not self._loads:
                sys.setswitchinterval(self._switch_interval_s)
        return sending or None, recving or None

    def _record_load(
        self, rid: str, failed: list[int], n_intact: int, sample: PullSample | None, load_s: float
    ) -> None:
        """Queue a finished load's failed blocks and observations (called under the lock)."""
        self._report.loads_done[rid] = load_s
        if failed:
            self._load_errors.update(failed)
            self._report.load_failures[rid] = n_intact
        if sample is not None:
            self._report.pulls.append(sample)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- saves -------------------------------------------------------------------------------------
    def wait_for_save(self, meta: KVPoolMetadata) -> None:
        forward_s = time.perf_counter() - self._t_bind
        if len(meta.step_tokens) == 1 and self.kv_caches and self.kv_caches[0].device.type == "cpu":
            n_new, n_ctx = meta.step_tokens[0]
            if n_new > 0:
                self._report.forward = (n_new, n_ctx, forward_s)  # CUDA: asynchronous, not timed here
        for spec in meta.saves:
            try:
                self._save(spec)
            except Exception:  # noqa: BLE001 - a failed save is a later miss
                log.exception("[%s] saving %d blocks failed", spec.request_id, len(spec.block_ids))
            finally:
                if spec.final:
                    with self._lock:
                        self._saved_final.add(spec.request_id)

    def _save(self, spec: SaveSpec) -> None:
        blocks = self.paged.gather(self.kv_caches, spec.block_ids)  # [n, L, 2, H, bs, hd] on the host
        raw = blocks.view(torch.uint8).reshape(len(spec.block_ids), -1).numpy()
        self.publisher.submit(
            PublishJob(
                request_id=spec.request_id,
                ns=spec.ns,
                hashes=spec.hashes,
                start_block=spec.start_block,
                blocks=raw,
                flush_epoch=spec.flush_epoch,
            )
        )

    def build_worker_meta(self) -> KVPoolWorkerMetadata | None:
        with self._lock:
            report, self._report = self._report, KVPoolWorkerMetadata()
        if report.forward is None and not report.pulls and not report.load_failures and not report.links:
            return None
        return report

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True, cancel_futures=False)
        self.publisher.close()
        c = self.publisher.counters
        log.info(
            "kvpool publisher: %d publishes, %d blocks committed, %d already present, %d publishes failed, "
            "%d dropped",
            c.num_jobs,
            c.num_committed_blocks,
            c.num_existing_blocks,
            c.num_failed_jobs,
            c.num_dropped_jobs,
        )
        self.connector.close()  # the queued lease releases, before the master link closes
        self.connector.transport.close()
        if self.connector.pool is not None:  # the worker's connector always publishes (build_worker)
            self.connector.pool.close()
        self.connector.master.close()
