#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, run the GPU-marked tests and the probe benchmark
# (host and device) and print the figures. Run from the repository root:
#     bash scripts/gpu_check.sh
# It installs into .venv-gpu the torch that pip resolves there (a CUDA build), not the CPU pin.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch pytest pytest-timeout -e .
fi
"$VENV/bin/python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU'; print('GPU:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
timeout 600 "$VENV/bin/pytest" -q -m gpu tests/test_gpu.py -p no:cacheprovider
timeout 300 "$VENV/bin/python" bench/bench_probe.py
