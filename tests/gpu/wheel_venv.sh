# Sourced by run_on_device.sh and bench_on_device.sh (from the checkout's root): the venv
# $venv (GPU_VENV, default .gpu/venv) that sees the machine's CuPy, NumPy and pytest, with
# kgen and its kernels from the wheel `make dist` wrote (WHEEL, default dist/kgen-*.whl, else
# the packed dist/carry/kgen-*.whl.xz that tests/gpu/carry_wheel.py wrote, unpacked first)
# installed into it; $py is its python. Exits 2 when there is no wheel or the install fails.
wheel=${WHEEL:-$(ls dist/kgen-*.whl 2>/dev/null | head -n 1)}
packed=$(ls dist/carry/kgen-*.whl.xz 2>/dev/null | head -n 1)
if [ -z "$wheel" ] && [ -n "$packed" ]; then  # carried packed (tests/gpu/carry_wheel.py)
  wheel=$(python3 tests/gpu/carry_wheel.py unpack "$packed" .gpu/wheel) || exit 2
fi
if [ -z "$wheel" ] || [ ! -f "$wheel" ]; then
  echo "no kgen wheel: run \`make dist\` on a machine with the CUDA 11.8 toolchain" >&2
  exit 2
fi
venv=${GPU_VENV:-.gpu/venv}
py=$venv/bin/python
python3 -m venv --without-pip "$venv" || exit 2
# The venv sees what python3 sees (CuPy, NumPy, pytest), even when python3 is a venv.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
python3 -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' \
  > "$site/_host_packages.pth" || exit 2
python3 -m pip --python "$py" install -q --no-deps --force-reinstall "$wheel" || exit 2
unset KGEN_GENERATED
export PYTHONUNBUFFERED=1
