#!/bin/bash
# GPU tests + the H200 benchmark in one call on a machine without network, from wheels brought along.
#
#   WHEELS=dir/with/*.whl [AUTOTUNE_TGZ=results/h200/triton_autotune.tgz] [TOTAL_S=545] \
#     bash kernels/device_run.sh tests|bench|lora|all
#
# Run from the project root (or a copy holding the package folder, kernels/ and conversion/). Wheels used for the
# committed results: fla-core 0.6.0, flash-linear-attention 0.6.0, einops 0.8.2, transformers 5.23.0,
# pytest-timeout 2.4.0. Results go to $OUT (default ./device_out): gpu-tests.log, bench_h200.json, bench_h200.log,
# profile_128k.txt and triton_autotune.tgz (FLA's autotune results: restored from AUTOTUNE_TGZ at the start, so a
# fresh machine starts warm; a cold start costs ~80 s of autotuning). TOTAL_S bounds the whole script: the
# benchmark gets what the tests leave (its sections skip what would not finish, in priority order).
set -u
OUT=${OUT:-./device_out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kh_site \
  "${WHEELS:?set WHEELS to a folder of wheels}"/*.whl > /tmp/kh_pip.log 2>&1 || { cat /tmp/kh_pip.log; exit 3; }
# a package folder packed as .tar.xz (e.g. transformers without its other models, to fit the 64 MiB a call carries)
for t in "$WHEELS"/*.tar.xz; do [ -f "$t" ] && tar xJf "$t" -C /tmp/kh_site && el "unpacked $(basename "$t")"; done
# the package itself, imported as kimi_hybrid (with kimi_hybrid.kernels / .conversion / .app)
rm -rf /tmp/kh_pkg; python3 -m pip install -q --no-deps --no-build-isolation --no-index --target /tmp/kh_pkg . > /tmp/kh_pkg.log 2>&1 \
  || { cat /tmp/kh_pkg.log; exit 3; }
export PYTHONPATH=/tmp/kh_site:/tmp/kh_pkg PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# TRITON_CACHE_ROOT outside the copied tree (e.g. /tmp/khtc) keeps compiled kernels and inductor graphs between
# calls on a machine that stayed warm; the autotune tgz warms a fresh one
CR=${TRITON_CACHE_ROOT:-$PWD/.triton_cache}
mkdir -p "$CR"
AUTOTUNE_TGZ=${AUTOTUNE_TGZ:-results/h200/triton_autotune.tgz}
[ -f "$AUTOTUNE_TGZ" ] && tar xzf "$AUTOTUNE_TGZ" -C "$CR" && el "restored autotune results from $AUTOTUNE_TGZ"
export TRITON_CACHE_DIR=$CR/triton TORCHINDUCTOR_CACHE_DIR=$CR/inductor
save_cache() { (cd "$CR" && find triton -name "*.autotune.json" | tar czf "$OUT/triton_autotune.tgz" -T -); }
what=${1:-all}
if [ "$what" = tests ] || [ "$what" = all ]; then
  el "GPU tests"
  timeout ${TESTS_S:-300} python3 -m pytest ${GPU_TESTS:-kernels/tests tests/test_cache_api.py} -q -s \
    -p no:cacheprovider -rfE --durations=5 > "$OUT/gpu-tests.log" 2>&1
  el "GPU tests rc=$?"; grep -E "FAILED|ERROR|passed|failed|rel err|backend|peak extra" "$OUT/gpu-tests.log" | tail -16
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  left=$(( ${TOTAL_S:-545} - ($(date +%s) - T0) - 15 ))
  el "benchmark, budget ${left}s"
  python3 -m kimi_hybrid.kernels.bench_h200 --budget-s "$left" --out "$OUT/bench_h200.json" ${BENCH_ARGS:-} > "$OUT/bench_h200.log" 2>&1
  el "benchmark rc=$?"; grep -v "^ \|^\[transformers\]" "$OUT/bench_h200.log" | tail -30
fi
if [ "$what" = lora ]; then
  el "LoRA benchmark"
  python3 examples/bench_lora.py --out "$OUT/bench_lora_h200.json" > "$OUT/bench_lora_h200.log" 2>&1
  el "LoRA benchmark rc=$?"; tail -4 "$OUT/bench_lora_h200.log"
fi
save_cache
el "done"
