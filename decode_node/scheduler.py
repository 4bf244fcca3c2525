"""The decode node's continuous-batching loop.

One thread owns the model. Each iteration it admits waiting requests (load the prompt KV: pull or
recompute per the cost model, then compute the prompt's uncached tail), then runs ONE batched decode
step over every active request, samples each request's next token with its own parameters, and streams
it. Finished requests hand their KV to a publisher thread that publishes the full blocks of prompt +
generated tokens, so the next chat turn hits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvpool.hashing import hash_blocks
from kvpool.serving.runtime import NodeRuntime
from kvpool.serving.sampling import make_step_generator

log = logging.getLogger(__name__)

_DONE = object()


@dataclass
class DecodeJob:
    """One request inside the scheduler. `out` receives lists of token ids, then `_DONE`."""

    request_id: str
    ns: bytes
    prompt: list[int]
    first_token: int
    params: Any
    prompt_committed: bool
    publish: bool
    use_cache: bool
    out: queue.Queue[Any] = field(default_factory=queue.Queue)
    generated: list[int] = field(default_factory=list)
    cache: Any = None
    flush_epoch: int | None = (
        None  # the master's flush epoch its prompt's load began with (publishes under it)
    )
    stats: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when the caller went away: the job leaves the batch at the next step (nothing published)."""


class DecodeScheduler:
    def __init__(self, rt: NodeRuntime, *, max_batch_size: int) -> None:
        self.rt = rt
        self.max_batch_size = max_batch_size
        self._waiting: queue.Queue[DecodeJob] = queue.Queue()
        self._active: list[DecodeJob] = []
        self._stop = threading.Event()
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self._thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self.num_steps = 0
        self.max_batch_seen = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._publisher.shutdown(wait=True)

    @property
    def queue_len(self) -> int:
        return self._waiting.qsize() + len(self._active)

    def submit(self, job: DecodeJob) -> None:
        self._waiting.put(job)

    # -- the loop

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit()
            if not self._active:
                try:
                    job = self._waiting.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._waiting.put(job)
                continue
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - fail the batch's requests, keep serving
                log.exception("decode step failed")
                for job in self._active:
                    job.error = exc
                    job.out.put(_DONE)
                self._active.clear()

    def _admit(self) -> None:
        while len(self._active) < self.max_batch_size:
            try:
                job = self._waiting.get_nowait()
            except queue.Empty:
                return
            if job.cancelled.is_set():  # the caller went away while it waited
                job.out.put(_DONE)
                continue
            try:
                if self._load_prompt(job):
                    self._active.append(job)
            except Exception as exc:  # noqa: BLE001 - one bad request never stops the loop
                log.exception("[%s] admission failed", job.request_id)
                job.error = exc
                job.out.put(_DONE)

    def _load_prompt(self, job: DecodeJob) -> bool:
        """Load or recompute the prompt KV. Returns False when the request is already finished."""
        rt = self.rt
        t0 = time.perf_counter()
        stops = set(job.params.stop_token_ids) | (
            {rt.runner.eos_token_id} if rt.runner.eos_token_id is not None else set()
        )
        job.stats["stops"] = stops
        if job.first_token in stops or job.params.max_tokens <= 1:
            job.stats.update(load_s=0.0, finish_reason="stop" if job.first_token in stops else "length")
            self._finish(job, publish=False)
            return False
        block_size = rt.runner.layout.block_size
        hashes = hash_blocks(job.ns, job.prompt, block_size)
        loaded = rt.connector.load_prefix(
            job.ns,
            job.prompt,
            hashes,
            count_hit=False,
            request_id=job.request_id,
            use_cache=job.use_cache and job.prompt_committed,
        )
        _logits, job.cache = rt.compute_prompt(job.prompt, loaded)
        job.flush_epoch = loaded.flush_epoch
        rt.connector.keep_pulled(job.ns, loaded)
        s = loaded.stats
        job.stats.update(
            num_reused_tokens=s.num_reused_tokens,
            num_pulled_tokens=s.num_pulled_tokens,
            pulled_bytes=s.pulled_bytes,
            decision=s.decision,
            pull_s=s.pull_s,
            load_s=time.perf_counter() - t0,
            t_decode_start=time.perf_counter(),
        )
        job.generated = [job.first_token]
        return True

    def _step(self) -> None:
        from kvpool.model import sample_next

        batch = [(job.cache, job.generated[-1]) for job in self._active]
        logits, caches = self.rt.runner.decode_step(batch)
        self.num_steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        still: list[DecodeJob] = []
        for i, job in enumerate(self._active):
            job.cache = caches[i]
            if job.cancelled.is_set():
                job.stats["finish_reason"] = "cancelled"
                self._finish(job, publish=False)
                continue
            tok = sample_next(logits[i], job.params, make_step_generator(job.params, len(job.generated)))
            if tok in job.stats["stops"]:
                job.stats["finish_reason"] = "stop"
                self._finish(job, publish=True)
                continue
            job.generated.append(tok)
            job.out.put([tok])
            if len(job.generated) >= job.params.max_tokens:
                job.stats["finish_reason"] = "length"
                self._finish(job, publish=True)
                continue
            still.append(job)
        self._active = still

    def _finish(self, job: DecodeJob, *, publish: bool) -> None:
        job.stats["decode_s"] = time.perf_counter() - job.stats.get("t_decode_start", time.perf_counter())
        job.stats["num_generated"] = len(job.generated) or 1
        if publish and job.publish and job.cache is not None:
            # the cache holds KV for the prompt and every generated token but the last one
            fed = job.prompt + job.generated[:-1]
            self._publisher.submit(self._publish, job, fed, job.cache)
        job.cache = None
        job.out.put(_DONE)

    def _publish(self, job: DecodeJob, fed: list[int], cache: Any) -> None:
        rt = self.rt
        block_size = rt.runner.layout.block_size
        hashes = hash_blocks(job.ns, fed, block_size)
        start = len(job.prompt) // block_size if job.prompt_committed else 0
        if start >= len(hashes):
            return
        try:
            blocks = rt.runner.blocks_from_prefix(cache, start, len(hashes))
            committed, _existing = rt.connector.publish(
                job.ns,
                hashes,
                blocks,
                start_block=start,
                request_id=job.request_id,
                flush_epoch=job.flush_epoch,
            )
            log.info("[%s] published %d blocks of prompt + output", job.request_id, committed)
        except Exception as exc:  # noqa: BLE001 - publishing is best effort after the answer
            log.warning("[%s] publish of prompt + output failed: %s", job.request_id, exc)


def is_done(item: Any) -> bool:
    return item is _DONE
