"""`kvpool admin --master HOST:PORT …`: operate a live pool over gRPC.

Rich tables for people, `--json` on every command, a non-zero exit on failure, and one clear line (no
stack trace) when the master is down or refuses.
"""

from __future__ import annotations

from typing import Any

import typer

from kvpool.cli.admin_common import (
    JSON,
    NON_NEGATIVE,
    POSITIVE,
    UNIT_FRACTION,
    _Ctx,
    _known_gpu,
    _kv,
    _plain,
    _run,
    _table,
    admin_app,
)

__all__ = ["admin_app"]


def _since(silent_s: float, now_unix_s: float) -> str:
    """The UTC time `silent_s` seconds before `now_unix_s`, ISO 8601 to the second."""
    import datetime as dt

    at = dt.datetime.fromtimestamp(now_unix_s - silent_s, tz=dt.UTC).isoformat(timespec="seconds")
    return at.replace("+00:00", "Z")


def degraded_parts(nodes: list[Any], now_unix_s: float) -> list[dict[str, Any]]:
    """The degraded parts the master sees: each dead node (since the master last heard from it) and each
    store whose data plane is not ok (no since: the master keeps the state, not when it changed)."""
    parts: list[dict[str, Any]] = []
    for n in sorted(nodes, key=lambda n: (n.node.role, n.node.node_id)):
        part = f"{n.node.role} {n.node.node_id}"
        if not n.alive:
            parts.append({"part": part, "reason": "dead: no heartbeat (or deregistered)",
                          "since": _since(n.silent_s, now_unix_s), "for_s": round(n.silent_s, 1)})  # fmt: skip
        elif n.dataplane_state not in ("", "ok"):
            reason = f"data plane {n.dataplane_state} ({n.num_dataplane_failures} failures reported)"
            parts.append({"part": part, "reason": reason, "since": None, "for_s": None})
    return parts


@admin_app.command()
def status(as_json: bool = JSON) -> None:
    """Pool summary: nodes and stores alive (of registered), blocks, fill, hit rate, and the degraded parts.

    `used_bytes`, `capacity_bytes` and `fill` are over the live stores only (the master's Stats), as is
    `stores_alive`; `nodes` and `stores` also count the dead (heartbeat expired or deregistered) ones.
    `status` is "ok", or "degraded" with `degraded` listing each dead node (since the master last heard
    from it) and each store whose data plane is suspect, failed or on trial. A master that does not
    answer is one line on stderr and exit status 1. With masters in high availability (etcd) it also
    names the leader, the standbys, the leader's epoch and the etcd endpoints, and the pool figures are
    the leader's (a standby holds no index)."""

    def fn(c: Any) -> dict[str, Any]:
        import time

        from kvpool.cli.admin_ha import ha_summary
        from kvpool.client import MasterClient

        ha = ha_summary(c)
        leader = ha.get("leader", "unknown")
        if leader not in ("unknown", c.address) and leader in c.addresses:
            with MasterClient(leader, timeout_s=_Ctx.timeout_s) as lc:
                s = lc.stats()
        else:  # never call (nor send the token to) a leader outside --master: a forged etcd key may name it
            if leader not in ("unknown", c.address):
                ha["figures"] = f"{c.address}'s: the leader is not in --master"
            s = c.stats()
        stores = [n for n in s.nodes if n.node.role == "store"]
        parts = degraded_parts(s.nodes, time.time())
        return {
            **ha,
            "master": c.address,
            "status": "degraded" if parts else "ok",
            "nodes_alive": sum(1 for n in s.nodes if n.alive),
            "nodes": len(s.nodes),
            "stores_alive": sum(1 for n in stores if n.alive),
            "stores": len(stores),
            "num_blocks": s.num_blocks,
            "used_bytes": s.used_bytes,
            "capacity_bytes": s.capacity_bytes,
            "fill": round(s.used_bytes / s.capacity_bytes, 4) if s.capacity_bytes else 0.0,
            "hit_rate": round(s.hit_rate, 4),
            "num_live_leases": s.num_live_leases,
            "index_bytes": s.index_bytes,
            "index_bytes_limit": s.index_bytes_limit,
            "admission_refusals": s.num_admission_refusals,
            "uptime_s": round(s.uptime_s, 1),
            "degraded": parts,
        }

    def render(r: dict[str, Any]) -> None:
        parts = r["degraded"]
        _kv("kvpool status", {k: v for k, v in r.items() if k != "degraded"})
        if parts:
            rows = [[p["part"], p["reason"], p["since"] or "unknown", "" if p["for_s"] is None else p["for_s"]]
                    for p in parts]  # fmt: skip
            _table("degraded", ["part", "reason", "since (UTC)", "for (s)"], rows)

    _run(fn, as_json, render)


