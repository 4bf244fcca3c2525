"""`kvpool admin adapter register|reload|unload|list`: adapters by name, keyed by content.

An adapter is named by the digest of its files (`--digest`, or `--path DIR` to compute it here exactly as
the vLLM connector does, `kvpool.vllm.identity.directory_digest`). Reload and unload print how many
namespaces and blocks became unreachable.
"""

from __future__ import annotations

from typing import Any

import typer

from kvpool.cli.admin_common import JSON, _kv, _non_empty, _run, _table, admin_app

adapter_app = typer.Typer(
    no_args_is_help=True, help="Adapters by name: register, reload (new weights), unload, list."
)
admin_app.add_typer(adapter_app, name="adapter")

MODEL = typer.Option(..., "--model", help="Model id.", callback=_non_empty)
NAME = typer.Option(
    ..., "--name", help="Adapter name (a label: the pool keys KV by --digest).", callback=_non_empty
)
DIGEST = typer.Option("", "--digest", help="The adapter's content digest (32 lowercase hex characters).")
PATH = typer.Option(
    "", "--path", help="The adapter's directory: its digest is computed here (instead of --digest)."
)


def _digest(digest: str, path: str) -> str:
    """The digest given, or computed from `path`; usage errors (exit 2) before any call."""
    from pathlib import Path

    from kvpool.errors import NotFound
    from kvpool.hashing import check_adapter_digest

    if bool(digest) == bool(path):
        raise typer.BadParameter("give --digest or --path (one of them)", param_hint="--digest")
    if path:
        from kvpool.vllm.identity import directory_digest

        try:
            return directory_digest(Path(path))
        except NotFound as exc:
            raise typer.BadParameter(str(exc), param_hint="--path") from None
    try:
        return check_adapter_digest(digest, "--digest", allow_empty=False)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--digest") from None


def _change(model: str, name: str, previous: str, n: int, blocks: int, **more: str) -> dict[str, Any]:
    counts = {"namespaces_invalidated": n, "blocks_invalidated": blocks}
    return {"model": model, "name": name, "previous_digest": previous, **more, **counts}


@adapter_app.command()
def register(
    model: str = MODEL, name: str = NAME, digest: str = DIGEST, path: str = PATH, as_json: bool = JSON
) -> None:
    """Name an adapter of a model by its content digest (idempotent; a changed digest is a reload)."""
    d = _digest(digest, path)

    def fn(c: Any) -> dict[str, Any]:
        return {"model": model, "name": name, "digest": d, "created": c.register_adapter(model, name, d)}

    _run(fn, as_json, lambda r: _kv("adapter register", r))


@adapter_app.command()
def reload(
    model: str = MODEL, name: str = NAME, digest: str = DIGEST, path: str = PATH, as_json: bool = JSON
) -> None:
    """New weights for a named adapter: the previous digest's KV becomes unreachable at once (pool, index
    and, at their next heartbeat, node-local tiers); prints the namespaces and blocks invalidated."""
    d = _digest(digest, path)

    def fn(c: Any) -> dict[str, Any]:
        return _change(model, name, *c.reload_adapter(model, name, d), digest=d)

    _run(fn, as_json, lambda r: _kv("adapter reload", r))


@adapter_app.command()
def unload(model: str = MODEL, name: str = NAME, as_json: bool = JSON) -> None:
    """Forget a named adapter: its digest's KV becomes unreachable at once (unless another name of the
    model uses the same digest); prints the namespaces and blocks invalidated."""
    _run(
        lambda c: _change(model, name, *c.unload_adapter(model, name)),
        as_json,
        lambda r: _kv("adapter unload", r),
    )


@adapter_app.command("list")
def list_(
    model: str = typer.Option("", "--model", help="Only this model's adapters."), as_json: bool = JSON
) -> None:
    """Registered adapters: model, name, digest, and the namespaces and blocks under that digest."""

    def render(found: Any) -> None:
        rows = [[a.model_id, a.name, a.digest, a.num_namespaces, a.num_blocks] for a in found]
        _table("adapters", ["model", "name", "digest", "namespaces", "blocks"], rows)

    _run(lambda c: c.list_adapters(model), as_json, render)
