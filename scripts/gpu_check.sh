#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, run the GPU-marked tests and the probe benchmark
# (host and device) and print the figures. Run from the repository root:
#     bash scripts/gpu_check.sh
# It needs no network: it uses the first Python that imports a CUDA-enabled torch (PYTHON, then
# python3), with rankmem from this tree on PYTHONPATH. rankmem's own dependencies (psutil, numpy,
# rich, pytest) must be importable there; pip installs any that are missing when it can.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA GPU visible to torch"
print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PY
for mod in psutil numpy rich pytest pytest_timeout; do
  "$PY" -c "import $mod" 2>/dev/null || "$PY" -m pip install -q "${mod/_/-}" || echo "warning: $mod missing"
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
timeout 600 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts=""
timeout 300 "$PY" bench/bench_probe.py
