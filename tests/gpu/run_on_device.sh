#!/usr/bin/env bash
# Every GPU check in one call, for a machine that has a GPU, CuPy, NumPy and
# pytest but no kgen install: generated/ holds the fatbins, so no toolchain is needed.
#   bash tests/gpu/run_on_device.sh [pytest args]
#   SANITIZE=memcheck|racecheck bash tests/gpu/run_on_device.sh   # under compute-sanitizer
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
python3 -m kgen doctor || true  # which image of each fatbin this GPU and driver will load
run=(python3 -m pytest -q -p no:cacheprovider -m gpu tests/generated tests/gpu "$@")
if [ -n "${SANITIZE:-}" ]; then
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  run=("$cs" --tool "$SANITIZE" --error-exitcode 3 --print-limit 20 "${run[@]}")
fi
"${run[@]}"
