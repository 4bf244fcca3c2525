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


@bench_app.command("trace")
def trace_cmd(
    trace: list[Path] = typer.Option(..., "--trace", help="Mooncake-format JSONL trace (repeatable)."),
    capacity_frac: str = typer.Option(
        "0.02,0.05,0.1,0.2,0.4", help="Capacities, fractions of unique blocks."
    ),
    policies: str = typer.Option("lru,lfu,fwlru,cost,opt", help="Comma-separated policies (or 'default')."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of hit rate vs capacity."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """Replay traces through the radix index: token prefix-hit rate per policy and capacity."""
    from kvpool.bench.trace import parse_fractions, parse_policies, run_trace_bench
    from kvpool.errors import InvalidArgument

    try:
        run_trace_bench(
            trace, parse_fractions(capacity_frac), parse_policies(policies), json_out, plot, progress=progress
        )
    except (InvalidArgument, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None


@bench_app.command("index")
def index_cmd(
    num_blocks: int = typer.Option(1_000_000, help="Resident blocks to build."),
    chain_len: int = typer.Option(64, help="Blocks per inserted / matched chain."),
    num_matches: int = typer.Option(20_000, help="Full-chain matches to time."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """In-process radix index match/insert throughput and memory per block."""
    from kvpool.bench.index_bench import run_index_bench
    from kvpool.errors import InvalidArgument

    try:
        run_index_bench(num_blocks, chain_len, num_matches, json_out)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from None


@bench_app.command("master")
def master_cmd(
    clients: int = typer.Option(8, help="Concurrent match clients."),
    blocks: int = typer.Option(64, help="Blocks per prompt."),
    prompts: int = typer.Option(32, help="Prompts published (and matched round-robin)."),
    duration_s: float = typer.Option(5.0, "--duration", help="Seconds of matching."),
    unary: bool = typer.Option(False, help="One unary call per match instead of a stream message."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Master match throughput and latency from concurrent clients, and publish rate."""
    from kvpool.bench.master_bench import run_master_bench

    run_master_bench(
        clients=clients, blocks=blocks, prompts=prompts, duration_s=duration_s, unary=unary, json_out=json_out
    )
