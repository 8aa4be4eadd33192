#!/bin/bash
# Run the GPU test suites and / or the H200 benchmark on a machine without network, from wheels brought along.
#
#   WHEELS=dir/with/*.whl  [AUTOTUNE_TGZ=triton_autotune.tgz]  bash kernels/device_run.sh tests|bench|lora|all
#
# Wheels used for the committed results: fla-core 0.6.0, flash-linear-attention 0.6.0, einops 0.8.2,
# transformers 5.23.0, peft 0.21.2, accelerate 1.15.0 (pip download them on a networked machine). Results and logs go
# to $OUT (default ./device_out); the Triton autotune results are saved there as triton_autotune.tgz and restored from
# AUTOTUNE_TGZ on the next run (FLA's cold autotuning costs ~80 s per new shape family).
set -u
OUT=${OUT:-./device_out}
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kh_site \
  "${WHEELS:?set WHEELS to a folder of wheels}"/*.whl > /tmp/kh_pip.log 2>&1 || { cat /tmp/kh_pip.log; exit 3; }
export PYTHONPATH=/tmp/kh_site:$PWD PYTHONUNBUFFERED=1 TQDM_DISABLE=1
mkdir -p .triton_cache
[ -n "${AUTOTUNE_TGZ:-}" ] && [ -f "$AUTOTUNE_TGZ" ] && tar xzf "$AUTOTUNE_TGZ" -C .triton_cache && el "restored autotune cache"
export TRITON_CACHE_DIR=$PWD/.triton_cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.triton_cache/inductor
save_cache() { (cd .triton_cache && find triton -name "*.autotune.json" | tar czf "$OUT/triton_autotune.tgz" -T -); }
what=${1:-all}
if [ "$what" = tests ] || [ "$what" = all ]; then
  el "GPU tests"
  python3 -m pytest kernels/tests -v -p no:cacheprovider --timeout 300 -rfE --durations=10 > "$OUT/gpu-tests.log" 2>&1
  el "kernel tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu-tests.log" | tail -20
  python3 -m pytest tests/test_lora.py -m gpu -v -p no:cacheprovider --timeout 300 -rfE > "$OUT/lora-gpu-tests.log" 2>&1
  el "LoRA GPU tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/lora-gpu-tests.log" | tail -8
  save_cache
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  el "benchmark"
  python3 kernels/bench_h200.py --compile-decode --long 1048576 --long-warmup \
    --out "$OUT/bench_h200.json" > "$OUT/bench_h200.log" 2>&1
  el "benchmark rc=$?"; grep -v "^ \|^\[" "$OUT/bench_h200.log" | tail -25
  save_cache
fi
if [ "$what" = lora ] || [ "$what" = all ]; then
  el "LoRA benchmark"
  python3 examples/bench_lora.py --out "$OUT/bench_lora_h200.json" > "$OUT/bench_lora_h200.log" 2>&1
  el "LoRA benchmark rc=$?"; tail -4 "$OUT/bench_lora_h200.log"
  save_cache
fi
