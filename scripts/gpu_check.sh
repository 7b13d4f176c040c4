#!/usr/bin/env bash
# The GPU check: rankmem's real CUDA path against ground truth, in one command of at most ~10 minutes.
#     bash scripts/gpu_check.sh            # on a machine with a CUDA GPU
#     bash scripts/gpu_check.sh --dry-run  # anywhere: compile and import every Python part, run the CPU parts
# Needs no network and installs nothing: it uses PYTHON (default python3), which must import a CUDA
# torch and psutil, numpy, rich, pytest and nvidia-ml-py (pynvml); rankmem runs from this tree through PYTHONPATH.
# Every step runs, whatever failed before it, under its own timeout (together 665 s); the summary at
# the end lists each step's exit status (124: timed out). With OUT set, everything is also written to
# $OUT/gpu_check.log. Exits 0 when every step passed, 1 otherwise; without a CUDA GPU, 0 at once.
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1  # a step killed by its timeout still leaves its output
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi

if [ "$DRY" = 0 ] && ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA GPU visible to $PY (torch.cuda.is_available() is false or torch is missing); nothing to check"
  exit 0
fi

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -W ignore::pytest.PytestConfigWarning)
NAMES=()
RCS=()
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo
  echo "=== $name (timeout ${limit}s): $*"
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start))s"
  NAMES+=("$name")
  RCS+=("$rc")
}

if [ "$DRY" = 1 ]; then
  step compile 60 "$PY" -m py_compile tests/test_gpu.py tests/dist_scripts/gpu_fresh_process.py bench/bench_probe.py \
    tests/dist_scripts/gpu_nvml_check.py scripts/gpu_advise_check.py scripts/gpu_anatomy_check.py \
    scripts/anatomy_tier_a.py
  step advise-check-args 30 "$PY" scripts/gpu_advise_check.py --dry-run
  step anatomy-check-args 30 "$PY" scripts/gpu_anatomy_check.py --dry-run
  step collect 60 "${PYTEST[@]}" --collect-only tests/test_gpu.py
  step fresh-process 60 "$PY" tests/dist_scripts/gpu_fresh_process.py
  step probe-bench 120 "$PY" bench/bench_probe.py --quick
else
  step environment 20 "$PY" -c 'import torch; print("GPU:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null
  step fresh-process 45 "$PY" tests/dist_scripts/gpu_fresh_process.py
  step reads-peaks-other-oom 120 "${PYTEST[@]}" tests/test_gpu.py -k "not nccl and not fresh_process"
  step nccl-one-rank 75 "${PYTEST[@]}" tests/test_gpu.py -k nccl
  # Device memory by owner: a child holding 2 GiB found as a descendant; parts sum to used; NVML's cost.
  step nvml-attribution 45 "$PY" tests/dist_scripts/gpu_nvml_check.py 2
  step probe-bench 90 "$PY" bench/bench_probe.py
  # The reference GPT probed at 2k-16k tokens; rankmem advise's peaks at 24k and 32k against the device.
  step advise-vs-device 180 "$PY" scripts/gpu_advise_check.py ${OUT:+--out "$OUT/advise_check"}
  # A sampled window's replay: exact against max_memory_allocated, the logits named, its cost, an OOM.
  step anatomy 90 "$PY" scripts/gpu_anatomy_check.py
  # The always-on split on the device: params and optimizer exact, the split sums to peak_allocated.
  step anatomy-tier-a 60 "$PY" scripts/anatomy_tier_a.py
fi

echo
echo "=== summary"
failed=0
for i in "${!NAMES[@]}"; do
  verdict=ok
  [ "${RCS[$i]}" = 0 ] || { verdict=FAILED; failed=1; }
  [ "${RCS[$i]}" = 124 ] && verdict="TIMED OUT"
  printf '%-24s rc=%-4s %s\n' "${NAMES[$i]}" "${RCS[$i]}" "$verdict"
done
exit "$failed"
