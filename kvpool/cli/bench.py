"""`kvpool bench …`: each benchmark lives in `kvpool.bench.<name>` and is imported on use."""

from __future__ import annotations

from pathlib import Path

import typer

bench_app = typer.Typer(no_args_is_help=True)


@bench_app.command("ttft")
def ttft(
    prefix_tokens: int = typer.Option(8192, help="shared prefix length (tokens)"),
    question_tokens: int = typer.Option(50, help="question length (tokens)"),
    requests: int = typer.Option(3, help="warm and cold requests each"),
    block_size: int = typer.Option(64, help="tokens per block"),
    transport: str = typer.Option("tcp", help="tcp (forces UCX_TLS=tcp, the cross-host path) or auto"),
    device: str = typer.Option("cpu", help="torch device of the serving nodes"),
    model: str = typer.Option(None, help="HF model directory (default: embedded)"),
    json_out: Path = typer.Option(None, "--json", help="write the report JSON here"),
) -> None:
    """Cold vs warm TTFT for RAG with a long shared prefix pulled from the pool."""
    from kvpool.bench.ttft import run_ttft

    run_ttft(
        prefix_tokens=prefix_tokens, question_tokens=question_tokens, num_requests=requests, block_size=block_size,
        transport=transport, device=device, model_dir=model, json_out=json_out,
    )  # fmt: skip
