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
from typing import TYPE_CHECKING, Any

from kvpool.hashing import hash_blocks
from kvpool.sampling import SamplingParams
from kvpool.serving.runtime import NodeRuntime
from kvpool.serving.sampling import make_step_generator
from kvpool.types import BlockHash

if TYPE_CHECKING:
    from kvpool.model import KVPrefix

log = logging.getLogger(__name__)

_DONE = object()


@dataclass(slots=True)
class DecodeStats:
    """What decode did for one request (the `DecodeStats` of its last event).

    - Prompt KV: `num_reused_tokens` from cache (`num_pulled_tokens` of them pulled, `pulled_bytes`),
      the load `decision` (none | local | pull | recompute | degraded), `pull_s` and `load_s` (the whole
      load and the prompt's uncached tail computed), seconds.
    - Output: `num_generated` tokens (the prefill's first one included), `decode_s` seconds after the
      load, `finish_reason` (stop | length | cancelled; "" while running).
    """

    num_reused_tokens: int = 0
    num_pulled_tokens: int = 0
    pulled_bytes: int = 0
    decision: str = "none"
    pull_s: float = 0.0
    load_s: float = 0.0
    decode_s: float = 0.0
    num_generated: int = 1
    finish_reason: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first (None when only one token was generated)."""
        return self.decode_s / (self.num_generated - 1) if self.num_generated > 1 else None


@dataclass
class DecodeJob:
    """One request inside the scheduler. `out` receives lists of token ids, then `_DONE`.

    `hashes`: the prompt's full blocks' chained hashes under `ns`, computed once by the service."""

    request_id: str
    ns: bytes
    prompt: list[int]
    hashes: list[BlockHash]
    first_token: int
    params: SamplingParams
    prompt_committed: bool
    publish: bool
    use_cache: bool
    out: queue.Queue[Any] = field(default_factory=queue.Queue)
    generated: list[int] = field(default_factory=list)
    cache: KVPrefix | None = None
    flush_epoch: int | None = None
    """The master's flush epoch its prompt's load began with (publishes under it)."""
    stops: frozenset[int] = frozenset()
    """Token ids that end the request (its `stop_token_ids` and the model's EOS)."""
    t_decode_start: float | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)
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
        eos = rt.runner.eos_token_id
        job.stops = frozenset(job.params.stop_token_ids) | (
            frozenset((eos,)) if eos is not None else frozenset()
        )
        if job.first_token in job.stops or job.params.max_tokens <= 1:
            job.stats.load_s = 0.0
            job.stats.finish_reason = "stop" if job.first_token in job.stops else "length"
            self._finish(job, publish=False)
            return False
        loaded = rt.connector.load_prefix(
            job.ns,
            job.prompt,
            job.hashes,
            count_hit=False,
            request_id=job.request_id,
            use_cache=job.use_cache and job.prompt_committed,
        )
        _logits, job.cache = rt.compute_prompt(job.prompt, loaded)
        job.flush_epoch = loaded.flush_epoch
        rt.connector.keep_pulled(job.ns, loaded)
        s, stats = loaded.stats, job.stats
        stats.num_reused_tokens, stats.num_pulled_tokens = s.num_reused_tokens, s.num_pulled_tokens
        stats.pulled_bytes, stats.decision, stats.pull_s = s.pulled_bytes, s.decision, s.pull_s
        stats.load_s = time.perf_counter() - t0
        job.t_decode_start = time.perf_counter()
        job.generated = [job.first_token]
        return True

    def _step(self) -> None:
        from kvpool.model import sample_next

        batch = [(_cache(job), job.generated[-1]) for job in self._active]
        logits, caches = self.rt.runner.decode_step(batch)
        self.num_steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(batch))
        still: list[DecodeJob] = []
        for i, job in enumerate(self._active):
            job.cache = caches[i]
            if job.cancelled.is_set():
                job.stats.finish_reason = "cancelled"
                self._finish(job, publish=False)
                continue
            tok = sample_next(logits[i], job.params, make_step_generator(job.params, len(job.generated)))
            if tok in job.stops:
                job.stats.finish_reason = "stop"
                self._finish(job, publish=True)
                continue
            job.generated.append(tok)
            job.out.put([tok])
            if len(job.generated) >= job.params.max_tokens:
                job.stats.finish_reason = "length"
                self._finish(job, publish=True)
                continue
            still.append(job)
        self._active = still

    def _finish(self, job: DecodeJob, *, publish: bool) -> None:
        now = time.perf_counter()
        job.stats.decode_s = now - (job.t_decode_start if job.t_decode_start is not None else now)
        job.stats.num_generated = len(job.generated) or 1
        if publish and job.publish and job.cache is not None:
            # the cache holds KV for the prompt and every generated token but the last one
            fed = job.prompt + job.generated[:-1]
            self._publisher.submit(self._publish, job, fed, job.cache)
        job.cache = None
        job.out.put(_DONE)

    def _publish(self, job: DecodeJob, fed: list[int], cache: KVPrefix) -> None:
        rt = self.rt
        block_size = rt.runner.layout.block_size
        hashes = _chain(job, fed, block_size)
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


def _cache(job: DecodeJob) -> KVPrefix:
    assert job.cache is not None, "an admitted job holds its KV cache"
    return job.cache


def _chain(job: DecodeJob, fed: list[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of `fed` (the prompt, then generated tokens): the prompt's blocks as the service
    hashed them, extended block by block (block i's parent is block i-1's hash)."""
    have = len(job.hashes)
    num_full = len(fed) // block_size
    if num_full <= have:
        return job.hashes[:num_full]
    parent = job.hashes[-1] if job.hashes else job.ns
    return job.hashes + hash_blocks(parent, fed[have * block_size : num_full * block_size], block_size)
