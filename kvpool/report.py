"""The report format of docs/benchmarks.md (benchmarks, the demo): `{"benchmark", "env", "records", "summary"}`."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def env_info() -> dict[str, Any]:
    """Versions, CPU and date of the machine running a benchmark."""
    info: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "num_cpus": os.cpu_count(),
    }
    from kvpool import __version__

    info["kvpool"] = __version__
    for mod in ("numpy", "torch", "ucxx", "grpc", "transformers"):
        module = sys.modules.get(mod)
        if module is not None:
            info[mod] = getattr(module, "__version__", "?")
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_report(
    path: Path | None, benchmark: str, records: Sequence[dict[str, Any]], summary: dict[str, Any]
) -> dict[str, Any]:
    """Build the report object; write it as JSON to `path` when given. Returns the object."""
    report = {"benchmark": benchmark, "env": env_info(), "records": list(records), "summary": summary}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    return report
