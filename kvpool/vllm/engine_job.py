"""Run one vLLM engine in this process on a job and print its results as JSON (tests and `kvpool bench vllm`).

    python -m kvpool.vllm.engine_job JOB.json  →  one line `KVPOOL_RESULT {...}` on stdout

A job is a JSON object: `model` (directory), `dtype`, `block_size`, `master` ("" = no connector),
`prefix_caching`, `max_num_batched_tokens`, `extra` (more `kv_connector_extra_config`), `warmup` (token
ids of one unrelated request run first), and `phases`: lists of requests run one after another, each
`{"prompt_token_ids": [...], "max_tokens": N, "cache_salt": "..."?}`. A phase with
`"batch": true` submits its `requests` together; one with `"chat": true` runs a conversation (`start`,
`users`: each next prompt is the previous prompt + the reply + the user's tokens). For each request the result gives the greedy tokens,
`num_cached_tokens`, the time to its first token (`ttft_s`) and to its end (`e2e_s`), and what the pool did
(`kvpool`: the connector's `kv_transfer_params`).

The engine is vLLM's in-process one (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) unless the job says
`"multiprocess": true`. Nothing here is kvpool's product path: it drives vLLM as its users do.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _engine(job: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if job.get("master"):
        extra = {"master": job["master"], **job.get("extra", {})}
        kv = KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path="kvpool.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    kwargs: dict[str, Any] = {}
    if job.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = int(job["max_num_batched_tokens"])
        kwargs["enable_chunked_prefill"] = True
    if job.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = int(job["num_gpu_blocks_override"])
    if job.get("enable_lora"):
        kwargs.update(enable_lora=True, max_lora_rank=int(job.get("max_lora_rank", 8)), max_loras=2)
    return LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=int(job.get("max_model_len", 16384)),
        block_size=int(job.get("block_size", 64)),
        enable_prefix_caching=bool(job.get("prefix_caching", False)),
        seed=0,
        max_num_seqs=int(job.get("max_num_seqs", 4)),
        skip_tokenizer_init=not job.get("tokenizer", False),
        kv_transfer_config=kv,
        disable_log_stats=False,
        distributed_executor_backend=None if job.get("multiprocess") else "uni",
        **kwargs,
    )


def _request(llm: Any, req: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(temperature=0.0, max_tokens=int(req.get("max_tokens", 16)))
    prompt: dict[str, Any] = {"prompt_token_ids": list(req["prompt_token_ids"])}
    if req.get("cache_salt"):
        prompt["cache_salt"] = req["cache_salt"]
    lora = (
        LoRARequest(req["lora_name"], int(req["lora_id"]), req["lora_path"]) if req.get("lora_path") else None
    )
    t0 = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
    return _result(out, time.perf_counter() - t0)


def _result(out: Any, e2e_s: float) -> dict[str, Any]:
    """Tokens, `num_cached_tokens`, and the first token's latency from vLLM's own request stats."""
    stats = getattr(out, "metrics", None)
    ttft_s = float(getattr(stats, "first_token_latency", 0.0) or 0.0) or e2e_s
    return {
        "tokens": list(out.outputs[0].token_ids),
        "num_cached_tokens": int(out.num_cached_tokens or 0),
        "ttft_s": ttft_s,
        "e2e_s": e2e_s,
        "kvpool": (getattr(out, "kv_transfer_params", None) or {}).get("kvpool", {}),
    }


def _chat(llm: Any, phase: dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation: `start` tokens, then for each of `users` the next prompt is the previous prompt, the
    reply and the user's tokens (each result carries its `prompt_token_ids`)."""
    prompt = list(phase["start"])
    results: list[dict[str, Any]] = []
    for user in [None, *phase["users"]]:
        if user is not None:
            prompt = prompt + results[-1]["tokens"] + list(user)
        res = _request(llm, {"prompt_token_ids": prompt, "max_tokens": phase.get("max_tokens", 16)})
        results.append(res | {"prompt_token_ids": prompt})
    return results


def _batch(llm: Any, reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": list(r["prompt_token_ids"])} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=int(r.get("max_tokens", 16))) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    e2e_s = time.perf_counter() - t0
    return [_result(o, e2e_s) for o in outs]


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Run `job` (see the module docstring); returns {"phases": [[result, ...], ...], "startup_s": s}."""
    if not job.get("multiprocess"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 1)))
    t0 = time.perf_counter()
    llm = _engine(job)
    startup_s = time.perf_counter() - t0
    if job.get("warmup"):
        _request(llm, {"prompt_token_ids": job["warmup"], "max_tokens": 2})
    phases = []
    for phase in job.get("phases", []):
        if isinstance(phase, dict) and phase.get("batch"):
            phases.append(_batch(llm, phase["requests"]))
        elif isinstance(phase, dict) and phase.get("chat"):
            phases.append(_chat(llm, phase))
        else:
            reqs = phase["requests"] if isinstance(phase, dict) else phase
            phases.append([_request(llm, r) for r in reqs])
        if job.get("settle_s"):
            time.sleep(float(job["settle_s"]))  # let background publishes land before the next phase
    try:  # stops the connector's halves: queued publishes land before the process exits
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - best effort: results are already in hand
        print(f"engine shutdown: {exc}", file=sys.stderr)
    return {"phases": phases, "startup_s": startup_s}


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    result = run(job)
    print("KVPOOL_RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow interpreter teardown; everything is flushed


if __name__ == "__main__":
    main()
