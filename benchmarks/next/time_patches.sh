#!/usr/bin/env bash
# Time the kernel patches of benchmarks/next/ before and after, in one device call (no staging).
#
#   bash benchmarks/next/time_patches.sh prepare   here: writes .next/ (git-ignored): main's and each
#                                                  patch's versions of the files the patches touch;
#                                                  then carry [".whl", ".next"] in the call
#   bash benchmarks/next/time_patches.sh run [decode|tma]
#                                                  on the device: main, then each patch of that
#                                                  kernel; logs and JSON -> $OUT
# The device copy may lack git and patch, so the patched files are made here. Each patch is timed
# alone against main in the same call (same machine): a probe's numbers compare only within a call.
set -uo pipefail
PATCHES="decode-tma decode-early-stores"
case "${1:?usage: time_patches.sh prepare | run}" in
  prepare)
    rm -rf .next
    for p in $PATCHES; do
      t=$(mktemp -d); git archive HEAD | tar -x -C "$t"
      (cd "$t" && git apply "$OLDPWD/benchmarks/next/$p.patch") || exit 1
      for f in $(sed -n 's|^+++ b/||p' "benchmarks/next/$p.patch"); do
        mkdir -p ".next/$p/$(dirname "$f")" ".next/main/$(dirname "$f")"
        cp "$t/$f" ".next/$p/$f" && { [ ! -e "$f" ] || cp "$f" ".next/main/$f"; }  # a new file: none in main
      done
      rm -rf "$t"
    done
    find .next -type f ;;
  run)
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    export TRITON_CACHE_DIR=/tmp/triton-cache PYTHONUNBUFFERED=1
    time_decode() {  # buffered decode steps (probe_decode_factored.py), tag $1, time limit $2 s
      timeout "${2:-120}" python3 benchmarks/probe_decode_factored.py --N 64,256 --rep 30 --tag "$1" 2>&1 \
        | tee "$OUT/probe_decode_$1.log"
    }
    check_and_time_tma() {  # the TMA step against float64 (tests), then the probe
      timeout 90 python3 -m pytest -q -x tests/kernels/test_decode_buffered.py -k tma 2>&1 | tee "$OUT/pytest_tma.log"
      time_decode tma 260
    }
    with_patch() {  # with_patch PATCH CMD...: CMD on the patched files, then main's back
      cp -r ".next/$1/." . && shift && "$@"; cp -r .next/main/. .
    }
    # decode: the TMA step first (its run times main's factored step too), then main and early stores
    with_patch decode-tma check_and_time_tma
    [ "${2:-decode}" = tma ] && exit 0  # "run tma": the TMA step alone
    time_decode main
    with_patch decode-early-stores time_decode early_stores ;;
esac
