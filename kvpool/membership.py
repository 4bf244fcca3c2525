"""Who may join a secured cluster: store proofs of the cluster secret and the join tokens of other roles.

A cluster is *secured* when its master holds the cluster secret (`kvpool.capability`; every cluster
`kvpool up` or `LocalCluster` starts). Then:

- a **store** proves it holds the secret when it registers, without sending it: it asks the master for a
  single-use challenge (`JoinChallenge`; stateless, `kvpool.master.challenges`) and answers `store_proof(secret, challenge, endpoint)`, an
  HMAC-SHA256 (RFC 2104) over a tagged, length-prefixed message binding the challenge to its node id,
  role, epoch and addresses. A replayed registration fails (the challenge was spent), and so does a proof
  made for another endpoint.
- every **other role** (serving nodes, vLLM connectors, routers, admin and benchmark clients) presents a
  **join token** in the `kvpool-join-token` call metadata. The master keeps only the tokens' SHA-256
  digests, by name, in a JSON file it re-reads when it changes (`kvpool token new|revoke|list`), so an
  operator rotates or revokes tokens without touching the stores (which never see them) or restarting
  the master.

The master's control calls to a store (reserve, commit, free, inventory, copy) carry a single-use
credential keyed by the same secret, bound to the store, the method and the request body, valid a few
seconds (`master_call_credential`), so a process that reaches a store's gRPC port cannot free, overwrite or
list its slots, nor replay a captured call elsewhere, with another body, or twice (`CallNonces`).

Leadership (`kvpool.master.ha`) is proven the same way: the leader key a master writes in etcd carries a
MAC over its address and lease (`leader_claim`), and its orders carry a MAC over its address and epoch
(`leader_proof`), which a store needs before it takes a higher epoch.

This module is shared by the master, the store and the CLI; only `CallNonces` holds state.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import struct
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

from kvpool.capability import Capabilities
from kvpool.errors import InvalidArgument, Unauthenticated

JOIN_TOKEN_METADATA = "kvpool-join-token"
"""gRPC metadata key carrying a join token (lower case, as gRPC requires)."""
SESSION_NBYTES = 32
"""Random bytes of a registration's session (`RegisterNodeResponse.session`)."""
MIN_TOKEN_CHARS = 22
"""A join token shorter than this (about 128 bits of `secrets.token_urlsafe`) is refused."""
TOKEN_ROLES = ("admin", "router", "serving", "engine", "store")
"""What a join token may do (`kvpool.master.roles` holds each role's master calls). A token file entry
without a role is an `admin` token (files written before roles existed keep working as they did)."""
DEFAULT_TOKEN_ROLE = "admin"

_PROOF_TAG = b"\x0fkvpool-join-v1\x00"
_U64 = struct.Struct(">Q")


def _lp(value: bytes) -> bytes:
    if len(value) > 0xFFFF:
        raise InvalidArgument(f"membership field of {len(value)} bytes is too long")
    return len(value).to_bytes(2, "big") + value


def store_proof(
    key: Capabilities,
    challenge: bytes,
    *,
    node_id: str,
    role: str,
    epoch: int,
    grpc_address: str,
    data_address: str,
) -> bytes:
    """HMAC-SHA256 (32 bytes) keyed by the cluster secret (`key`) over the challenge and the registering
    endpoint.

    Raises `InvalidArgument` for an epoch outside uint64 or a field over 65,535 bytes."""
    if not 0 <= epoch < 1 << 64:
        raise InvalidArgument(f"epoch {epoch} is not a uint64")
    message = b"".join(
        (
            _PROOF_TAG,
            _lp(challenge),
            _lp(node_id.encode()),
            _lp(role.encode()),
            _U64.pack(epoch),
            _lp(grpc_address.encode()),
            _lp(data_address.encode()),
        )
    )
    return key.proof(message)


