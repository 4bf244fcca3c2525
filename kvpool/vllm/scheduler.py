"""The connector's scheduler half (vLLM's EngineCore process): match, decide, lease, and plan the saves.

Rules:
- **The engine step never waits on the pool.** A request's first `get_num_new_matched_tokens` submits one
  counted, leased `MatchPrefix` plus the cost model's decision (`KVConnector.plan_load`) to a thread and
  answers `None` ("ask again"); later calls return the cached answer and have no side effect. A master that
  has not answered after `match_wait_s` costs that request its hit, never its latency beyond that.
- **Never claim the last prompt token** (`KVConnector.max_reusable_blocks`), and load only what vLLM's own
  prefix cache lacks: blocks below the block-aligned local hit are never pulled.
- **Leases** (B13): renewed while the request waits (`kvpool.vllm.leases`), released when its load ends,
  when nothing is loaded, on abort and in `request_finished`; a match that answers after its request gave
  up is released at once.
- **Pull convoys** (B39): a load's pull stays in the connector's ledger from the decision until the
  worker's step output reports the load ended (`KVPoolWorkerMetadata.loads_done`, with its time, which
  teaches the ledger the link's contended throughput), not until the request ends (`kvpool.vllm.feedback`).
- **Saves**: every step, each scheduled request's blocks that became full (prefill, chunked-prefill
  continuations, decode) and whose tokens are known are published once, in chain order, starting after the
  pool's matched run. A finished request's last full blocks are saved in the next step, with the free of
  its blocks delayed until the worker copied them out (B16).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from kvpool.client.master_link import MasterLink
from kvpool.connector.connector import KVConnector
from kvpool.connector.plan import LoadPlan
from kvpool.errors import DeadlineExceeded, Unavailable
from kvpool.hashing import Namespace
from kvpool.vllm.feedback import PullTickets, observe_worker
from kvpool.vllm.identity import Namespaces
from kvpool.vllm.leases import renew_leases
from kvpool.vllm.meta import KVPoolMetadata, KVPoolWorkerMetadata, LoadSpec, SaveSpec
from kvpool.vllm.pd import prefill_blocks, wait_committed
from kvpool.vllm.request_state import ReportedLinks, RequestState, request_report

__all__ = ["ReportedLinks", "SchedulerHalf"]

log = logging.getLogger(__name__)


class SchedulerHalf:
    """Owns the master link (registered as role `vllm`, `vllm-prefill` or `vllm-decode`), the decision
    connector and request states."""

    def __init__(
        self,
        *,
        connector: KVConnector,
        link: MasterLink,
        namespaces: Namespaces,
        match_wait_s: float,
        load_async: bool = False,
        save_decode_blocks: bool = True,
        pd_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connector = connector
        self.link = link
        self.namespaces = namespaces
        self.block_size = connector.block_size
        self.match_wait_s = match_wait_s
        self.pd_wait_s = pd_wait_s  # a P/D decode request waits this much longer (kvpool.vllm.pd)
        self.load_async = load_async
        self.save_decode_blocks = save_decode_blocks
        self._clock = clock
        self._lock = threading.Lock()
        self._reqs: dict[str, RequestState] = {}
        self._loads: list[LoadSpec] = []
        self._final_saves: list[SaveSpec] = []
        self._tickets = PullTickets()  # request id -> its pull's ledger ticket, until its load ends
        self._matcher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvpool-match")
        self._stop = threading.Event()
        self._renewer = threading.Thread(
            target=renew_leases,
            args=(connector, self._reqs, self._stop),
            name="kvpool-lease-renew",
            daemon=True,
        )
        self._renewer.start()
        self.kv_cache_manager: Any = None
        self.num_match_timeouts = 0

    # ---- matching ----------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is not None and st.phase == "decided" and st.lease_gone(num_computed_tokens, self.block_size):
            # vLLM's own cache shrank below a plan whose lease is gone: ask again
            st.phase, st.plan = "done", None
            st = self._start_match(request, num_computed_tokens, st)
        elif st is None or (st.phase == "done" and st.may_ask_again(request)):
            st = self._start_match(request, num_computed_tokens, st)
        if st is None:
            return 0, False
        if st.phase == "matching":
            assert st.future is not None
            if not st.future.done():
                wait_s = self.match_wait_s + (self.pd_wait_s if st.wait_blocks else 0.0)
                if self._clock() - st.asked_s < wait_s:
                    return None, False
                self.num_match_timeouts += 1
                log.warning(
                    "[%s] no answer from the pool in %.2fs (match, link calibration): computing without it",
                    rid,
                    self.match_wait_s,
                )
                st.future.add_done_callback(self._release_late)
                st.phase = "done"
                return 0, False
            self._decided(st, num_computed_tokens)
        if st.phase != "decided":
            return 0, False
        plan = st.plan
        assert plan is not None
        if st.num_local_tokens != num_computed_tokens:  # vLLM's own cache changed since: re-answer
            self._answer(st, num_computed_tokens)
        return st.num_external_tokens, self.load_async and st.num_external_tokens > 0

    def _start_match(
        self, request: Any, num_computed_tokens: int, old: RequestState | None
    ) -> RequestState | None:
        """Submit the match of a new (or resumed) request; None when it cannot use the pool at all."""
        rid = request.request_id
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return None  # multimodal or embedding prompts: token ids do not identify the KV
        max_blocks = self.connector.max_reusable_blocks(request.num_tokens)
        st = old or RequestState(request=request)
        try:
            lora = request.lora_request
            st.ns = self.namespaces.namespace(
                cache_salt=request.cache_salt, lora_path=lora.lora_path if lora else None
            )
        except Exception as exc:  # noqa: BLE001 - e.g. an adapter directory that is gone: no pool for it
            log.warning("[%s] no namespace (%s): computing without the pool", rid, exc)
            return None
        st.digest = st.ns.digest()
        self._reqs[rid] = st
        if max_blocks * self.block_size <= num_computed_tokens:
            # vLLM holds every reusable block itself: nothing to ask. Its blocks came from this engine's
            # earlier requests, which published them (or loaded them from the pool): saves start after them.
            st.num_saved_blocks = max(st.num_saved_blocks, num_computed_tokens // self.block_size)
            if not self.link.namespaces.known(
                st.digest
            ):  # a new namespace still needs registering for the saves
                self._matcher.submit(self._register, st.ns)
            return st
        tokens = list(request.all_token_ids)
        st.extend_hashes(tokens, max_blocks, self.block_size)
        st.num_preemptions = int(getattr(request, "num_preemptions", 0))
        count_hit = st.num_matches == 0  # a preempted request asks again: its hit was counted already
        st.wait_blocks = min(prefill_blocks(request), max_blocks) if count_hit else 0
        st.num_matches += 1
        st.future = self._matcher.submit(
            self._plan,
            st.ns,
            tokens,
            st.hashes[:max_blocks],
            num_computed_tokens,
            rid,
            count_hit,
            st.wait_blocks,
        )
        st.asked_s = self._clock()
        st.phase = "matching"
        return st

    def _register(self, ns: Namespace) -> None:
        try:
            self.link.namespaces.namespace(ns)
        except Exception as exc:  # noqa: BLE001 - the master is down: this request's blocks go unsaved
            log.debug("namespace registration failed: %s", exc)

    def _plan(
        self,
        ns: Namespace,
        tokens: list[int],
        hashes: list[bytes],
        num_local_tokens: int,
        rid: str,
        count_hit: bool,
        wait_blocks: int = 0,
    ) -> LoadPlan:
        digest = self.link.namespaces.namespace(
            ns
        )  # registered once with the master (raises when it is down)
        if wait_blocks:  # P/D decode: its prefill engine's last blocks may still be on their way
            got = wait_committed(self.connector.master, digest, hashes[:wait_blocks], self.pd_wait_s)
            if got < wait_blocks:
                log.info(
                    "[%s] %d of the prefill's %d blocks committed after %.1fs",
                    rid,
                    got,
                    wait_blocks,
                    self.pd_wait_s,
                )
        return self.connector.plan_load(
            digest,
            tokens,
            hashes,
            count_hit=count_hit,
            request_id=rid,
            num_local_blocks=num_local_tokens // self.block_size,
        )

    def _decided(self, st: RequestState, num_computed_tokens: int) -> None:
        assert st.future is not None
        try:
            st.plan = st.future.result()
        except Exception as exc:  # noqa: BLE001 - a failed match is a miss
            # an unreachable master is reported once per outage by the link's heartbeats, not per request
            down = isinstance(exc, (Unavailable, DeadlineExceeded))
            log.log(
                logging.DEBUG if down else logging.WARNING,
                "[%s] match failed: %s",
                st.request.request_id,
                exc,
            )
            st.phase = "done"
            return
        s = st.plan.stats
        log.info(
            "[%s] pool: %d of %d blocks matched, local %d, decision %s (%s): load %d, predicted pull %.3fs, "
            "recompute %.3fs, match %.3fs",
            st.request.request_id,
            s.num_pool_blocks,
            len(st.plan.hashes),
            st.plan.num_local_blocks,
            s.decision,
            s.reason,
            st.plan.num_load_blocks,
            s.predicted_pull_s,
            s.predicted_recompute_s,
            s.match_s,
        )
        st.num_saved_blocks = max(st.num_saved_blocks, st.plan.num_pool_blocks)  # those are in the pool
        st.phase = "decided"
        self._answer(st, num_computed_tokens)

    def _answer(self, st: RequestState, num_computed_tokens: int) -> None:
        """Tokens to load beyond vLLM's block-aligned local hit: the chosen blocks the pool holds."""
        plan = st.plan
        assert plan is not None
        end = min(plan.num_load_blocks, plan.num_pool_blocks)
        st.num_local_tokens = num_computed_tokens
        st.num_external_tokens = max(0, end * self.block_size - num_computed_tokens)
        if st.num_external_tokens == 0:
            self.connector.release(plan, request_id=st.request.request_id)

    def _release_late(self, future: Future[LoadPlan]) -> None:
        """Drop the lease of a match nobody will use (idempotent: `KVConnector.release`)."""
        if not future.cancelled() and future.exception() is None:
            self.connector.release(future.result())

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or st.phase != "decided" or st.plan is None:
            return
        plan = st.plan
        if num_external_tokens <= 0:
            self.connector.release(plan, request_id=request.request_id)
            st.phase, st.num_external_tokens = "done", 0
            return
        start = st.num_local_tokens // self.block_size
        n = num_external_tokens // self.block_size
        plan.num_local_blocks, plan.num_load_blocks = start, start + n
        block_ids = list(blocks.get_block_ids()[0][start : start + n])
        spec = LoadSpec(
            request_id=request.request_id, plan=replace(plan), block_ids=block_ids, sync=not self.load_async
        )
        plan.lease_id = None  # the worker releases it once its pull ended
        with self._lock:
            self._loads.append(spec)
        if plan.pull_ticket is not None:  # ended when the worker reports the load done (B39)
            self._tickets.add(request.request_id, plan.pull_ticket)
        st.phase = "loading" if self.load_async else "done"

    # ---- each step ---------------------------------------------------------------------------------
    def build_connector_meta(self, so: Any) -> KVPoolMetadata:
        with self._lock:
            meta = KVPoolMetadata(loads=self._loads, saves=self._final_saves)
            self._loads, self._final_saves = [], []
        spec_tokens = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        steps: list[tuple[str, int]] = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, num_computed in steps:
            n = so.num_scheduled_tokens.get(rid, 0)
            meta.step_tokens.append((n, num_computed))
            st = self._reqs.get(rid)
            if st is None:
                continue
            done = num_computed + n - len(spec_tokens.get(rid, ()))
            save = self._save_spec(st, done, self._block_ids(rid))
            if save is not None:
                meta.saves.append(save)
        return meta

    def _block_ids(self, rid: str) -> list[int]:
        if self.kv_cache_manager is None:
            return []
        return list(self.kv_cache_manager.get_block_ids(rid)[0])

    def _save_spec(self, st: RequestState, num_done_tokens: int, block_ids: list[int]) -> SaveSpec | None:
        """The blocks of `st` that became full (KV computed, tokens known) and are not saved yet."""
        if st.ns is None or not self.link.namespaces.known(st.digest):
            return None  # the master never accepted the namespace: publishing would be refused
        req = st.request
        limit = min(num_done_tokens, req.num_tokens)
        if not self.save_decode_blocks:
            limit = min(limit, req.num_prompt_tokens)
        n_full = min(limit // self.block_size, len(block_ids))
        if n_full <= st.num_saved_blocks:
            return None
        st.extend_hashes(req.all_token_ids, n_full, self.block_size)
        start, st.num_saved_blocks = st.num_saved_blocks, n_full
        return SaveSpec(
            request_id=req.request_id,
            ns=st.digest,
            hashes=st.hashes[:n_full],
            start_block=start,
            block_ids=block_ids[start:n_full],
            flush_epoch=self.connector.flush_epoch,
        )

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_recving or ():
            st = self._reqs.get(rid)
            if st is None:
                continue
            st.phase = "done"
            if st.request is None:  # finished while loading (see `request_finished`)
                self._reqs.pop(rid, None)
        meta = output.kv_connector_worker_meta
        if isinstance(meta, KVPoolWorkerMetadata):
            observe_worker(meta, connector=self.connector, tickets=self._tickets, requests=self._reqs)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Release what the request holds and queue its last full blocks' save. Returns (delay the free of
        its blocks until the worker copied them out, `{"kvpool": what the pool did}` for the request's
        `kv_transfer_params`)."""
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        if st is None:
            return False, None
        if st.future is not None and st.plan is None:  # a match in flight, or answered but not taken up yet
            st.future.add_done_callback(self._release_late)  # runs now when the future is done
        elif st.plan is not None and st.phase != "loading":
            self.connector.release(st.plan, request_id=rid)
            self._tickets.pop(rid)
        elif st.plan is not None:  # vLLM frees its blocks when the load ends; the worker owns the lease
            self._reqs[rid] = RequestState(request=None, phase="loading")
            return False, {"kvpool": self._report(st)}
        save = self._save_spec(st, request.num_computed_tokens, list(block_ids))
        params = {"kvpool": self._report(st)}
        if save is None:
            return False, params
        save.final = True
        with self._lock:
            self._final_saves.append(save)
        return True, params

    def _report(self, st: RequestState) -> dict[str, Any]:
        return request_report(st, self.block_size, self.connector.block_nbytes)

    # ---- heartbeats and shutdown -------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        """What the engine's heartbeats report (`kvpool.client.NodeLoad` fields): `queue_len` = requests the
        scheduler holds (waiting or running), `kv_usage` = the fraction of vLLM's KV cache in use (0 until
        vLLM hands the connector its KV cache manager)."""
        states = list(self._reqs.values())  # a snapshot: the engine thread adds and removes requests
        usage = getattr(self.kv_cache_manager, "usage", 0.0) if self.kv_cache_manager is not None else 0.0
        return {
            "queue_len": sum(1 for st in states if st.request is not None),
            "kv_usage": min(1.0, max(0.0, float(usage or 0.0))),
        }

    def shutdown(self) -> None:
        """Stop matching and renewing, release every lease held, and deregister the engine at the master."""
        self._stop.set()
        self._matcher.shutdown(wait=False, cancel_futures=True)
        for st in list(self._reqs.values()):
            if st.plan is not None:
                self.connector.release(st.plan)
            elif st.future is not None:
                st.future.add_done_callback(self._release_late)
        self._reqs.clear()
        self.connector.close()  # sends the queued lease releases (a late match's goes out at once)
        self.link.stop()  # deregisters: `kvpool admin nodes` drops the engine at once