@admin_app.command()
def nodes(as_json: bool = JSON) -> None:
    """Registered nodes with liveness, fill and blocks (a vLLM engine: its OpenAI URL and KV cache usage; a
    store: its data plane, ok, suspect, failed or trial, and the failures reported since it registered).
    A dead store's slots are unknown (table: "unknown"; --json: null), not the last numbers it reported;
    `last heard` is how long ago the master last heard from a node."""
    cols = ["node", "role", "alive", "draining", "grpc / url", "data", "used/slots", "blocks", "queue"]
    cols += ["kv", "data plane", "last heard"]

    def slots(n: Any) -> str:
        return "unknown" if n.node.role == "store" and not n.alive else f"{n.num_used_slots}/{n.num_slots}"

    def render(ns: Any) -> None:
        rows = [
            [
                n.node.node_id,
                n.node.role,
                n.alive,
                n.draining,
                n.node.grpc_address or n.node.url,
                n.node.data_address,
                slots(n),
                n.num_blocks,
                n.load.queue_len,
                f"{n.load.kv_usage:.0%}" if n.node.role.startswith("vllm") else "",
                f"{n.dataplane_state} ({n.num_dataplane_failures})" if n.dataplane_state else "",
                f"{n.silent_s:.1f} s ago",
            ]
            for n in ns
        ]
        _table("nodes", cols, rows)

    def fn(c: Any) -> Any:
        listed = c.list_nodes()
        if not as_json:
            return listed
        out = []
        for n in listed:
            row = _plain(n)
            if n.node.role == "store" and not n.alive:
                row.update(num_slots=None, num_used_slots=None, used_bytes=None)
            out.append(row)
        return out

    _run(fn, as_json, render)


@admin_app.command()
def stats(as_json: bool = JSON) -> None:
    """All pool counters (hit tokens and requested tokens, evictions, leases...)."""

    def render(s: Any) -> None:
        data = {k: v for k, v in _plain(s).items() if k not in ("nodes", "namespaces")}
        data["hit_rate"] = round(s.hit_rate, 4)
        _kv("kvpool stats", data)

    _run(lambda c: c.stats(), as_json, render)


@admin_app.command()
def evict(
    fraction: float = typer.Option(
        ..., "--fraction", help="Fraction of resident blocks, in (0, 1].", callback=UNIT_FRACTION
    ),
    node: str = typer.Option("", "--node", help="Only this store node's slots."),
    as_json: bool = JSON,
) -> None:
    """Evict a fraction of the unleased leaf blocks by the eviction policy."""

    def fn(c: Any) -> dict[str, Any]:
        n, short = c.evict(fraction, node)
        return {"fraction": fraction, "node": node, "num_evicted": n, "shortfall": short}

    _run(fn, as_json, lambda r: _kv("evict", r))