def token_digest(token: str) -> str:
    """Hex SHA-256 of a join token: what the master's token file keeps."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_join_token() -> str:
    """A fresh join token: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def read_tokens(path: Path) -> dict[str, str]:
    """The token file's {sha256 hex digest: name}. A missing file holds no tokens.

    Raises `InvalidArgument` naming the file when it is not the JSON `kvpool token` writes."""
    return {digest: name for digest, (name, _role) in read_token_roles(path).items()}


def read_token_roles(path: Path) -> dict[str, tuple[str, str]]:
    """The token file's {sha256 hex digest: (name, role)}; an entry without `role` is `admin`. A missing
    file holds no tokens.

    The file: `{"tokens": [{"name": str, "sha256": hex, "role": one of TOKEN_ROLES}, ...]}`. Raises
    `InvalidArgument` naming the file when it is not that JSON or names an unknown role."""
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"cannot read the join token file {path}: {exc}") from None
    try:
        doc = json.loads(raw)
        entries = doc["tokens"]
        out = {str(e["sha256"]): (str(e["name"]), str(e.get("role", DEFAULT_TOKEN_ROLE))) for e in entries}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidArgument(
            f"join token file {path} is malformed ({exc}); write it with `kvpool token`"
        ) from None
    for digest, (name, role) in out.items():
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise InvalidArgument(f"join token file {path}: {digest!r} is not a hex SHA-256")
        if role not in TOKEN_ROLES:
            raise InvalidArgument(
                f"join token file {path}: token {name!r} has role {role!r}, not one of {', '.join(TOKEN_ROLES)}"
            )
    return out


def _write_tokens(path: Path, tokens: dict[str, tuple[str, str]]) -> None:
    """Replace the file atomically (a master reading it never sees half a file); mode 0600."""
    entries = sorted(tokens.items(), key=lambda kv: kv[1][0])
    doc = {"tokens": [{"name": name, "sha256": digest, "role": role} for digest, (name, role) in entries]}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_token(path: Path, name: str, token: str | None = None, *, role: str = DEFAULT_TOKEN_ROLE) -> str:
    """Add a token named `name` with `role` (one of `TOKEN_ROLES`) to the master's token file (created if
    missing) and return the token (the file keeps only its digest: show it once). Raises `InvalidArgument`
    for an empty or taken name, an unknown role or a token shorter than `MIN_TOKEN_CHARS`."""
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", name):
        raise InvalidArgument(f"a join token's name is 1-128 of A-Z a-z 0-9 . _ -, got {name!r}")
    if role not in TOKEN_ROLES:
        raise InvalidArgument(f"a join token's role is one of {', '.join(TOKEN_ROLES)}, got {role!r}")
    token = token if token is not None else new_join_token()
    if len(token) < MIN_TOKEN_CHARS:
        raise InvalidArgument(f"a join token needs at least {MIN_TOKEN_CHARS} characters")
    tokens = read_token_roles(path)
    if any(n == name for n, _ in tokens.values()):
        raise InvalidArgument(f"a join token named {name!r} exists in {path}: revoke it first or pick a name")
    tokens[token_digest(token)] = (name, role)
    _write_tokens(path, tokens)
    return token


def revoke_token(path: Path, name: str) -> bool:
    """Remove the token named `name`; False when there was none. A running master refuses it at once (new
    calls) and at the next heartbeat of each node that joined with it."""
    tokens = read_token_roles(path)
    kept = {d: e for d, e in tokens.items() if e[0] != name}
    if len(kept) == len(tokens):
        return False
    _write_tokens(path, kept)
    return True


