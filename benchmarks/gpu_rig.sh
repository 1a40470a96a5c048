#!/usr/bin/env bash
# The GPU serving rig, run on a GPU machine from the checkout root (docs/guide/gpu-serving.md).
#
#   bash benchmarks/gpu_rig.sh stage N [--last]    copy staged SGLang part N (carried .stage/pN) to /tmp/stage
#   bash benchmarks/gpu_rig.sh e2e [pytest args]   GPU end-to-end tests (tests/gpu, kimi32 unless
#                                                  DSPARK_GPU_E2E_MODELS says); logs -> $OUT
#   DSPARK_GPU_E2E_MODELS=k3-12h bash benchmarks/gpu_rig.sh e2e    the Kimi-K3 e2e (one TP8 rank of
#                                                  K3; six servers, one wave on an 80 GB GPU)
#   bash benchmarks/gpu_rig.sh bench [args]        benchmarks/bench_serving.py; results -> $OUT
#                                                  (Kimi-K3 tokens/s: --model k3-8l --gamma 7)
#   bash benchmarks/gpu_rig.sh run CMD [args]      any command in the rig's environment (kernel tests,
#                                                  benchmarks/bench_output_gate.py, ...)
#   bash benchmarks/gpu_rig.sh soak [args]         benchmarks/soak.py (2,000 mixed requests, four
#                                                  servers); soak.json / soak.md and logs -> $OUT
#
# e2e/bench need every part staged on this (still warm) machine and .rig/sglang-gpu-env.sh
# (the staging environment script, in the ignored folder .rig). The Triton
# cache lives in /tmp/triton-cache for the machine's life; with .rig/triton-cache.tgz (brought back
# by an earlier call) a fresh machine skips most of the Triton JIT.
set -uo pipefail
cmd=${1:?usage: gpu_rig.sh stage N | e2e | bench | soak}
shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
case "$cmd" in
  stage)
    mkdir -p /tmp/stage && cp ".stage/p$1"/* /tmp/stage/ && ls -la /tmp/stage || exit 1
    # with --last: unpack now (once per machine) and write the test models (RIG_MODELS, default
    # kimi32 and tiny; add k3-12h for the K3 e2e), so the calls that serve spend their minutes
    # serving (ignored files stay on a warm machine between calls)
    if [ "${2:-}" = "--last" ]; then
      # shellcheck disable=SC1091
      source .rig/sglang-gpu-env.sh "$PWD" || exit 1
      for model in ${RIG_MODELS:-kimi32 tiny}; do  # the test models the calls will serve
        python3 -m sglang_dspark_plugin.harness.tiny_models --model "$model" || exit 1
      done
    fi
    exit 0 ;;
esac

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
# shellcheck disable=SC1091
source .rig/sglang-gpu-env.sh "$PWD" || exit 1
export TRITON_CACHE_DIR=/tmp/triton-cache
if [ ! -d "$TRITON_CACHE_DIR" ] && [ -f .rig/triton-cache.tgz ]; then
  mkdir -p "$TRITON_CACHE_DIR" && tar -C "$TRITON_CACHE_DIR" -xzf .rig/triton-cache.tgz
fi
# SGLang's Rust radix TreeCore is built for the pinned torch 2.14; on the rig's torch 2.11 it
# panics inserting a prefix checkpoint ("Unsupported TypeMeta"): use SGLang's Python TreeCore.
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=${SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND:-python}
# SGLang 0.5.23's breakable prefill graph keeps its break inputs as weak references, whose blocks
# the allocator hands to later-captured buckets (sgl-project/sglang#37606). RIG_BCG_STRONG_REFS=1
# applies the fix of sgl-project/sglang#37448 (strong references) to this machine's copy of SGLang:
# a test rig change, never the product's. On KDA models the graph still gave wrong greedy tokens
# with it, stock SGLang included (docs/guide/gpu-serving.md).
if [ "${RIG_BCG_STRONG_REFS:-0}" = 1 ]; then
  bcg=$(python3 -c "import sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.breakable_cuda_graph as m; print(m.__file__)") || exit 1
  sed -i -e 's/captured_args = tuple(_weak_ref_if_tensor(a) for a in args)/captured_args = tuple(args)/' \
    -e 's/captured_kwargs = {k: _weak_ref_if_tensor(v) for k, v in kwargs.items()}/captured_kwargs = dict(kwargs)/' "$bcg"
  grep -q "captured_args = tuple(args)" "$bcg" && grep -q "captured_kwargs = dict(kwargs)" "$bcg" \
    || { echo "RIG_BCG_STRONG_REFS: the patch did not apply to $bcg" >&2; exit 1; }
  echo "rig: SGLang's breakable graph holds strong references to its break inputs (sglang#37448)"
fi
# Multi-GPU machines: NVLink multicast stays off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

stop_leftovers() {  # servers run in their own sessions: never leave one holding the GPU
  # match servers and their scheduler/detokenizer children only: a wider pattern ("sglang") also
  # matches the calling shell when its command line names .rig/sglang-gpu-env.sh, and kills it
  pkill -INT -f 'sglang[.]launch_server' 2>/dev/null; sleep 5
  pkill -KILL -f 'sglang[.]launch_server|sglang::' 2>/dev/null; true
}

save_cache() {  # the Triton cache, if it fits what a call may bring back
  tar -C "$TRITON_CACHE_DIR" -czf /tmp/triton-cache.tgz . 2>/dev/null
  [ "$(stat -c %s /tmp/triton-cache.tgz)" -lt 16000000 ] && cp /tmp/triton-cache.tgz "$OUT/"
}

# a run cut short by a time limit leaves its server holding the GPU for the next run
stop_leftovers

case "$cmd" in
  e2e)
    export DSPARK_GPU_E2E_LOG_DIR=/tmp/gpu-e2e
    # one model per call: both together overrun a call's 10 minutes (docs/guide/gpu-serving.md);
    # DSPARK_GPU_E2E_MODELS=tiny in a second call
    export DSPARK_GPU_E2E_MODELS=${DSPARK_GPU_E2E_MODELS:-kimi32}
    mkdir -p "$DSPARK_GPU_E2E_LOG_DIR"
    # its own limit, below the call's: the logs below must still be packed when it is cut short
    timeout -s INT "${E2E_TIMEOUT:-530}" python3 -m pytest tests/gpu -p no:cacheprovider -rA "$@" 2>&1 \
      | tee "$DSPARK_GPU_E2E_LOG_DIR/pytest.log"
    rc=${PIPESTATUS[0]}
    stop_leftovers
    tar -C /tmp -czf "$OUT/gpu-e2e-logs.tgz" gpu-e2e
    save_cache
    exit "$rc" ;;
  bench)
    timeout -s INT "${BENCH_TIMEOUT:-540}" python3 benchmarks/bench_serving.py --out "$OUT" --log-dir /tmp/bench-serving "$@"
    rc=$?
    stop_leftovers
    find /tmp/bench-serving -name '*.json*' -path '*profile*' -delete
    tar -C /tmp -czf "$OUT/bench-serving-logs.tgz" bench-serving
    save_cache
    exit "$rc" ;;
  run)
    timeout -s INT "${RUN_TIMEOUT:-540}" "$@"
    rc=$?
    stop_leftovers
    save_cache
    exit "$rc" ;;
  soak)
    # its own limit, below the call's: the logs below must still be packed when it is cut short
    timeout -s INT "${SOAK_TIMEOUT:-540}" python3 benchmarks/soak.py --out "$OUT" --log-dir /tmp/soak "$@"
    rc=$?
    stop_leftovers
    tar -C /tmp -czf "$OUT/soak-logs.tgz" soak
    save_cache
    exit "$rc" ;;
  *) echo "unknown command $cmd" >&2; exit 2 ;;
esac
