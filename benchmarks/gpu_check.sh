#!/bin/sh
# The device stage's GPU checks, for a machine with a CUDA (or ROCm) GPU and a GPU build of
# torch already installed (nothing is installed here): the GPU tests (copy overlap, no early
# reuse, the fork-after-CUDA hazard) and benchmarks/bench_device.py. Run from the repository
# root; the results go to ${OUT:-bench-out}. Exit 3: no GPU build of torch, or no GPU.
set -u
PY=${PYTHON:-python3}
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
$PY - <<'PY' || exit 3
import sys
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip,
      "GPU", torch.cuda.is_available() and torch.cuda.get_device_name(0))
sys.exit(0 if torch.cuda.is_available() else 1)
PY
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
if $PY -c "import pytest, pytest_timeout" 2>/dev/null; then
    $PY -m pytest -p no:cacheprovider -q tests/gpu 2>&1 | tee "$OUT/gpu_tests.txt" || status=1
else
    echo "pytest (with pytest-timeout) is not installed here: the GPU tests did not run" | tee "$OUT/gpu_tests.txt"
    status=1
fi
$PY benchmarks/bench_device.py --reps 3 --json "$OUT/device.json" 2>&1 | tee "$OUT/device.txt" || status=1
exit $status
