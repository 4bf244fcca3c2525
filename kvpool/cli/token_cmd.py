"""`kvpool token new|revoke|list`: the join tokens a secured master admits (`kvpool.membership`).

They edit the master's token file (JSON of SHA-256 digests by name; `--file`, default
`$KVPOOL_JOIN_TOKENS_FILE`), which a running master re-reads within a second: a new token works at once, a
revoked one is refused on its next call and each node that joined with it at its next heartbeat. Stores
never hold tokens (they prove the cluster secret), so rotating tokens never touches them.

Each token has a role (`--role`: admin, router, serving, engine, store; `kvpool.master.roles` lists what
each may call); a token written without one (older files) is an admin token.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

token_app = typer.Typer(
    help="Join tokens of a secured cluster: add, revoke, list (edits the master's token file).",
    no_args_is_help=True,
)

_FILE_HELP = "The master's join token file (default: $KVPOOL_JOIN_TOKENS_FILE)."


def _file(path: Path | None) -> Path:
    if path is not None:
        return path
    env = os.environ.get("KVPOOL_JOIN_TOKENS_FILE", "")
    if not env:
        typer.echo("kvpool token: give --file or set KVPOOL_JOIN_TOKENS_FILE", err=True)
        raise typer.Exit(2)
    return Path(env)


@token_app.command("new")
def new(
    name: str = typer.Argument(..., help="A name for the token (shown in logs, used to revoke it)."),
    file: Path | None = typer.Option(None, "--file", help=_FILE_HELP),
    out: Path | None = typer.Option(None, "--out", help="Write the token to this new 0600 file, not stdout."),
    role: str = typer.Option(
        "admin", "--role", help="What it may do: admin, router, serving, engine or store (docs/security.md)."
    ),
) -> None:
    """Add a token and print it once (the file keeps only its digest)."""
    from kvpool.errors import InvalidArgument
    from kvpool.membership import add_token

    path = _file(file)
    fd = None
    if out is not None:  # claimed before the token exists: never an active token nobody holds
        try:
            fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            typer.echo(f"kvpool token new: --out {out}: {exc.strerror}", err=True)
            raise typer.Exit(2) from None
    try:
        token = add_token(path, name, role=role)
    except InvalidArgument as exc:
        if fd is not None:
            os.close(fd)
            out.unlink(missing_ok=True)  # type: ignore[union-attr]
        typer.echo(f"kvpool token new: {exc}", err=True)
        raise typer.Exit(2) from None
    if out is None or fd is None:
        typer.echo(token)
        return
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    typer.echo(f"token {name!r} written to {out} (members: KVPOOL_JOIN_TOKEN_FILE={out.resolve()})")


@token_app.command("revoke")
def revoke(
    name: str = typer.Argument(..., help="The token's name."),
    file: Path | None = typer.Option(None, "--file", help=_FILE_HELP),
) -> None:
    """Remove a token: its holders are refused from their next call or heartbeat."""
    from kvpool.errors import InvalidArgument
    from kvpool.membership import revoke_token

    path = _file(file)
    if not path.exists():
        typer.echo(f"kvpool token revoke: no token file at {path}", err=True)
        raise typer.Exit(1)
    try:
        removed = revoke_token(path, name)
    except InvalidArgument as exc:
        typer.echo(f"kvpool token revoke: {exc}", err=True)
        raise typer.Exit(2) from None
    if not removed:
        typer.echo(f"kvpool token revoke: no token named {name!r}", err=True)
        raise typer.Exit(1)
    typer.echo(f"revoked {name!r}")


@token_app.command("list")
def list_tokens(
    file: Path | None = typer.Option(None, "--file", help=_FILE_HELP),
    roles: bool = typer.Option(False, "--roles", help="Print each name with its role."),
) -> None:
    """The names of the active tokens (one per line; `--roles`: "NAME ROLE")."""
    from kvpool.errors import InvalidArgument
    from kvpool.membership import read_token_roles

    path = _file(file)
    if not path.exists():
        typer.echo(f"kvpool token list: no token file at {path}", err=True)
        raise typer.Exit(1)
    try:
        tokens = read_token_roles(path)
    except InvalidArgument as exc:
        typer.echo(f"kvpool token list: {exc}", err=True)
        raise typer.Exit(2) from None
    for name, role in sorted(tokens.values()):
        typer.echo(f"{name} {role}" if roles else name)


@token_app.command("serving-key")
def serving_key_cmd(
    out: Path = typer.Option(..., "--out", help="The new 0600 file for the key (router and admin)."),
) -> None:
    """A new serving key (`kvpool.rpc.serving_key`): written to `--out` for the router and the admin
    (`KVPOOL_SERVING_KEY_FILE`); prints the digest the serving nodes check (`KVPOOL_SERVING_KEY_SHA256`)
    and, for vLLM engines, `VLLM_API_KEY` is the file's first line."""
    import secrets

    from kvpool.rpc.serving_key import DIGEST_ENV, KEY_FILE_ENV, key_digest

    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        typer.echo(f"kvpool token serving-key: --out {out}: {exc.strerror}", err=True)
        raise typer.Exit(2) from None
    key = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    typer.echo(f"router, admin: {KEY_FILE_ENV}={out.resolve()}")
    typer.echo(f"prefill, decode: {DIGEST_ENV}={key_digest(key)}")
