#!/usr/bin/env bash
# Time the kernel patches of benchmarks/next/ before and after, in one device call (no staging).
#
#   bash benchmarks/next/time_patches.sh prepare   here: writes .next/ (git-ignored): main's and each
#                                                  patch's versions of the files the patches touch;
#                                                  then carry [".whl", ".next"] in the call
#   bash benchmarks/next/time_patches.sh run       on the device: main, then each patch; logs and
#                                                  JSON -> $OUT
# The device copy may lack git and patch, so the patched files are made here. Each patch is timed
# alone against main in the same call (same machine): a probe's numbers compare only within a call.
set -uo pipefail
PATCHES="decode-early-stores verify-lazy-packed8"
case "${1:?usage: time_patches.sh prepare | run}" in
  prepare)
    rm -rf .next
    for p in $PATCHES; do
      t=$(mktemp -d); git archive HEAD | tar -x -C "$t"
      (cd "$t" && git apply "$OLDPWD/benchmarks/next/$p.patch") || exit 1
      for f in $(sed -n 's|^+++ b/||p' "benchmarks/next/$p.patch"); do
        mkdir -p ".next/$p/$(dirname "$f")" ".next/main/$(dirname "$f")"
        cp "$t/$f" ".next/$p/$f" && cp "$f" ".next/main/$f"
      done
      rm -rf "$t"
    done
    find .next -type f ;;
  run)
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
    time_decode() {  # buffered decode steps (probe_decode_factored.py), tag $1
      timeout 150 python3 benchmarks/probe_decode_factored.py --N 64,256 --rep 30 --tag "$1" 2>&1 \
        | tee "$OUT/probe_decode_$1.log"
    }
    time_lazy8() {  # eager and lazy spec steps at T=8 (bench_kernels.py), tag $1
      timeout 120 python3 benchmarks/bench_kernels.py --H 32 --N 64,256 --T 8 --rep 30 --no-snapshot \
        --no-upstream --tag "_$1" 2>&1 | tee "$OUT/bench_kernels_$1.log"
    }
    with_patch() {  # with_patch PATCH CMD...: CMD on the patched files, then main's back
      cp -r ".next/$1/." . && shift && "$@"; cp -r .next/main/. .
    }
    time_decode main
    with_patch decode-early-stores time_decode early_stores
    time_lazy8 main
    with_patch verify-lazy-packed8 time_lazy8 lazy_packed8 ;;
esac
