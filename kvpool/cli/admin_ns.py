"""`kvpool admin` commands about namespaces and versions: namespaces, match, set-version, invalidate."""

from __future__ import annotations

from typing import Any

import typer

from kvpool.cli.admin_common import (
    JSON,
    _kv,
    _namespace_hex,
    _namespace_hex_given,
    _non_empty,
    _run,
    _table,
    admin_app,
)


@admin_app.command()
def namespaces(as_json: bool = JSON) -> None:
    """Registered namespaces: the digest (for `invalidate`/`match --namespace`), model, version, blocks."""

    def render(ns: Any) -> None:
        rows = [[x.namespace.hex(), x.model_id, x.weights_version, x.active, x.num_blocks] for x in ns]
        _table("namespaces", ["namespace", "model", "version", "active", "blocks"], rows)

    _run(lambda c: c.stats().namespaces, as_json, render)


MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32 (kvpool.hashing.encode_tokens)


def parse_token_ids(text: str, param_hint: str = "'TOKENS'") -> list[int]:
    """Token ids from `1,2,3` (spaces and empty items ignored); `typer.BadParameter` naming the argument and
    what it expects otherwise (exit 2, no traceback)."""
    items = [t for t in text.replace(" ", "").split(",") if t]
    bad = [t for t in items if not (t.isascii() and t.isdigit()) or int(t) > MAX_TOKEN_ID]  # no sign, no 1.5
    if bad or not items:
        got = f"{bad[0]!r} in {text!r}" if bad else repr(text)
        raise typer.BadParameter(
            f"expected comma-separated integer token ids in 0-{MAX_TOKEN_ID} (e.g. 1,2,3), got {got}",
            param_hint=param_hint,
        )
    return [int(t) for t in items]


@admin_app.command()
def match(
    tokens: str = typer.Argument(..., help="Comma-separated token ids, e.g. 1,2,3 (each in 0-4294967295)."),
    namespace: str = typer.Option("", help="Namespace digest (32 hex chars).", callback=_namespace_hex),
    model: str = typer.Option("", help="Model id (with --version) instead of --namespace."),
    version: str = typer.Option("", help="Weights version."),
    layout: str = typer.Option(
        "", help="KV layout fingerprint (with --model; default: the embedded model's)."
    ),
    salt: str = typer.Option("", help="Cache salt (with --model)."),
    as_json: bool = JSON,
) -> None:
    """Peek how many leading blocks of a token sequence are in the pool (no counters, no lease, nothing
    registered: the namespace of --model/--version is computed here, as every node computes it)."""
    from kvpool.hashing import Namespace, hash_blocks, parse_hash
    from kvpool.types import DEFAULT_LAYOUT, KVLayout

    ids = parse_token_ids(tokens)  # before any call: a typo is a usage error (exit 2), not a master error
    if namespace and (model or version):
        raise typer.BadParameter("give --namespace or --model/--version, not both", param_hint="--namespace")
    if not namespace and not (model and version):
        raise typer.BadParameter("give --namespace, or --model and --version", param_hint="--model")
    if namespace and (salt or layout):  # the digest already names its salt and layout
        raise typer.BadParameter(
            "goes with --model, not --namespace", param_hint="'--salt'" if salt else "'--layout'"
        )
    try:
        lay = KVLayout.from_fingerprint(layout or DEFAULT_LAYOUT)
        ns = (
            parse_hash(namespace, "namespace")
            if namespace
            else Namespace(model_id=model, weights_version=version, layout=lay, cache_salt=salt).digest()
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None

    def fn(c: Any) -> dict[str, Any]:
        block_size = c.stats().block_size if namespace else lay.block_size  # a digest names no layout
        hashes = hash_blocks(ns, ids, block_size)
        m = c.match(ns, hashes)
        return {
            "namespace": ns.hex(),
            "num_blocks": len(hashes),
            "num_matched": m.num_matched,
            "matched_tokens": m.num_matched * block_size,
            "replicas": [
                [f"{x.node_id} (local)" if x.local else f"{x.node_id}:{x.slot}" for x in r]
                for r in m.replicas
            ],  # a local tier has no store slot
        }

    _run(fn, as_json, lambda r: _kv("match", {**r, "replicas": replicas_summary(r["replicas"])}))


def replicas_summary(replicas: list[list[str]]) -> str:
    """A match's replica lists in one line for a table, however long the prompt: how many matched blocks
    each holder has ("s1: 128 blocks, p1 (local): 12 blocks"); `--json` lists every block's replicas."""
    per_holder: dict[str, int] = {}
    for block in replicas:
        for replica in block:
            holder = replica if replica.endswith(" (local)") else replica.rpartition(":")[0]
            per_holder[holder] = per_holder.get(holder, 0) + 1
    if not per_holder:
        return "none"
    ranked = sorted(per_holder.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{holder}: {n} block{'s' * (n != 1)}" for holder, n in ranked) + " (--json: per block)"


@admin_app.command("set-version")
def set_version(
    model: str = typer.Option(..., "--model", help="Model id.", callback=_non_empty),
    version: str = typer.Option(..., "--version", help="Weights version to activate.", callback=_non_empty),
    force: bool = typer.Option(
        False, "--force", help="Set it even though no node or namespace uses it (ahead of a rollout)."
    ),
    as_json: bool = JSON,
) -> None:
    """Activate a weights version: every other version of the model becomes unreachable. A version no
    registered namespace or live node uses (a typo) is refused, exit 1, unless --force."""

    def fn(c: Any) -> dict[str, Any]:
        previous, n, blocks = c.set_model_version(model, version, force=force)
        served = sorted({x.weights_version for x in c.stats().namespaces if x.model_id == model})
        return {
            "model": model,
            "previous_version": previous,
            "version": version,
            "namespaces_invalidated": n,
            "blocks_unreachable": blocks,
            "registered_versions": served,
        }

    def render(r: dict[str, Any]) -> None:
        _kv("set-version", r)
        if version not in r["registered_versions"]:  # forced ahead of a rollout: say what that means
            typer.echo(
                f"kvpool admin: warning: no node has registered {model!r} at version {version!r} (registered: "
                f"{', '.join(r['registered_versions']) or 'none'}); until one does, nothing of {model!r} is "
                "published or matched",
                err=True,
            )

    _run(fn, as_json, render)


@admin_app.command()
def invalidate(
    namespace: str = typer.Option(
        ..., "--namespace", help="Namespace digest (32 hex chars).", callback=_namespace_hex_given
    ),
    as_json: bool = JSON,
) -> None:
    """Flush one namespace: its blocks are unreachable now (reclaimed in the background), publishes begun
    before are refused, serving nodes drop their local tiers at their next heartbeat; an active namespace
    then fills again from new publishes."""
    from kvpool.hashing import parse_hash

    def fn(c: Any) -> dict[str, Any]:
        ns = parse_hash(namespace, "namespace")
        blocks = sum(x.num_blocks for x in c.stats().namespaces if x.namespace == ns)  # just before
        c.invalidate(ns)
        return {"namespace": namespace.lower(), "invalidated": True, "blocks_unreachable": blocks}

    _run(fn, as_json, lambda r: _kv("invalidate", r))
