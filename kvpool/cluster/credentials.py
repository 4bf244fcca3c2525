"""The credentials `kvpool up` gives each role, and only those (least privilege, docs/security.md).

| launch role | gets |
|---|---|
| master | the cluster secret, the join tokens' digest file |
| store | the cluster secret |
| router | a `router` join token, the serving key (it calls the serving nodes and engines) |
| prefill, decode | a `serving` join token of its own (`serving-<launch name>`), the serving key's SHA-256 |
| vllm-prefill, vllm-decode | an `engine` join token of its own (`engine-<launch name>`), the serving key as vLLM's API key (`VLLM_API_KEY`) |
| etcd | nothing |

Every serving node and engine gets a token of its own, never one it shares: the master binds writes,
reservations and read leases to the token that made them (`kvpool.master.roles.check_writer`), so a node
holding one token cannot write as, or end the leases of, another node. An `admin` token and the serving
key are left for the operator (`kvpool admin`). Every role's environment
starts from the operator's with every credential variable removed (`scrubbed`), so a secret the operator
exported (the natural multi-host set-up) reaches the master and the stores only; the operator's secret is
used for them instead of a fresh one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.capability import new_secret_env
from kvpool.cluster.launch import Launch
from kvpool.membership import new_role_tokens
from kvpool.rpc.serving_key import DIGEST_ENV, KEY_FILE_ENV, new_serving_key
from kvpool.tenants import SALT_KEY_ENV

SECRET_ENV = ("KVPOOL_CLUSTER_SECRET", "KVPOOL_CLUSTER_SECRET_FILE")
CREDENTIAL_ENV = (
    *SECRET_ENV,
    "KVPOOL_JOIN_TOKEN",
    "KVPOOL_JOIN_TOKEN_FILE",
    "KVPOOL_JOIN_TOKENS_FILE",
    KEY_FILE_ENV,
    DIGEST_ENV,
    "VLLM_API_KEY",
    SALT_KEY_ENV,
    "KVPOOL_ETCD_USER",
    "KVPOOL_ETCD_PASSWORD_FILE",
    "KVPOOL_ETCD_CA_FILE",
    "KVPOOL_ETCD_CERT_FILE",
    "KVPOOL_ETCD_KEY_FILE",
)
"""Every variable that carries a credential: none passes from the operator's environment to a role."""

TOKEN_ROLE = {
    "router": "router",
    "prefill": "serving",
    "decode": "serving",
    "vllm-prefill": "engine",
    "vllm-decode": "engine",
    "vllm": "engine",
}
"""The join-token role of each launch role that presents a token (`kvpool.master.roles`)."""
SHARED_TOKENS = {"admin": "admin", "router": "router"}
"""The tokens `kvpool up` issues besides one per serving node and engine ({token name: role}); stores
prove the secret and need none."""
SECRET_HOLDERS = ("master", "store")


def token_name(launch: Launch) -> str:
    """The name of the join token `kvpool up` gives `launch`: "router" for the router, "<role>-<launch
    name>" ("serving-prefill0", "engine-vllm-decode1") for a serving node or engine; "" for a role that
    presents none (master, store, etcd)."""
    role = TOKEN_ROLE.get(launch.role)
    if role is None:
        return ""
    return role if role in SHARED_TOKENS else f"{role}-{launch.name}"


