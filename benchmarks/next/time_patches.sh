#!/usr/bin/env bash
# Time the kernel patches of benchmarks/next/ before and after, in one device call (no staging).
#
#   bash benchmarks/next/time_patches.sh prepare   here: writes .next/ (git-ignored) with the patched
#                                                  files; then carry [".whl", ".next"] in the call
#   bash benchmarks/next/time_patches.sh run       on the device: main, then each patch; logs and
#                                                  JSON -> $OUT
# The device copy may lack git and patch, so the patched files are made here. Each patch is timed
# alone against main in the same call (same machine): a probe's numbers compare only within a call.
set -uo pipefail
K=sglang_dspark_plugin/kernels
case "${1:?usage: time_patches.sh prepare | run}" in
  prepare)
    rm -rf .next && mkdir -p .next
    for p in decode-early-stores verify-lazy-packed8; do
      t=$(mktemp -d); git archive HEAD | tar -x -C "$t"
      (cd "$t" && git apply "$OLDPWD/benchmarks/next/$p.patch") || exit 1
      mkdir -p ".next/$p"
      for f in $(grep '^+++ b/' "benchmarks/next/$p.patch" | sed 's|^+++ b/||'); do cp "$t/$f" ".next/$p/$(basename "$f")"; done
      rm -rf "$t"
    done
    ls -R .next ;;
  run)
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
    cp $K/decode.py /tmp/decode.main.py
    timeout 150 python3 benchmarks/probe_decode_factored.py --N 64,256 --rep 30 --tag main 2>&1 | tee "$OUT/probe_main.log"
    cp .next/decode-early-stores/decode.py $K/decode.py
    timeout 150 python3 benchmarks/probe_decode_factored.py --N 64,256 --rep 30 --tag early_stores 2>&1 | tee "$OUT/probe_early_stores.log"
    cp /tmp/decode.main.py $K/decode.py
    timeout 120 python3 benchmarks/bench_kernels.py --H 32 --N 64,256 --T 8 --rep 30 --no-snapshot --no-upstream --tag _main 2>&1 | tee "$OUT/bench_main.log"
    cp .next/verify-lazy-packed8/mtp_verify_chunked.py $K/mtp_verify_chunked.py
    timeout 120 python3 benchmarks/bench_kernels.py --H 32 --N 64,256 --T 8 --rep 30 --no-snapshot --no-upstream --tag _lazy_packed8 2>&1 | tee "$OUT/bench_lazy_packed8.log" ;;
esac
