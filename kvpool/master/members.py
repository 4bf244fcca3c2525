"""The master's side of membership (`kvpool.membership`): join challenges, store proofs, join tokens.

`Membership.secured` is fixed at start: a master with the cluster secret admits only stores that prove
they hold it and other roles that present a join token listed in `MasterSettings.join_tokens_file`. A
master without the secret admits anyone and says so loudly at start-up (`warn_if_unsecured`).

State is bounded: at most `max_pending_challenges` unanswered challenges (each expires after
`challenge_ttl_ms`; past the cap, RESOURCE_EXHAUSTED), and the token table is the operator's file.
Thread-safe (its own lock; never calls into the master).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path

from kvpool.capability import Capabilities
from kvpool.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unauthenticated
from kvpool.membership import CHALLENGE_NBYTES, SESSION_NBYTES, read_token_roles, store_proof, token_digest
from kvpool.types import Clock

log = logging.getLogger(__name__)

TOKEN_RELOAD_INTERVAL_S = 0.5
"""How often at most the token file's mtime is checked (a revocation takes effect within this)."""

UNSECURED_WARNING = (
    "UNSECURED CLUSTER: this master has no cluster secret, so ANY process that reaches it can register a "
    "store (and be given tenants' KV), read and write every block, and run admin operations. For local "
    "experiments only; `kvpool up` starts a secured cluster (see docs/security.md)."
)


class Membership:
    """Challenges, proofs and tokens. `capabilities` None = unsecured (every check passes)."""

    def __init__(
        self,
        capabilities: Capabilities | None,
        *,
        tokens_file: str,
        clock: Clock,
        max_pending_challenges: int,
        challenge_ttl_ms: int,
    ) -> None:
        self._caps = capabilities
        self._tokens_path = Path(tokens_file) if tokens_file else None
        self._clock = clock
        self._max_challenges = max_pending_challenges
        self._ttl_ms = challenge_ttl_ms
        self._lock = threading.Lock()
        self._challenges: OrderedDict[bytes, tuple[str, int]] = OrderedDict()  # -> (node id, expiry ms)
        self._tokens: dict[str, tuple[str, str]] = {}  # sha256 hex -> (name, role)
        self._names: set[str] = set()
        self._tokens_mtime_ns: int | None = None
        self._next_reload_s = 0.0
        if self.secured:
            self._reload(force=True)

    @property
    def secured(self) -> bool:
        return self._caps is not None

    def warn_if_unsecured(self) -> None:
        if not self.secured:
            log.warning(UNSECURED_WARNING)
            if self._tokens_path:
                log.warning(
                    "join_tokens_file %s is ignored: without a cluster secret anyone may join",
                    self._tokens_path,
                )
        elif not self._tokens_path:
            log.warning(
                "secured cluster without a join token file (join_tokens_file): only stores can join; "
                "serving nodes, routers, vLLM connectors and admin clients are refused"
            )

    # ---- stores -----------------------------------------------------------------------------------
    def new_challenge(self, node_id: str) -> tuple[bytes, int]:
        """A single-use challenge for `node_id` and its TTL in ms; (b"", 0) when unsecured. Raises
        `ResourceExhausted` when `max_pending_challenges` unanswered, unexpired challenges exist."""
        if not self.secured:
            return b"", 0
        now = self._clock.now_ms()
        with self._lock:
            while self._challenges:
                first, (_, expiry) = next(iter(self._challenges.items()))
                if expiry > now:
                    break
                del self._challenges[first]
            if len(self._challenges) >= self._max_challenges:
                raise ResourceExhausted(
                    f"{len(self._challenges)} join challenges are pending, the cap "
                    "(max_pending_challenges); retry after challenge_ttl_ms"
                )
            challenge = secrets.token_bytes(CHALLENGE_NBYTES)
            self._challenges[challenge] = (node_id, now + self._ttl_ms)
        return challenge, self._ttl_ms

    def admit_store(
        self,
        *,
        challenge: bytes,
        proof: bytes,
        node_id: str,
        role: str,
        epoch: int,
        grpc_address: str,
        data_address: str,
    ) -> None:
        """Spend `challenge` and check `proof` (`kvpool.membership.store_proof`). Raises
        `Unauthenticated` for a missing, unknown, spent, expired or foreign challenge or a wrong proof."""
        if self._caps is None:
            return
        if not challenge or not proof:
            raise Unauthenticated(
                f"store {node_id!r} did not prove it holds the cluster secret: this cluster is secured; "
                "start the store with the master's secret (KVPOOL_CLUSTER_SECRET_FILE)"
            )
        with self._lock:
            entry = self._challenges.pop(bytes(challenge), None)
        if entry is None or entry[0] != node_id or entry[1] <= self._clock.now_ms():
            raise Unauthenticated(
                f"store {node_id!r}: unknown, spent or expired join challenge (a replayed registration?)"
            )
        expected = store_proof(
            self._caps,
            challenge,
            node_id=node_id,
            role=role,
            epoch=epoch,
            grpc_address=grpc_address,
            data_address=data_address,
        )
        if not hmac.compare_digest(expected, bytes(proof)):
            raise Unauthenticated(
                f"store {node_id!r} failed the membership proof: it does not hold this cluster's secret"
            )

    # ---- join tokens ------------------------------------------------------------------------------
    def token_name(self, token: str) -> str:
        """The name of an active join token; "" for any caller of an unsecured master. Raises
        `Unauthenticated` for a missing or unknown (revoked) token."""
        return self.token_role(token)[0]

    def token_role(self, token: str) -> tuple[str, str]:
        """(name, role) of an active join token (`kvpool.master.roles`); ("", "admin") for any caller of an
        unsecured master. Raises `Unauthenticated` for a missing or unknown (revoked) token."""
        if not self.secured:
            return "", "admin"
        self._reload()
        if not token:
            raise Unauthenticated(
                "this cluster is secured: present a join token (KVPOOL_JOIN_TOKEN or KVPOOL_JOIN_TOKEN_FILE)"
            )
        entry = self._tokens.get(token_digest(token))
        if entry is None:
            raise Unauthenticated("unknown or revoked join token")
        return entry

    def check_still_active(self, name: str) -> None:
        """For a node that joined with token `name`: `PermissionDenied` once that token was revoked."""
        if not self.secured or not name:
            return
        self._reload()
        if name not in self._names:
            raise PermissionDenied(f"join token {name!r} was revoked: this node is no longer a member")

    def num_pending_challenges(self) -> int:
        with self._lock:
            return len(self._challenges)

    def _reload(self, *, force: bool = False) -> None:
        if self._tokens_path is None:
            return
        now_s = time.monotonic()
        if not force and now_s < self._next_reload_s:
            return
        self._next_reload_s = now_s + TOKEN_RELOAD_INTERVAL_S
        try:
            mtime = self._tokens_path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = -1
        if mtime == self._tokens_mtime_ns:
            return
        try:
            tokens = read_token_roles(self._tokens_path)
        except (InvalidArgument, OSError) as exc:
            if force:
                raise InvalidArgument(str(exc)) from None
            log.error("keeping the previous join tokens: %s", exc)
            return
        with self._lock:
            self._tokens, self._names = tokens, {name for name, _ in tokens.values()}
            self._tokens_mtime_ns = mtime
        log.info("join tokens: %d active (%s)", len(tokens), self._tokens_path)


def new_session() -> bytes:
    return secrets.token_bytes(SESSION_NBYTES)