def scrubbed(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without any credential variable (`CREDENTIAL_ENV`)."""
    return {k: v for k, v in environ.items() if k not in CREDENTIAL_ENV}


@dataclass(frozen=True, slots=True)
class UpCredentials:
    """The credentials of one `kvpool up` (`make`); an unsecured one holds none."""

    secret_env: dict[str, str] = field(default_factory=dict)
    master_env: dict[str, str] = field(default_factory=dict)
    token_files: dict[str, Path] = field(default_factory=dict)  # token name -> its 0600 file
    caller_env: dict[str, str] = field(default_factory=dict)  # the serving key's file
    node_env: dict[str, str] = field(default_factory=dict)  # the serving key's digest
    engine_env: dict[str, str] = field(default_factory=dict)  # the serving key as vLLM's API key
    made: list[Path] = field(default_factory=list)  # the files made here (never the operator's secret)

    @classmethod
    def make(
        cls, directory: Path, environ: Mapping[str, str], launches: Iterable[Launch] = ()
    ) -> UpCredentials:
        """Fresh join tokens (admin, router, and one per serving node and engine of `launches`, named by
        `token_name`) and a fresh serving key in 0600 files under `directory`; the cluster secret is the
        operator's (from `environ`) when it sets one, else a fresh 0600 file."""
        operator_secret = {k: environ[k] for k in SECRET_ENV if environ.get(k)}
        secret_env = operator_secret or new_secret_env(directory)
        names = dict(SHARED_TOKENS)
        for launch in launches:
            name = token_name(launch)
            if name and name not in names:
                names[name] = TOKEN_ROLE[launch.role]
        master_env, token_files = new_role_tokens(directory, names)
        caller_env, node_env = new_serving_key(directory)
        key_file = Path(caller_env[KEY_FILE_ENV])
        made = [*token_files.values(), key_file, *(Path(v) for v in master_env.values())]
        if not operator_secret:
            made += [Path(v) for k, v in secret_env.items() if k.endswith("_FILE")]
        engine_env = {"VLLM_API_KEY": key_file.read_text().strip()}
        return cls(secret_env, master_env, token_files, caller_env, node_env, engine_env, made)

    @property
    def secured(self) -> bool:
        return bool(self.secret_env)

    def token_file(self, launch: Launch) -> Path:
        """The 0600 file of `launch`'s own join token (`token_name`). Raises `KeyError` naming the launch
        when `make` was not given it (a serving node or engine never falls back to a shared token)."""
        name = token_name(launch)
        if name not in self.token_files:
            raise KeyError(f"no join token was made for {launch.name!r} ({launch.role})")
        return self.token_files[name]

    def env_for(self, launch: Launch) -> dict[str, str]:
        """The credential entries of `launch` (see the module table); {} unsecured. Raises `KeyError` for a
        serving node or engine `make` was not given."""
        if not self.secured:
            return {}
        role = launch.role
        if role in SECRET_HOLDERS:
            return dict(self.secret_env) | (self.master_env if role == "master" else {})
        token_role = TOKEN_ROLE.get(role)
        if token_role is None:
            return {}
        env = {"KVPOOL_JOIN_TOKEN_FILE": str(self.token_file(launch))}
        if role == "router":
            return env | self.caller_env
        if token_role == "serving":
            return env | self.node_env
        return env | self.engine_env

    def admin_env(self) -> dict[str, str]:
        """What the operator exports for `kvpool admin` (and direct calls to the serving nodes)."""
        if not self.secured:
            return {}
        return {"KVPOOL_JOIN_TOKEN_FILE": str(self.token_files["admin"])} | self.caller_env

    def remove_files(self) -> None:
        """Delete the credential files this made (when the cluster stops; the operator's stay)."""
        for path in self.made:
            path.unlink(missing_ok=True)

    def remote_note(self, launch: Launch, salt_env: Mapping[str, str] | None = None) -> str:
        """What `launch`, started by hand on another host, must be given (printed beside its command line):
        the cluster secret (master, store), its join token and the serving key or its digest (router,
        serving nodes, engines), and for the master and the router the tenants' salt key of `salt_env`
        (`kvpool.tenants.SALT_KEY_ENV`: the two must share it, secured or not)."""
        role = launch.role
        parts: list[str] = []
        if self.secured and role in SECRET_HOLDERS:
            where = ", ".join(f"{k} = {v}" for k, v in self.secret_env.items() if k.endswith("_FILE"))
            parts.append(f"the cluster secret: {where or 'the same KVPOOL_CLUSTER_SECRET'}, a 0600 copy")
        token_role = TOKEN_ROLE.get(role)
        if self.secured and token_role is not None:
            parts.append(f"KVPOOL_JOIN_TOKEN_FILE = a 0600 copy of {self.token_file(launch)}")
            if role == "router":
                parts.append(f"{KEY_FILE_ENV} = a 0600 copy of {self.caller_env[KEY_FILE_ENV]}")
            elif token_role == "serving":
                parts.append(f"{DIGEST_ENV}={self.node_env[DIGEST_ENV]}")
            else:
                parts.append(f"VLLM_API_KEY = the first line of {self.caller_env[KEY_FILE_ENV]}")
        if role in ("master", "router") and salt_env and salt_env.get(SALT_KEY_ENV):
            parts.append(f"{SALT_KEY_ENV} = a 0600 copy of {salt_env[SALT_KEY_ENV]}")
        return f"  ({'; '.join(parts)})" if parts else ""
