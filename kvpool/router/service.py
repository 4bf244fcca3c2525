"""The router's request path (replaces the demo's in-process orchestrator), transport-agnostic.

Per request (DESIGN.md data flow, steps 1, 6 and 7): admit (at most `max_inflight` at once: else
`ResourceExhausted`, answered 429) → hash the prompt's full blocks in the tenant's namespace → peek at
the global index (`count_hit=False, lease_ttl_ms=0`: no counters, no recency, no lease) → place it on a
prefill node by the policy → Prefill stream: the first token is TTFT → wait for `committed` (or
`publish_failed`) → hand off to the least-loaded decode node → stream its tokens.

`generate` is a synchronous generator of `Event`s (the HTTP layer runs it in a worker thread). The
node list comes from the master, refreshed in the background every `refresh_interval_s`.

The master down is `Unavailable` (HTTP 503): `health()` asks the master each time; a request uses the
cached node list only while the last master call succeeded and the list is at most
`4 * refresh_interval_s` old (a failed refresh or a peek the master did not answer drops it at once).

A node that died is listed alive until the master's heartbeat timeout. Failover (as production routers
do): a call to a prefill or decode node that fails UNAVAILABLE (connection refused or reset, the node
gone) before anything of that call was sent to the client puts the node in a local back-off of
`node_backoff_s` (keyed by node id and epoch; it ends early when the node answers a call) and the request
is retried on the next node the same policy chooses among the others, up to `node_retries` times. A
prefill failure is always before the client got anything; a decode stream is retried only while it has
sent no token (the first token, from prefill, is the same for any decode node). Nodes in back-off are
left out of placement unless every candidate is in back-off (then all are tried: a back-off is a hint,
not a verdict). No other node left: `Unavailable` naming the failure. Other errors are not retried.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from collections.abc import Collection, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvpool.client.types import Match, NodeStatus
from kvpool.errors import DeadlineExceeded, KVPoolError, ResourceExhausted, Unavailable
from kvpool.hashing import hash_blocks
from kvpool.router.metrics import RouterMetrics
from kvpool.router.model_info import ModelInfo
from kvpool.router.policy import Choice, RouteRequest, RoutingPolicy
from kvpool.router.settings import RouterSettings
from kvpool.router.state import Inflight, node_states, serving_nodes
from kvpool.rpc.server import channel
from kvpool.rpc.status import raise_from_rpc_error
from kvpool.serving.sampling import Sampling
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Event:
    """One step of a request. `kind`: "first" (first token, prefill stats), "tokens", "done"."""

    kind: str
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""
    prefill_node: str = ""
    decode_node: str = ""
    ttft_s: float = 0.0


class RouterService:
    def __init__(
        self,
        settings: RouterSettings,
        master: Any,
        model: ModelInfo,
        *,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.master = master
        self.model = model
        self.metrics = metrics or RouterMetrics()
        self.policy = RoutingPolicy(settings.policy, seed=settings.seed)
        self._policy_lock = threading.Lock()
        self._decode_rng = random.Random(settings.seed + 1)
        self.inflight = Inflight()  # prefill: until the first token
        self.decode_inflight = Inflight()  # decode: until the last token
        self._admitted = 0
        self._admit_lock = threading.Lock()
        self._nodes: list[NodeStatus] = []
        self._nodes_at = 0.0
        self._master_error = ""  # why the last master call failed ("": it answered)
        self._nodes_lock = threading.Lock()
        self._last_serving: dict[str, tuple[list[NodeStatus], float]] = {}
        self._namespaces: dict[str, bytes] = {}
        self._down: dict[tuple[str, int], float] = {}  # (node id, epoch) -> end of its back-off
        self._down_lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> RouterService:
        self.refresh()
        self._thread = threading.Thread(target=self._refresh_loop, name="router-refresh", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        with self._channels_lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.settings.refresh_interval_s):
            try:
                self.refresh()
            except Unavailable as exc:  # noted by refresh(): requests ask the master again, or get 503
                log.warning("node list refresh failed: %s", exc)

    def refresh(self) -> list[NodeStatus]:
        """The master's node list now (cached for requests); `Unavailable` when the master does not answer
        (and the cached list is dropped until it does)."""
        try:
            nodes = self.master.list_nodes()
        except Exception as exc:  # noqa: BLE001 - any failure: the master's view is unknown
            self.master_failed(exc)
            raise Unavailable(f"master unreachable: {exc}") from None
        with self._nodes_lock:
            self._nodes, self._nodes_at, self._master_error = nodes, time.monotonic(), ""
        return nodes

    def master_failed(self, exc: BaseException) -> None:
        """A master call failed: the cached node list is not used again until a refresh succeeds."""
        with self._nodes_lock:
            self._master_error = str(exc) or type(exc).__name__

    def nodes(self) -> list[NodeStatus]:
        """The cached node list while fresh (the last master call succeeded, at most 4 refresh periods
        ago), else the master's answer now; `Unavailable` when it does not answer."""
        with self._nodes_lock:
            nodes, age, failed = self._nodes, time.monotonic() - self._nodes_at, self._master_error
        if failed or age > 4 * self.settings.refresh_interval_s:
            nodes = self.refresh()
        return nodes

    def serving(self, role: str) -> list[NodeStatus]:
        """The live nodes of `role`. When the master lists none (a restarted master knows no serving node
        until each re-registers, which takes a heartbeat or two), the last ones seen within `node_grace_s`:
        they keep serving meanwhile; one that is really gone fails its call and the request is answered 503."""
        nodes = serving_nodes(self.nodes(), role)
        now = time.monotonic()
        with self._nodes_lock:
            if nodes:
                self._last_serving[role] = (nodes, now)
                return nodes
            last = self._last_serving.get(role)
        if last is not None and now - last[1] <= self.settings.node_grace_s:
            return last[0]
        return []

    # ---- node back-off (failover) -----------------------------------------------------------------
    def node_failed(self, role: str, node: NodeStatus) -> None:
        """A call could not reach `node`: leave it out of placement for `node_backoff_s`."""
        now = time.monotonic()
        with self._down_lock:
            self._down = {k: t for k, t in self._down.items() if t > now}
            self._down[(node.node.node_id, node.node.epoch)] = now + self.settings.node_backoff_s
        self.metrics.node_failures.labels(role, node.node.node_id).inc()

    def node_answered(self, node: NodeStatus) -> None:
        """`node` served a call: its back-off, if any, ends."""
        if self._down:
            with self._down_lock:
                self._down.pop((node.node.node_id, node.node.epoch), None)

    def in_backoff(self, node: NodeStatus) -> bool:
        with self._down_lock:
            return self._down.get((node.node.node_id, node.node.epoch), 0.0) > time.monotonic()

    def candidates(self, role: str, exclude: Collection[str] = ()) -> list[NodeStatus]:
        """The live nodes of `role` but `exclude` (node ids), those in back-off left out unless all are."""
        nodes = [n for n in self.serving(role) if n.node.node_id not in exclude]
        return [n for n in nodes if not self.in_backoff(n)] or nodes

    def _call_failed(self, role: str, node: NodeStatus, exc: grpc.RpcError, tried: list[str]) -> str:
        """A call to `node` failed before anything of it was sent to the client. When it could not reach
        the node (UNAVAILABLE) and another node is left: the node goes into back-off, the retry is counted
        and the failure returned (for the log); otherwise raises the call's error as a `KVPoolError`."""
        what = f"{role} on {node.node.node_id}"
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        if code != grpc.StatusCode.UNAVAILABLE:
            raise_from_rpc_error(exc, what)
        details = (exc.details() if hasattr(exc, "details") else "") or code.name
        self.node_failed(role, node)
        tried.append(node.node.node_id)
        try:
            others = self.candidates(role, tried)
        except KVPoolError:  # the master is gone too
            others = []
        if not others or len(tried) > self.settings.node_retries:
            why = (
                f"gave up after {len(tried)} {role} nodes" if others else f"no other {role} node to retry on"
            )
            raise Unavailable(f"{what}: {details}; {why} (tried {', '.join(tried)})")
        self.metrics.retries.labels(role).inc()
        return f"{what} unreachable ({details}): in back-off for {self.settings.node_backoff_s:g} s"

    def health(self) -> dict[str, Any]:
        """Live serving nodes per role, from the master now (never the cache): `Unavailable` when it does
        not answer, so a health check right after the master died fails."""
        nodes = self.refresh()
        return {
            "prefill": len(serving_nodes(nodes, "prefill")),
            "decode": len(serving_nodes(nodes, "decode")),
            "inflight": self._admitted,
        }

    # ---- placement --------------------------------------------------------------------------------
    def namespace(self, cache_salt: str) -> bytes:
        """The tenant namespace digest, registered with the master on first use."""
        ns = self._namespaces.get(cache_salt)
        if ns is None:
            info = self.model.namespace(cache_salt)
            ns = bytes(info.digest())
            try:
                remote, active = self.master.register_namespace(
                    info.model_id, info.weights_version, info.layout.fingerprint(), cache_salt=cache_salt
                )
                if active and active != info.weights_version:
                    log.warning("master's active version of %s is %s, ours %s", info.model_id, active,
                                info.weights_version)  # fmt: skip
                if bytes(remote) != ns:
                    log.warning("master computed another namespace digest: hashing versions differ")
            except KVPoolError as exc:
                log.warning("register_namespace failed (%s); peeks may miss", exc)
                return ns
            self._namespaces[cache_salt] = ns
        return ns

    def place(self, tokens: Sequence[int], cache_salt: str) -> tuple[Choice, NodeStatus]:
        """Choose the prefill node (peek + policy); `Unavailable` when no prefill node is alive."""
        return self.choose_prefill(self.peek(tokens, cache_salt))

    def peek(self, tokens: Sequence[int], cache_salt: str) -> tuple[RouteRequest, Match | None, int]:
        """What placement needs of the pool for this prompt (one peek, reused by retries):
        `Unavailable` when no prefill node is alive or the master does not answer."""
        if not self.serving("prefill"):
            raise Unavailable("no live prefill node")
        layout = self.model.layout
        max_blocks = max(0, (len(tokens) - 1) // layout.block_size)
        match: Match | None = None
        if max_blocks > 0:
            hashes = hash_blocks(self.namespace(cache_salt), tokens, layout.block_size)[:max_blocks]
            try:
                match = self.master.match(self.namespace(cache_salt), hashes, count_hit=False, lease_ttl_ms=0)
            except (Unavailable, DeadlineExceeded) as exc:  # the master is down: 503, as for the node list
                self.master_failed(exc)
                raise Unavailable(f"master unreachable: {exc}") from None
            except KVPoolError as exc:
                log.warning("peek failed (%s); routing without hits", exc)
        req = RouteRequest(
            prompt_len=len(tokens),
            block_size=layout.block_size,
            block_nbytes=layout.block_nbytes,
            pool_blocks=match.num_matched if match is not None else 0,
        )
        return req, match, max_blocks

    def choose_prefill(
        self, peeked: tuple[RouteRequest, Match | None, int], exclude: Collection[str] = ()
    ) -> tuple[Choice, NodeStatus]:
        """The prefill node the policy chooses among `candidates` (counted in flight until its first token)."""
        req, match, max_blocks = peeked
        prefill = self.candidates("prefill", exclude)
        if not prefill:
            raise Unavailable("no live prefill node")
        with self._policy_lock:
            states = node_states(prefill, match, self.inflight, max_blocks)
            choice = self.policy.choose(req, states)
            node = next(n for n in prefill if n.node.node_id == choice.node_id)
            self.inflight.begin(node.node.node_id, node.node.epoch, choice.prediction.service_s)
        self.metrics.decisions.labels(self.policy.policy, choice.node_id).inc()
        self.metrics.predicted_ttft.observe(choice.prediction.ttft_s)
        return choice, node

    def pick_decode(self, exclude: Collection[str] = ()) -> NodeStatus:
        """The least-loaded decode node of `candidates` (own in-flight or reported queue); ties seeded."""
        decode = self.candidates("decode", exclude)
        if not decode:
            raise Unavailable("no live decode node")

        def load(n: NodeStatus) -> int:
            return max(self.decode_inflight.get(n.node.node_id, n.node.epoch)[0], n.load.queue_len)

        best = min(load(n) for n in decode)
        with self._policy_lock:
            return self._decode_rng.choice([n for n in decode if load(n) == best])

    def _stub(self, address: str, kind: str) -> Any:
        with self._channels_lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = channel(address)
        return pb_grpc.PrefillStub(ch) if kind == "prefill" else pb_grpc.DecodeStub(ch)

    # ---- one request ------------------------------------------------------------------------------
    def admit(self) -> None:
        """Count one request in; `ResourceExhausted` when `max_inflight` are being served. Pair with `release`."""
        with self._admit_lock:
            if self._admitted >= self.settings.max_inflight:
                self.metrics.rejected.labels("overloaded").inc()
                raise ResourceExhausted(
                    f"the router is serving {self._admitted} requests (limit {self.settings.max_inflight}); "
                    "retry later"
                )
            self._admitted += 1
        self.metrics.inflight.inc()

    def release(self) -> None:
        with self._admit_lock:
            self._admitted -= 1
        self.metrics.inflight.dec()

    def _prefill(
        self, pnode: NodeStatus, service_s: float, req: pb.PrefillRequest, t0: float
    ) -> tuple[pb.PrefillFirstToken | None, pb.PrefillPublished | None, float]:
        """One Prefill call on `pnode` (in flight until its first token): (first token, published, TTFT
        from `t0`). Raises the call's `grpc.RpcError`."""
        pending = True

        def end_prefill() -> None:
            nonlocal pending
            if pending:
                pending = False
                self.inflight.end(pnode.node.node_id, pnode.node.epoch, service_s)

        first: pb.PrefillFirstToken | None = None
        published: pb.PrefillPublished | None = None
        ttft_s = 0.0
        try:
            stream = self._stub(pnode.node.grpc_address, "prefill").Prefill(
                req, timeout=self.settings.request_timeout_s
            )
            for ev in stream:
                if ev.HasField("first_token"):
                    ttft_s = time.perf_counter() - t0
                    first = ev.first_token
                    end_prefill()
                elif ev.HasField("published"):
                    published = ev.published
        finally:
            end_prefill()
        return first, published, ttft_s

    def generate(
        self, tokens: Sequence[int], sampling: Sampling, *, cache_salt: str = "", request_id: str = ""
    ) -> Generator[Event, None, None]:
        """Serve one admitted request: "first", then "tokens"*, then "done". Raises `KVPoolError`."""
        rid = request_id or uuid.uuid4().hex[:16]
        tokens = list(tokens)
        t0 = time.perf_counter()
        peeked = self.peek(tokens, cache_salt)
        req = pb.PrefillRequest(
            request_id=rid, token_ids=tokens, sampling=sampling.to_proto(), cache_salt=cache_salt,
            publish=True, use_cache=True,
        )  # fmt: skip
        tried: list[str] = []
        failure = ""
        while True:  # nothing reaches the client before the prefill ends: an unreachable node is retried
            choice, pnode = self.choose_prefill(peeked, tried)
            if failure:
                log.warning("[%s] %s; retrying on %s", rid, failure, pnode.node.node_id)
            try:
                first, published, ttft_s = self._prefill(pnode, choice.prediction.service_s, req, t0)
                break
            except grpc.RpcError as exc:
                failure = self._call_failed("prefill", pnode, exc, tried)
        self.node_answered(pnode)
        if first is None:
            raise Unavailable(f"prefill on {pnode.node.node_id} ended without a first token")
        stats = first.stats
        self.metrics.ttft.observe(ttft_s)
        self.metrics.prompt_tokens.inc(len(tokens))
        self.metrics.cached_tokens.inc(stats.num_reused_tokens)
        log.info("[%s] prefill %s (%s, predicted %.3fs): prompt=%d cached=%d ttft=%.3fs", rid,
                 pnode.node.node_id, self.policy.policy, choice.prediction.ttft_s, len(tokens),
                 stats.num_reused_tokens, ttft_s)  # fmt: skip
        common: dict[str, Any] = {"prompt_tokens": len(tokens), "cached_tokens": int(stats.num_reused_tokens),
                  "prefill_node": pnode.node.node_id}  # fmt: skip
        yield Event("first", token_ids=[first.token_id], ttft_s=ttft_s, **common)
        stop = set(sampling.stop_token_ids)
        if first.token_id in stop or sampling.max_tokens <= 1:
            self.metrics.completion_tokens.inc(1)
            reason = "stop" if first.token_id in stop else "length"
            yield Event("done", finish_reason=reason, ttft_s=ttft_s, **common)
            return
        status = published.status if published is not None else "publish_failed"
        dreq = pb.DecodeRequest(
            request_id=rid, token_ids=tokens, first_token=first.token_id, block_hashes=list(first.block_hashes),
            sampling=sampling.to_proto(), cache_salt=cache_salt, prompt_committed=status == "committed",
            publish=True, use_cache=True,
        )  # fmt: skip
        n_out = 1
        t_first = time.perf_counter()
        tried = []
        failure = ""
        while True:
            dnode = self.pick_decode(tried)
            if failure:
                log.warning("[%s] %s; retrying on %s", rid, failure, dnode.node.node_id)
            reason = "length"
            self.decode_inflight.begin(dnode.node.node_id, dnode.node.epoch)
            try:
                for dev in self._stub(dnode.node.grpc_address, "decode").Decode(
                    dreq, timeout=self.settings.request_timeout_s
                ):
                    if dev.token_ids:
                        n_out += len(dev.token_ids)
                        yield Event("tokens", token_ids=list(dev.token_ids))
                    if dev.finished:
                        reason = dev.stats.finish_reason or reason
                break
            except grpc.RpcError as exc:
                if n_out > 1:  # this node's tokens went out: never retried
                    if hasattr(exc, "code") and exc.code() == grpc.StatusCode.UNAVAILABLE:
                        self.node_failed("decode", dnode)
                    raise_from_rpc_error(exc, f"decode on {dnode.node.node_id}")
                failure = self._call_failed("decode", dnode, exc, tried)
            finally:
                self.decode_inflight.end(dnode.node.node_id, dnode.node.epoch)
        self.node_answered(dnode)
        self.metrics.completion_tokens.inc(n_out)
        if n_out > 1:
            self.metrics.tpot.observe((time.perf_counter() - t_first) / (n_out - 1))
        yield Event("done", finish_reason=reason, decode_node=dnode.node.node_id, ttft_s=ttft_s, **common)
