#!/bin/bash
# GPU tests, the kernel micro-benchmarks and the H200 benchmark in one call on a machine without network, from
# wheels brought along, within one time budget.
#
#   WHEELS=dir/with/wheels [TOTAL_S=570] [GPU_TESTS="kernels/tests tests/test_cache_api.py"] [TESTS_S=300] \
#     [SECTIONS=setup,cold,decode,generate] [BENCH_ARGS=...] [KERNELS_S=90] [KERNELS_ARGS=...] \
#     [AUTOTUNE_TGZ=results/h200/triton_autotune.tgz] bash kernels/device_run.sh [tests,kernels,bench|all|lora]
#
# The argument is a comma-separated list of steps, run in this order: tests (pytest on GPU_TESTS, at most TESTS_S
# seconds), kernels (`python -m kimi_hybrid.kernels.bench_kernels KERNELS_ARGS`, at most KERNELS_S seconds, when that
# module exists), bench (`python -m kimi_hybrid.kernels.bench_h200 --sections SECTIONS BENCH_ARGS` with the seconds
# left of TOTAL_S as its --budget-s: its sections skip what would not finish and record why). `all` = tests,kernels,
# bench; `lora` runs examples/bench_lora.py. Run from the project root (or a copy holding the package folders).
#
# WHEELS: fla-core 0.6.0, flash-linear-attention 0.6.0, einops, pytest-timeout, and transformers 5.24.0 as a slim
# .tar.xz of the package folder (kernels/README.md: the full wheel does not fit the 64 MiB a call carries). Results
# go to $OUT (default ./device_out), at most 8 files: gpu-tests.log, bench_kernels.log (+ its own JSON if it writes
# one), bench_h200.json, bench_h200.log, profile_128k.txt, triton_autotune.tgz (FLA's autotune results: restored from
# AUTOTUNE_TGZ at the start, so a fresh machine starts warm; a cold start costs ~80 s of autotuning). Were there more
# than 8, the logs are packed into logs.tgz.
set -u
OUT=${OUT:-./device_out}
export OUT
mkdir -p "$OUT"
T0=$(date +%s)
TOTAL_S=${TOTAL_S:-570}
KH=${KH_TMP:-/tmp}  # where the wheels and the package are installed (kh_site, kh_pkg) and pip logs go
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( TOTAL_S - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $KH/kh_site \
  "${WHEELS:?set WHEELS to a folder of wheels}"/*.whl > $KH/kh_pip.log 2>&1 || { cat $KH/kh_pip.log; exit 3; }
# a package folder packed as .tar.xz (transformers without its other models, to fit the 64 MiB a call carries)
for t in "$WHEELS"/*.tar.xz; do [ -f "$t" ] && tar xJf "$t" -C $KH/kh_site && el "unpacked $(basename "$t")"; done
# the package itself, imported as kimi_hybrid (with kimi_hybrid.kernels / .conversion / .app); reinstalled on every
# call, so a machine still warm from a previous call runs this call's code
rm -rf $KH/kh_pkg; python3 -m pip install -q --no-deps --no-build-isolation --no-index --target $KH/kh_pkg . \
  > $KH/kh_pkg.log 2>&1 || { cat $KH/kh_pkg.log; exit 3; }
export PYTHONPATH=$KH/kh_site:$KH/kh_pkg PYTHONUNBUFFERED=1 TQDM_DISABLE=1
# TRITON_CACHE_ROOT outside the copied tree (e.g. /tmp/khtc) keeps compiled kernels and inductor graphs between
# calls on a machine that stayed warm; the autotune tgz warms a fresh one
CR=${TRITON_CACHE_ROOT:-$PWD/.triton_cache}
mkdir -p "$CR"
AUTOTUNE_TGZ=${AUTOTUNE_TGZ:-results/h200/triton_autotune.tgz}
[ -f "$AUTOTUNE_TGZ" ] && tar xzf "$AUTOTUNE_TGZ" -C "$CR" && el "restored autotune results from $AUTOTUNE_TGZ"
export TRITON_CACHE_DIR=$CR/triton TORCHINDUCTOR_CACHE_DIR=$CR/inductor
save_cache() { (cd "$CR" && find triton -name "*.autotune.json" | tar czf "$OUT/triton_autotune.tgz" -T -); }
steps=${1:-all}
[ "$steps" = all ] && steps=tests,kernels,bench
has() { case ",$steps," in *",$1,"*) return 0;; esac; return 1; }

if has tests; then
  s=$(( ${TESTS_S:-300} < $(left) ? ${TESTS_S:-300} : $(left) ))
  el "GPU tests (${s}s): ${GPU_TESTS:-kernels/tests tests/test_cache_api.py}"
  timeout "$s" python3 -m pytest ${GPU_TESTS:-kernels/tests tests/test_cache_api.py} -q -s -p no:cacheprovider \
    -rfE --durations=5 > "$OUT/gpu-tests.log" 2>&1
  el "GPU tests rc=$?"; grep -E "FAILED|ERROR|passed|failed|rel err|backend|peak extra" "$OUT/gpu-tests.log" | tail -16
fi
if has kernels; then
  if python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('kimi_hybrid.kernels.bench_kernels') is None)"; then
    s=$(( ${KERNELS_S:-90} < $(left) ? ${KERNELS_S:-90} : $(left) ))
    el "kernel micro-benchmarks (${s}s)"
    timeout "$s" python3 -m kimi_hybrid.kernels.bench_kernels ${KERNELS_ARGS:-} > "$OUT/bench_kernels.log" 2>&1
    el "kernel micro-benchmarks rc=$?"; tail -20 "$OUT/bench_kernels.log"
  else
    el "no kimi_hybrid.kernels.bench_kernels in this tree: kernel micro-benchmarks skipped"
  fi
fi
if has bench; then
  b=$(( $(left) - 15 ))
  el "benchmark, sections ${SECTIONS:-all}, budget ${b}s"
  python3 -m kimi_hybrid.kernels.bench_h200 --budget-s "$b" --out "$OUT/bench_h200.json" \
    ${SECTIONS:+--sections "$SECTIONS"} ${BENCH_ARGS:-} > "$OUT/bench_h200.log" 2>&1
  el "benchmark rc=$?"; grep -v "^ \|^\[transformers\]" "$OUT/bench_h200.log" | tail -30
fi
if has lora; then
  el "LoRA benchmark"
  python3 examples/bench_lora.py --out "$OUT/bench_lora_h200.json" > "$OUT/bench_lora_h200.log" 2>&1
  el "LoRA benchmark rc=$?"; tail -4 "$OUT/bench_lora_h200.log"
fi
save_cache
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log) && el "more than 8 result files: logs packed into logs.tgz"
fi
el "done"