@admin_app.command()
def drain(
    node: str = typer.Argument(..., help="Store node id."),
    cancel: bool = typer.Option(False, "--cancel", help="Stop draining: the node takes new blocks again."),
    as_json: bool = JSON,
) -> None:
    """Stop placing on a node; its blocks are copied elsewhere, then its slots freed (`--cancel` undoes it:
    the node keeps the blocks it still holds)."""

    def fn(c: Any) -> dict[str, Any]:
        if cancel:
            c.drain(node, cancel=True)
            return {"node": node, "draining": False}
        return {"node": node, "draining": True, "num_blocks_to_move": c.drain(node)}

    _run(fn, as_json, lambda r: _kv("drain", r))


@admin_app.command()
def economics(
    model_params: float = typer.Option(
        ..., "--model-params", help="Model parameters, e.g. 8e9.", callback=POSITIVE
    ),
    window_s: float = typer.Option(
        2.0, "--window", help="Measure counters over this many seconds.", callback=POSITIVE
    ),
    num_layers: int = typer.Option(
        32, "--layers", help="Transformer layers (attention term).", callback=NON_NEGATIVE
    ),
    d_attn: int = typer.Option(
        4096, "--d-attn", help="Attention width n_heads x head_dim (attention term).", callback=NON_NEGATIVE
    ),
    gpu: str = typer.Option(
        "H100-SXM",
        help="GPU for 'GPUs saved' (H100-SXM, H200-SXM, A100-SXM, L40S, MI300X).",
        callback=_known_gpu,
    ),
    mfu: float = typer.Option(
        0.5, help="Model FLOP utilisation assumed for prefill on that GPU, in (0, 1].", callback=UNIT_FRACTION
    ),
    as_json: bool = JSON,
) -> None:
    """Saved prefill tokens/s (λ x mean reused tokens per request), FLOP/s and GPUs saved, from live counters.

    Formulas and sources: `kvpool.economics` (saved tokens/s = λ·h·s_c; FLOP = 2Ψ per token plus
    causal attention 4·layers·d_attn per pair; GPUs = FLOP/s ÷ (peak·MFU); Mooncake FAST'25, SGLang).
    """
    import time

    from kvpool import economics as eco

    shape = eco.ModelShape(name="given", params=model_params, num_layers=num_layers, d_attn=d_attn)

    def fn(c: Any) -> dict[str, Any]:
        a = c.stats()
        time.sleep(window_s)
        b = c.stats()
        w = eco.workload_from_counters(a, b, window_s)
        hit_tps = (b.hit_tokens - a.hit_tokens) / window_s
        req_tps = (b.requested_tokens - a.requested_tokens) / window_s
        flop = eco.saved_flop_per_s(w, shape)
        total = w.request_rate_per_s * shape.prefill_flop(w.mean_prompt_tokens)
        gpus = eco.gpus_saved(flop, eco.GPUS[gpu], mfu)
        traffic = eco.has_traffic(w)
        return {
            "window_s": window_s,
            "request_rate_per_s": round(w.request_rate_per_s, 3),
            "mean_reused_tokens_per_request": round(w.mean_reused_tokens, 1),
            "saved_prefill_tokens_per_s": round(w.saved_tokens_per_s, 2),
            "hit_tokens_per_s": round(hit_tps, 2),
            "requested_tokens_per_s": round(req_tps, 2),
            "hit_rate_window": round(hit_tps / req_tps, 4) if traffic else None,
            "flop_per_s_saved": flop,
            "share_prefill_flop_saved": round(flop / total, 4) if traffic else None,
            f"gpus_saved_{gpu}": round(gpus, 4),
            "mfu": mfu,
            "hit_tokens_total": b.hit_tokens,
            "flop_saved_total": 2.0 * model_params * b.hit_tokens,
            "verdict": eco.verdict(flop / total, gpus, gpu) if traffic else eco.no_traffic(window_s),
        }

    _run(fn, as_json, lambda r: _kv("economics", {k: "-" if v is None else v for k, v in r.items()}))


# register the namespace commands (namespaces, match, set-version, invalidate), `adapter ...` and `masters`
from kvpool.cli import admin_adapter, admin_ha, admin_ns  # noqa: E402, F401
