"""The master's side of membership (`kvpool.membership`): join challenges, store proofs, join tokens.

`Membership.secured` is fixed at start: a master with the cluster secret admits only stores that prove
they hold it and other roles that present a join token listed in `MasterSettings.join_tokens_file`. A
master without the secret admits anyone and says so loudly at start-up (`warn_if_unsecured`).

Join challenges are stateless (`kvpool.master.challenges`): the master keeps nothing per challenge it
hands out, so no caller can fill a table by asking for them; it keeps only the challenges already spent
by a successful registration, per node id and within their expiry (`SpentChallenges`), and only a
holder of the cluster secret can add one. The token table is the operator's file.
Thread-safe (its own lock; never calls into the master).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from pathlib import Path

from kvpool.capability import Capabilities
from kvpool.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvpool.master.challenges import ChallengeMinter, SpentChallenges
from kvpool.membership import SESSION_NBYTES, read_token_roles, store_proof, token_digest
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
        challenge_ttl_ms: int,
        max_spent_challenges_per_node: int = 16,
    ) -> None:
        self._caps = capabilities
        self._tokens_path = Path(tokens_file) if tokens_file else None
        self._clock = clock
        self._ttl_ms = challenge_ttl_ms
        self._lock = threading.Lock()
        self._minter = ChallengeMinter(capabilities, ttl_ms=challenge_ttl_ms) if capabilities else None
        self._spent = SpentChallenges(max_per_node=max_spent_challenges_per_node)
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
        """A challenge for `node_id` and its TTL in ms; (b"", 0) when unsecured. Stateless: nothing is
        kept per challenge (`kvpool.master.challenges`), so asking for any number never refuses a store."""
        if self._minter is None:
            return b"", 0
        return self._minter.mint(node_id, self._clock.now_ms()), self._ttl_ms

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
        """Check `challenge` (this master's MAC, unexpired, for `node_id`, not spent) and `proof`
        (`kvpool.membership.store_proof`), then spend the challenge. Raises `Unauthenticated` for a
        missing, forged, expired, foreign or spent challenge or a wrong proof."""
        if self._caps is None or self._minter is None:
            return
        if not challenge or not proof:
            raise Unauthenticated(
                f"store {node_id!r} did not prove it holds the cluster secret: this cluster is secured; "
                "start the store with the master's secret (KVPOOL_CLUSTER_SECRET_FILE)"
            )
        now_ms = self._clock.now_ms()
        issued_ms = self._minter.check(bytes(challenge), node_id, now_ms)  # raises Unauthenticated
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
        # only a proven store gets here: the spent set grows with real registrations, never with callers
        if not self._spent.spend(node_id, bytes(challenge), issued_ms, now_ms, self._ttl_ms):
            raise Unauthenticated(
                f"store {node_id!r}: this join challenge was already spent (a replayed registration?)"
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

    def num_spent_challenges(self) -> int:
        """Spent challenges remembered (all node ids): what a replay is checked against."""
        return self._spent.size()

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
