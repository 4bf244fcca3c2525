"""`kvpool demo`: the main job, imported on use."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from kvpool.cli.checks import device_option, engine_option, load_trace_option


def _vllm_demo(**kwargs: Any) -> dict[str, Any]:
    """`run_vllm_demo`; a bad setting (no vLLM Python, a prompt too long) exits 2, a cluster that does not
    start exits 1, each with one line (and `kvpool up`'s output)."""
    from kvpool.demo.vllm_run import run_vllm_demo
    from kvpool.errors import InvalidArgument, Unavailable

    try:
        return run_vllm_demo(**kwargs)
    except InvalidArgument as exc:
        typer.echo(f"kvpool demo: {exc}", err=True)
        raise typer.Exit(2) from None
    except Unavailable as exc:
        typer.echo(f"kvpool demo: {exc}", err=True)
        raise typer.Exit(1) from None


def register_role_commands(app: typer.Typer) -> None:
    @app.command()
    def demo(
        json_out: Path | None = typer.Option(None, "--json", help="Write the summary JSON here."),
        trace: Path | None = typer.Option(
            None, help="Mooncake-format conversation trace (default: shared or shipped)."
        ),
        trace_block_tokens: int = typer.Option(
            64, min=1, help="Tokens per trace block (the trace's are 512)."
        ),
        conversations: int = typer.Option(4, min=1, help="Chat conversations to replay."),
        questions: int = typer.Option(3, min=1, max=5, help="Questions per RAG document (1-5)."),
        max_tokens: int = typer.Option(8, min=1, help="Tokens to generate per request."),
        device: str = typer.Option(
            "cpu", help="torch device for the serving nodes (--engine kvpool).", callback=device_option
        ),
        model: str | None = typer.Option(None, help="HF model directory (default: the embedded model)."),
        engine: str = typer.Option(
            "kvpool",
            help="kvpool (kvpool's own nodes) or vllm (a vLLM prefill and decode engine, `kvpool up`).",
            callback=engine_option,
        ),
        python: str | None = typer.Option(
            None,
            help="--engine vllm: the Python that has vllm (default: .venv-vllm/bin/python, as kvpool up).",
        ),
    ) -> None:
        """Start a local cluster of real processes and serve RAG + multi-turn chat through the pool."""
        from kvpool.demo.workload import default_chat_trace

        chat_trace = load_trace_option(trace or default_chat_trace())  # before anything starts
        if engine == "vllm":
            summary = _vllm_demo(
                json_out=json_out,
                trace=chat_trace,
                trace_block_tokens=trace_block_tokens,
                num_conversations=conversations,
                questions_per_doc=questions,
                max_tokens=max_tokens,
                python=python,
                model_dir=model,
            )
        else:
            from kvpool.demo.run import run_demo

            summary = run_demo(
                json_out=json_out,
                trace=chat_trace,
                trace_block_tokens=trace_block_tokens,
                num_conversations=conversations,
                questions_per_doc=questions,
                max_tokens=max_tokens,
                device=device,
                model_dir=model,
            )
        if not summary["greedy_equal"]:
            raise typer.Exit(1)
