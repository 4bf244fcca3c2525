"""`kvpool model export`: write the embedded model as a directory vLLM serves with no download.

Nothing here imports torch or transformers at module level (`kvpool --help` stays fast).
"""

from __future__ import annotations

from pathlib import Path

import typer

model_app = typer.Typer(
    help="The embedded synthetic model: export it for other servers (vLLM).", no_args_is_help=True
)


@model_app.command("export")
def export(
    out_dir: Path = typer.Argument(
        ..., metavar="OUT_DIR", help="Directory to write (created; must be empty unless --force)."
    ),
    seed: int = typer.Option(0, help="Seed of the synthetic weights (each seed is one weights version)."),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty directory, replacing files."),
) -> None:
    """Write the embedded model + a HF fast tokenizer (kvpool's byte ids) + a chat template to OUT_DIR.

    Prints the directory, then the command that serves it with vLLM's OpenAI server.
    """
    from dataclasses import replace

    from kvpool.errors import KVPoolError
    from kvpool.model.embedded import DEFAULT_SPEC
    from kvpool.model.export import export_model_dir, vllm_serve_command

    spec = replace(DEFAULT_SPEC, seed=seed)
    try:
        path = export_model_dir(out_dir, spec=spec, force=force)
    except KVPoolError as exc:
        typer.echo(f"kvpool model export: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None
    path = path.resolve()
    typer.echo(str(path))
    typer.echo(vllm_serve_command(path, served_model_name=spec.model_id))
