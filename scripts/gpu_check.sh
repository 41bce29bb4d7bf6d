#!/usr/bin/env bash
# The GPU checks of issue 15, in under 5 minutes on one GPU: tests/gpu (a GPU worker beside CPU
# workers, the PS on the GPU, ddp over NCCL, mixed precision, GPU vs CPU numerics) and
# benchmarks/gpu_hetero.py (profile on the real devices, then time to accuracy of cadp and
# auto on 1 GPU + 2 CPU workers vs the GPU alone).
#
#   bash scripts/gpu_check.sh [OUT_DIR]      (default: runs/gpu_check)
#
# Uses the python3 on PATH (a CUDA build of torch); packages it lacks can lie as wheels in
# .whl/ (they are installed into a temporary folder, nothing else is touched).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_check}
mkdir -p "$out"
py=${PYTHON:-python3}
extra=""
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hetrain-site .whl/*.whl
  extra=/tmp/hetrain-site
fi
export PYTHONPATH="$PWD/src${extra:+:$extra}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU is visible to this torch; nothing to check")
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.device_count()} GPU(s), NCCL {torch.distributed.is_nccl_available()}")
PY
status=0  # the benchmark runs even when a test fails; the exit status tells
"$py" -m pytest tests/gpu -o addopts="" -m gpu -q -p no:cacheprovider -rs 2>&1 \
  | tee "$out/gpu_tests.log" || status=1
"$py" benchmarks/gpu_hetero.py --out "$out" 2>&1 | tee "$out/gpu_bench.log" || status=1
exit $status
