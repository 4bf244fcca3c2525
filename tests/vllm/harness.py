"""Real vLLM engines on a real kvpool cluster: each engine runs in its own process (`kvpool.vllm.engine_job`).

Prompts are token ids of kvpool's embedded model (vocab 259: bytes and BOS 256), built from seeded
generators so every run sees the same ones.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BLOCK = 64
FP32_LAYOUT = "kv1:float32:b64:l4:h4:d32"
BF16_LAYOUT = "kv1:bfloat16:b64:l4:h4:d32"


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def model_dir(seed: int = 0) -> str:
    from kvpool.model.embedded import EmbeddedSpec, embedded_model_dir

    return str(embedded_model_dir(EmbeddedSpec(seed=seed)))


FORCE_PULL = {"KVPOOL_FORCE_DECISION": "pull"}
"""For tests that assert exact hits: every matched block is loaded, under `pull_timeout_s` rather than the
cost model's deadline (on a loaded 2-core host the cost model can rightly choose to recompute a short
prompt, or abandon a slow pull: that costs a hit and changes nothing else). The decisions themselves are
tested in tests/test_vllm_scheduler.py, tests/test_cost.py and by `kvpool bench vllm`."""
EXACT_WAIT_S = 30.0
"""`match_wait_s` of an engine whose hits a test counts: the pool's answer is awaited, however busy the host."""


def run_engine(
    job: dict[str, Any],
    *,
    timeout_s: float = 300.0,
    expect_ok: bool = True,
    env: dict[str, str] | None = None,
    exact_hits: bool = False,
) -> dict[str, Any]:
    """Run one engine process on `job` (with `env` added to the environment; `exact_hits`: see FORCE_PULL);
    returns its results (plus `stderr`), or with `expect_ok=False` `{"returncode", "stderr"}` whatever
    happened."""
    job = {"model": model_dir(), "block_size": BLOCK, **job}
    if exact_hits:  # see FORCE_PULL
        job["extra"] = {"match_wait_s": EXACT_WAIT_S, **job.get("extra", {})}
        env = {**FORCE_PULL, **(env or {})}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.vllm.engine_job", f.name],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
    Path(f.name).unlink(missing_ok=True)
    if not expect_ok:
        return {"returncode": proc.returncode, "stderr": proc.stderr}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KVPOOL_RESULT ")]
    assert proc.returncode == 0 and lines, f"engine failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(lines[-1].split(" ", 1)[1])
    result["stderr"] = proc.stderr
    return result


def requests(prompts: list[list[int]], max_tokens: int = 12, **extra: Any) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": p, "max_tokens": max_tokens, **extra} for p in prompts]


def tmp_log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvpool-vllm-test-"))