def new_cluster_tokens(directory: Path, name: str = "cluster") -> tuple[str, dict[str, str], dict[str, str]]:
    """A fresh join token for a cluster started here (`kvpool up`, `LocalCluster`): returns (token, the
    master's environment entries naming the digest file `directory/join_tokens.json`, the members'
    entries naming the 0600 token file `directory/join_token`)."""
    tokens_file = Path(directory) / "join_tokens.json"
    token = add_token(tokens_file, name)
    token_file = Path(directory) / "join_token"
    _write_secret_file(token_file, token)
    return (
        token,
        {"KVPOOL_JOIN_TOKENS_FILE": str(tokens_file)},
        {"KVPOOL_JOIN_TOKEN_FILE": str(token_file)},
    )


def new_role_tokens(directory: Path, names: dict[str, str]) -> tuple[dict[str, str], dict[str, Path]]:
    """Fresh join tokens for a cluster started here (`kvpool up`), one per entry of `names` ({token name:
    role}): each in its own 0600 file `directory/join_token.<name>`. Returns (the master's environment
    entries naming the digest file `directory/join_tokens.json`, {token name: its token file})."""
    tokens_file = Path(directory) / "join_tokens.json"
    files: dict[str, Path] = {}
    for name, role in names.items():
        token = add_token(tokens_file, name, role=role)
        files[name] = Path(directory) / f"join_token.{name}"
        _write_secret_file(files[name], token)
    return {"KVPOOL_JOIN_TOKENS_FILE": str(tokens_file)}, files


