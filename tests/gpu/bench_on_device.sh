#!/usr/bin/env bash
# `make bench-kernels` in parts, for a GPU lent a few minutes a command: kgen and its
# kernels from the wheel `make dist` wrote (as run_on_device.sh), each part in its own
# process under its own time limit, its tables and kernels.json under $OUT/bench/<part>
# (what a killed part printed stays), then every finished part merged into one report
# and its charts (python -m kgen.bench.kernels report) under $OUT/bench/all.
#   PARTS="decode_goals:q8_0 paged_goals" bash tests/gpu/bench_on_device.sh
# A part is SECTION[:KVS[:HEAD_DIMS]] (KVS and HEAD_DIMS comma-separated, "all" or empty
# for every one, KVS "each" for a part per registered format), e.g. prefill_long:all:64,
# decode_goals:f16,bf16:128 or decode_goals:each. PART_LIMIT is each
# part's limit in seconds (default 280); MATCH, SPLITS, SHAPES and DSHAPES pass on as
# KGEN_BENCH_MATCH, KGEN_BENCH_SPLITS, KGEN_BENCH_LONG_SHAPES and KGEN_BENCH_DECODE_SHAPES
# (e.g. DSHAPES=32/32,16/8,32/8 MATCH='_(g4|t4)_host$' PARTS="decode_goals:each:96,128":
# the one- and two-group forms beside the 4-group ones, head_dim 96 beside the tiled
# decode).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-bench-out}/bench
mkdir -p "$out"
. tests/gpu/wheel_venv.sh
t0=$(date +%s)
formats=$("$py" -I -c "from kgen.formats import FORMATS; print(' '.join(FORMATS))") || exit 2
parts=()
for part in ${PARTS:-heads variants prefill_long:each decode_long decode_goals:each paged_goals prefill_rows prefill_split mla_goals launch}; do
  IFS=: read -r section kvs hds <<< "$part"
  if [ "${kvs:-}" = each ]; then
    for kv in $formats; do parts+=("$section:$kv${hds:+:$hds}"); done
  else
    parts+=("$part")
  fi
done
done_parts=()
for part in "${parts[@]}"; do
  IFS=: read -r section kvs hds <<< "$part"
  name=$(echo "$part" | tr ':,' '-_')
  env=(KGEN_BENCH_ONLY="$section" KGEN_BENCH_OUT="$out/$name")
  [ -n "${kvs:-}" ] && [ "$kvs" != all ] && env+=(KGEN_BENCH_KV="$kvs")
  [ -n "${hds:-}" ] && [ "$hds" != all ] && env+=(KGEN_BENCH_HEAD_DIMS="$hds")
  [ -n "${MATCH:-}" ] && env+=(KGEN_BENCH_MATCH="$MATCH")
  [ -n "${SPLITS:-}" ] && env+=(KGEN_BENCH_SPLITS="$SPLITS")
  [ -n "${SHAPES:-}" ] && env+=(KGEN_BENCH_LONG_SHAPES="$SHAPES")
  [ -n "${DSHAPES:-}" ] && env+=(KGEN_BENCH_DECODE_SHAPES="$DSHAPES")
  # -I: the wheel's kgen, never the checkout's (the working directory).
  env "${env[@]}" timeout "${PART_LIMIT:-280}" "$py" -I -m kgen.bench.kernels \
    > "$out/$name.txt" 2>&1
  rc=$?
  echo "== $part: rc $rc, $(( $(date +%s) - t0 )) s"
  if [ "$rc" = 0 ]; then done_parts+=("$out/$name"); else tail -n 5 "$out/$name.txt"; fi
done
if [ "${#done_parts[@]}" -gt 0 ]; then
  KGEN_BENCH_OUT="$out/all" "$py" -I -m kgen.bench.kernels report "${done_parts[@]}" \
    > "$out/all.txt" 2>&1
  echo "== report: rc $?, $out/all.txt"
fi
