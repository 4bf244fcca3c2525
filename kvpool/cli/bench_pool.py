"""`kvpool bench index | master | master-churn | transfer`: the pool's own parts measured alone (the radix
index in process, the master's match and publish rates, its namespace churn, the data plane's GB/s).

Registered on `kvpool.cli.bench.bench_app`; each benchmark is imported on use from `kvpool.bench`."""

from __future__ import annotations

from pathlib import Path

import typer

from kvpool.cli.bench_extra import need_bench_extra


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


def master_cmd(
    blocks: str = typer.Option(
        "1M", help="Resident blocks to fill the master with (4096, 500K, 1M, 20M; K = 1,000, M = 1,000,000)."
    ),
    prompt_blocks: int = typer.Option(64, min=1, max=8192, help="Blocks per matched prompt."),
    clients: int = typer.Option(8, min=1, max=256, help="Concurrent match clients."),
    prompts: int = typer.Option(4096, min=1, help="Distinct prompts drawn from the resident chains."),
    duration_s: float = typer.Option(5.0, "--duration", min=0.1, help="Seconds of matching."),
    unary: bool = typer.Option(False, help="One unary call per match instead of a stream message."),
    depth: int = typer.Option(
        1, min=1, max=64, help="Stream messages in flight per client (pipelined; each one prompt)."
    ),
    client: str = typer.Option(
        "lean", help="lean: pre-serialized requests (a load tool); api: the library's MasterClient."
    ),
    stores: int = typer.Option(4, min=1, max=64, help="Store processes (tiny layout)."),
    writers: int = typer.Option(
        8, min=1, max=64, help="Client processes of the fill (Reserve + Commit on metadata-only stores)."
    ),
    publish_chains: int = typer.Option(
        100, min=1, help="Chains of --prompt-blocks blocks per client per publish figure."
    ),
    trace: Path | None = typer.Option(
        None, "--trace", help="Mooncake-format JSONL whose tree is filled (default: the conversation trace)."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """The master at N resident blocks: memory per block, match rate and p99, publish and rebuild rates,
    lock-held stalls."""
    from kvpool.bench.master_bench import check_memory, run_master_bench
    from kvpool.bench.master_scale_work import parse_count
    from kvpool.errors import InvalidArgument

    if client not in ("lean", "api"):
        raise typer.BadParameter("--client must be lean or api")
    try:
        num_blocks = parse_count(blocks)
        check_memory(num_blocks, 4 * clients * publish_chains * prompt_blocks)
    except InvalidArgument as exc:
        raise typer.BadParameter(str(exc), param_hint="--blocks") from None
    if trace is not None and not trace.is_file():
        raise typer.BadParameter(f"{trace}: no such file", param_hint="--trace")
    run_master_bench(
        blocks=num_blocks,
        prompt_blocks=prompt_blocks,
        clients=clients,
        prompts=prompts,
        duration_s=duration_s,
        unary=unary,
        depth=depth,
        client=client,
        stores=stores,
        writers=writers,
        publish_chains=publish_chains,
        trace=trace,
        json_out=json_out,
    )


def master_churn_cmd(
    cycles: int = typer.Option(
        1000, min=0, help="Flush/re-register cycles (InvalidateNamespace + RegisterNamespace)."
    ),
    salts: int = typer.Option(
        10_000, min=0, help="RegisterNamespace calls, each with a distinct cache salt."
    ),
    matches: int = typer.Option(2000, min=100, help="Matches per measuring round."),
    reps: int = typer.Option(3, min=1, help="Measuring rounds before and after the churn."),
    blocks: int = typer.Option(64, min=1, help="Blocks per prompt."),
    prompts: int = typer.Option(32, min=1, help="Prompts published (and matched round-robin)."),
    churn_blocks: int = typer.Option(1, min=0, help="Blocks published into the flushed namespace per cycle."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Match p50/p99, master RSS and namespace count before vs after flush cycles and distinct salts."""
    from kvpool.bench.master_churn import run_master_churn

    run_master_churn(
        cycles=cycles,
        salts=salts,
        matches=matches,
        reps=reps,
        blocks=blocks,
        prompts=prompts,
        churn_blocks=churn_blocks,
        json_out=json_out,
    )


def transfer_cmd(
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG: GB/s per block size and transport."),
    quick: bool = typer.Option(False, help="Tiny sizes and batches, no Mooncake: a smoke test."),
    reps: int | None = typer.Option(
        None, min=1, help="Repeats per measurement (default 3; --quick 2; medians reported)."
    ),
    batch: int | None = typer.Option(None, min=1, help="Blocks per batch (default 256; --quick 8)."),
    endpoints: int | None = typer.Option(
        None, min=1, help="UCX endpoints per peer, pool and raw UCX alike (default 4)."
    ),
    blocks_per_message: int | None = typer.Option(
        None,
        min=1,
        max=4096,
        help="Blocks per UCX message, pool and raw alike (default min(64, batch / endpoints)).",
    ),
    mooncake: bool = typer.Option(True, help="Measure Mooncake's store when its wheel is installed."),
) -> None:
    """Data-plane GB/s: pool get/put vs raw UCX, ucx_perftest, memcpy and Mooncake, over tcp and shm."""
    need_bench_extra("transfer", progress=True, plot=plot)
    from kvpool.bench.transfer_bench import run_transfer_bench

    run_transfer_bench(
        json_out=json_out,
        plot_out=plot,
        quick=quick,
        reps=reps,
        batch=batch,
        endpoints=endpoints,
        blocks_per_message=blocks_per_message,
        mooncake=mooncake,
    )


def tiers_cmd(
    disk_path: Path = typer.Option(
        ..., help="A directory on the file system the store's disk tier would use."
    ),
    total: str = typer.Option("512MiB", help="Bytes written and read back per round."),
    block_size: str = typer.Option("256KiB", help="Block size (the default layout's block)."),
    reps: int = typer.Option(5, min=1, help="Rounds per batch size (the median is reported)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report here."),
) -> None:
    """Disk tier engine read/write GB/s (checksums, direct I/O) vs dd iflag/oflag=direct bs=4M."""
    from kvpool.bench.tiers import run_tiers_bench
    from kvpool.errors import InvalidArgument
    from kvpool.store.settings import parse_size

    try:
        run_tiers_bench(
            disk_path,
            total_bytes=parse_size(total),
            block_nbytes=parse_size(block_size),
            reps=reps,
            json_out=json_out,
        )
    except (InvalidArgument, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from None