def _write_secret_file(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


# ---- the master's calls to stores ----------------------------------------------------------------

MASTER_CALL_METADATA = "kvpool-master-call"
"""gRPC metadata key of the credential on the master's control calls to a store of a secured cluster."""
MASTER_CALL_SKEW_MS = 5_000
"""How far apart master and store wall clocks (and a credential's age) may be, either way."""
CALL_NONCE_NBYTES = 16
"""Random bytes of a credential's nonce."""
MAX_CALL_NONCES = 200_000
"""Nonces a store remembers at once (two skew windows' worth of calls); past it, a call is refused."""
_CALL_TAG = b"\x0fkvpool-master-call-v2\x00"


def _call_message(store: str, method: str, body: bytes, now_ms: int, nonce: bytes) -> bytes:
    digest = hashlib.sha256(body).digest()
    return _CALL_TAG + _lp(store.encode()) + _lp(method.encode()) + digest + _U64.pack(now_ms) + _lp(nonce)


def master_call_credential(
    key: Capabilities, store: str, method: str, body: bytes, now_ms: int, nonce: bytes | None = None
) -> str:
    """`"<ms>.<nonce hex>.<hex HMAC-SHA256(secret, tag, store, method, SHA-256(body), ms, nonce)>"`: proves a
    store control call (reserve, commit, free, inventory, copy) comes from a holder of the cluster secret,
    for this store (its gRPC address, as the master dials it), this method and this request body
    (its serialized bytes), now, once (a fresh random `nonce` unless given)."""
    nonce = secrets.token_bytes(CALL_NONCE_NBYTES) if nonce is None else nonce
    mac = key.proof(_call_message(store, method, body, now_ms, nonce))
    return f"{now_ms}.{nonce.hex()}.{mac.hex()}"


class CallNonces:
    """The nonces of the master's credentials a store has taken, each kept `keep_ms` (two skew windows:
    long enough that a replay is refused by its age once its nonce is forgotten), at most `max_entries`.
    Thread-safe; `now_ms` is a monotonic clock (ms)."""

    def __init__(self, *, keep_ms: int = 2 * MASTER_CALL_SKEW_MS, max_entries: int = MAX_CALL_NONCES) -> None:
        self.keep_ms = keep_ms
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> forget after (monotonic ms)

    def __len__(self) -> int:
        return len(self._seen)

    def spend(self, nonce: bytes, now_ms: int) -> str | None:
        """Record `nonce`; None when new, else why it is refused (seen already, or the cache is full)."""
        with self._lock:
            seen = self._seen
            while seen and next(iter(seen.values())) <= now_ms:
                seen.popitem(last=False)
            if nonce in seen:
                return "credential replayed (nonce seen)"
            if len(seen) >= self.max_entries:
                return f"{self.max_entries} credentials in {self.keep_ms} ms: nonce cache full"
            seen[nonce] = now_ms + self.keep_ms
            return None


def check_master_call(
    key: Capabilities,
    store: str,
    method: str,
    body: bytes,
    value: str,
    now_ms: int,
    nonces: CallNonces,
    mono_ms: int,
) -> None:
    """Raise `Unauthenticated` unless `value` is `master_call_credential(key, store, method, body, t, n)`
    with `t` within `MASTER_CALL_SKEW_MS` of `now_ms` (wall clock) and a nonce `n` not spent on this store
    (`nonces`, at monotonic `mono_ms`)."""
    stamp, _, rest = value.partition(".")
    nonce_hex, _, mac = rest.partition(".")
    if not stamp.isdigit() or abs(int(stamp) - now_ms) > MASTER_CALL_SKEW_MS:
        raise Unauthenticated(f"{method}: only the master may call this (missing or stale credential)")
    try:
        nonce, given = bytes.fromhex(nonce_hex), bytes.fromhex(mac)
    except ValueError:
        raise Unauthenticated(f"{method}: only the master may call this (malformed credential)") from None
    expected = key.proof(_call_message(store, method, body, int(stamp), nonce))
    if len(nonce) != CALL_NONCE_NBYTES or not hmac.compare_digest(expected, given):
        raise Unauthenticated(f"{method}: only the master may call this (bad credential)")
    why = nonces.spend(nonce, mono_ms)
    if why is not None:
        raise Unauthenticated(f"{method}: only the master may call this ({why})")


# ---- who leads (kvpool.master.ha) ------------------------------------------------------------------

LEADER_PROOF_METADATA = "kvpool-leader-proof"
"""gRPC metadata key of a leader's proof of its epoch on its orders to a store (`leader_proof`)."""
_LEADER_TAG = b"\x0fkvpool-leader-v1\x00"
_CLAIM_TAG = b"\x0fkvpool-leader-claim-v1\x00"


def leader_proof(key: Capabilities, address: str, epoch: int) -> str:
    """`"<hex HMAC-SHA256(secret, tag, epoch, address)>.<address>"`: the master at `address` won leader
    `epoch` (a store takes a higher epoch only with this proof; `kvpool.store.fence`)."""
    mac = key.proof(_LEADER_TAG + _U64.pack(epoch) + _lp(address.encode()))
    return f"{mac.hex()}.{address}"


def check_leader_proof(key: Capabilities, epoch: int, value: str) -> str:
    """The leader's address proven by `value` for `epoch`; raise `Unauthenticated` when it proves nothing."""
    _, _, address = value.partition(".")
    if not address or not hmac.compare_digest(leader_proof(key, address, epoch).encode(), value.encode()):
        raise Unauthenticated(f"leader epoch {epoch} comes without a valid leader proof")
    return address


def leader_claim(key: Capabilities | None, address: str, lease_id: int) -> bytes:
    """The value a master puts at the election's leader key: its address and, in a secured cluster, a MAC
    under the secret over (address, etcd lease id), so a key written by anyone else names no leader."""
    if key is None:
        return address.encode()
    mac = key.proof(_CLAIM_TAG + _U64.pack(lease_id) + _lp(address.encode()))
    return f"{address} {mac.hex()}".encode()


def read_leader_claim(key: Capabilities | None, value: bytes, lease_id: int) -> str | None:
    """The address a leader key's `value` (held under etcd lease `lease_id`) names; None when it is not a
    master's claim (a forged key: no MAC, a wrong one, or one made for another lease)."""
    try:
        text = value.decode()
    except UnicodeDecodeError:
        return None
    if key is None:
        return text or None
    address, _, _ = text.partition(" ")
    if not address or not hmac.compare_digest(leader_claim(key, address, lease_id), value):
        return None
    return address
