#!/usr/bin/env bash
# Every GPU check in one call, for a machine that has a GPU, CuPy, NumPy and pytest
# but no toolchain: kgen and its kernels come from the wheel `make dist` wrote
# (dist/kgen-*.whl), installed into a venv of its own that sees the machine's CuPy;
# the tests are this checkout's (tests/kernels collects every built kernel's tests from
# the wheel's manifest).
#   bash tests/gpu/run_on_device.sh [pytest args]
#   SANITIZE=memcheck|racecheck bash tests/gpu/run_on_device.sh   # under compute-sanitizer
#   WHEEL=path/to/kgen.whl bash tests/gpu/run_on_device.sh         # another wheel
set -uo pipefail
cd "$(dirname "$0")/../.."
. tests/gpu/wheel_venv.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
"$venv/bin/python" -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
# kgen and kgen_kernels must come from the wheel, not from this checkout.
"$venv/bin/python" -I - <<'EOF' || exit 2
import kgen, kgen_kernels
print("kgen from", kgen.__file__, "| kernels from", kgen_kernels.ROOT)
assert "site-packages" in kgen.__file__ and "site-packages" in str(kgen_kernels.ROOT)
EOF
"$venv/bin/python" -I -m kgen doctor || true  # which image each fatbin loads on this GPU
# -I: isolated, so the checkout (the working directory) never shadows the wheel.
run=("$venv/bin/python" -I -m pytest -p no:cacheprovider -m gpu --rootdir "$PWD"
     tests/kernels tests/gpu "$@")
if [ -n "${SANITIZE:-}" ]; then
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  run=("$cs" --tool "$SANITIZE" --error-exitcode 3 --print-limit 20 "${run[@]}")
fi
"${run[@]}"
