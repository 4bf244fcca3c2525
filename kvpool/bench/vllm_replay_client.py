"""The client side of `kvpool bench vllm-replay`: streamed completions against vLLM's OpenAI server (TTFT, end
to end, reused tokens), the replay of a trace's sessions in arrival order, an engine's warm-up and a
non-streaming probe of its `kv_transfer_params`."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from kvpool.bench.vllm_replay_trace import BlockTokens, ReplayRequest

REQUEST_TIMEOUT_S = 900.0


def split_events(buf: bytes) -> tuple[list[dict[str, Any]], bytes]:
    """The complete `data: {json}` events of a server-sent event stream, and the unfinished rest. Splits on
    b"\\n" only: the byte-soup text of the embedded model holds U+2028 and other line breaks that
    `str.splitlines` (httpx's `aiter_lines`) would split on."""
    *lines, rest = buf.split(b"\n")
    events = [
        json.loads(line[6:])
        for line in lines
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"
    ]
    return events, rest


async def complete(client: Any, url: str, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """Stream one completion: TTFT (first chunk with a token), end-to-end time, usage."""
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    headers = {"X-Request-Id": request_id}
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code}: {text[:300]}")
        buf = b""
        async for data in resp.aiter_bytes():
            chunks, buf = split_events(buf + data)
            for chunk in chunks:
                if ttft is None and chunk.get("choices"):
                    ttft = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
    if ttft is None:
        raise RuntimeError("no token streamed")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "e2e_s": time.perf_counter() - t0,
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "cached_tokens": int(details.get("cached_tokens") or 0),
    }


async def replay(
    requests: list[ReplayRequest],
    tokens: BlockTokens,
    urls: list[str],
    *,
    model: str,
    max_tokens: int,
    on_done: Any = None,
) -> list[dict[str, Any]]:
    """Replay `requests` on `urls` (request i on engine i mod len(urls)); one record per request."""
    import httpx

    sessions: dict[int, list[ReplayRequest]] = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    records: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=len(sessions) + 4, max_keepalive_connections=len(sessions) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        t0 = time.perf_counter()

        async def run_session(turns: list[ReplayRequest]) -> None:
            for r in turns:  # in order: a turn waits for the previous answer
                await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
                engine = r.index % len(urls)
                body = {
                    "model": model,
                    "prompt": tokens.prompt(r),
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                rec: dict[str, Any] = {
                    "index": r.index,
                    "session": r.session,
                    "turn": r.turn,
                    "engine": engine,
                    "arrival_s": r.arrival_s,
                    "start_delay_s": time.perf_counter() - t0 - r.arrival_s,
                    "prompt_tokens": r.num_prompt_tokens,
                    "cached_tokens": 0,
                    "ttft_s": None,
                    "e2e_s": None,
                    "error": None,
                }
                try:
                    rec |= await complete(client, urls[engine], body, f"r{r.index}")
                except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a failed run
                    rec["error"] = f"{type(exc).__name__}: {exc}"
                records.append(rec)
                if on_done is not None:
                    on_done()

        await asyncio.gather(*(run_session(t) for t in sessions.values()))
    return sorted(records, key=lambda x: x["index"])


def probe(url: str, model: str, prompt: list[int]) -> dict[str, Any] | None:
    """One non-streaming request: what the server returns in `kv_transfer_params` (None: nothing)."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    try:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        out: dict[str, Any] | None = resp.json().get("kv_transfer_params")
        return out
    except Exception as exc:  # noqa: BLE001 - the probe is informational
        return {"error": str(exc)}


async def warm(url: str, model: str, prompt: list[int]) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
        body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True}
        await complete(client, url, body, "warmup")
