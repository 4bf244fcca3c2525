"""Run the README's quickstart as written and check what it claims (`make quickstart-check`).

Takes the shell blocks under "## Quickstart" in README.md: the first starts the cluster (`kvpool up`), the
rest run against it after the `export KVPOOL_...=...` lines the cluster printed (the join token, the
gRPC TLS files), as the README tells a user to do. Checks: the cluster prints its endpoints and that export line; the other blocks exit 0;
the `openai` snippet prints `prompt_tokens cached_tokens` per request and the repeated request has
cached_tokens > 0; Ctrl-C (SIGINT) stops the cluster with exit 0. Everything within `--budget-s` (180 s).
Exit 0 when all hold, 1 otherwise, with one line per failed check and the cluster's output tail.

Run from the repository root with the built `.venv` (the blocks call `.venv/bin/...`).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY_LINE = "Ctrl-C stops everything"  # the last line `kvpool up` prints once every role serves
EXPORT_RE = re.compile(r"export KVPOOL_JOIN_TOKEN_FILE=\S+")
EXPORTS_RE = re.compile(r"export KVPOOL_\w+=\S+(?: KVPOOL_\w+=\S+)*")  # every export the cluster printed
USAGE_RE = re.compile(r"^(\d+) (\d+)$", re.M)  # the snippet prints "prompt_tokens cached_tokens"


def quickstart_blocks(readme: str) -> list[str]:
    """The ```bash blocks of the "## Quickstart" section, in order; ValueError when there is none."""
    start = re.search(r"^## Quickstart", readme, re.M)
    if start is None:
        raise ValueError('README.md has no "## Quickstart" section')
    end = re.search(r"^## ", readme[start.end() :], re.M)
    section = readme[start.start() : start.end() + end.start() if end else len(readme)]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    if len(blocks) < 2:
        raise ValueError(f"the Quickstart has {len(blocks)} bash block(s); expected the cluster and a client")
    return blocks


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run(budget_s: float) -> int:
    t0 = time.monotonic()
    deadline = t0 + budget_s
    blocks = quickstart_blocks((ROOT / "README.md").read_text())
    failures: list[str] = []
    out_path = Path(tempfile.mkstemp(prefix="quickstart-up-", suffix=".log")[1])
    with out_path.open("wb") as out:
        # The cluster as a user starts it in a terminal: its own process group, so Ctrl-C is SIGINT to it.
        up = subprocess.Popen(["bash", "-c", blocks[0]], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        text = ""
        while time.monotonic() < deadline and up.poll() is None:
            text = out_path.read_text(errors="replace")
            if READY_LINE in text:
                break
            time.sleep(0.5)
        if READY_LINE not in text:
            why = f"exited {up.returncode}" if up.poll() is not None else f"not ready within {budget_s:.0f} s"
            print(f"quickstart: the cluster did not start ({why}); its output:\n{_tail(out_path)}")
            return 1
        print(f"quickstart: cluster up in {time.monotonic() - t0:.1f} s")
        if "kvpool cluster up:" not in text:
            failures.append("kvpool up printed no endpoints")
        export = EXPORT_RE.search(text)
        if export is None:
            failures.append("kvpool up printed no `export KVPOOL_JOIN_TOKEN_FILE=...` line")
        prelude = "".join(m.group(0) + "\n" for m in EXPORTS_RE.finditer(text))
        for i, block in enumerate(blocks[1:], start=2):
            t1 = time.monotonic()
            try:
                done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", prelude + block], cwd=ROOT,
                                      capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                      timeout=max(1.0, deadline - time.monotonic()))  # fmt: skip
            except subprocess.TimeoutExpired:
                failures.append(f"block {i} did not finish within the budget")
                continue
            print(f"quickstart: block {i} exit {done.returncode} in {time.monotonic() - t1:.1f} s")
            sys.stdout.write(done.stdout)
            if done.returncode != 0:
                failures.append(f"block {i} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
            usage = [(int(p), int(c)) for p, c in USAGE_RE.findall(done.stdout)]
            if "OpenAI(" in block:
                if len(usage) < 2:
                    failures.append(f"block {i}: expected 2 'prompt_tokens cached_tokens' lines, got {usage}")
                elif usage[-1][1] <= 0:
                    failures.append(
                        f"block {i}: the repeated request shows cached_tokens {usage[-1][1]}, not > 0"
                    )
    finally:
        if up.poll() is None:
            t2 = time.monotonic()
            os.killpg(up.pid, signal.SIGINT)  # Ctrl-C, as the README says
            try:
                up.wait(timeout=30)
                print(f"quickstart: Ctrl-C stopped the cluster in {time.monotonic() - t2:.1f} s")
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
                failures.append("Ctrl-C did not stop the cluster within 30 s")
    if up.returncode != 0 and not any("Ctrl-C" in f for f in failures):
        failures.append(f"kvpool up exited {up.returncode} after Ctrl-C")
    if "kvpool cluster stopped" not in out_path.read_text(errors="replace"):
        failures.append("kvpool up did not print 'kvpool cluster stopped'")
    elapsed = time.monotonic() - t0
    if elapsed > budget_s:
        failures.append(f"took {elapsed:.0f} s, over the {budget_s:.0f} s budget")
    for failure in failures:
        print(f"quickstart: FAILED: {failure}")
    if failures:
        print(f"quickstart: the cluster's output (tail):\n{_tail(out_path)}")
        return 1
    out_path.unlink(missing_ok=True)
    print(f"quickstart: OK in {elapsed:.1f} s")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--budget-s", type=float, default=180.0, help="the whole check's time limit [180]")
    return run(parser.parse_args().budget_s)


if __name__ == "__main__":
    sys.exit(main())
