#!/usr/bin/env bash
# Kimi-K3 on 8x B200 (tensor parallel 8), DSPARK with RadixArk/Kimi-K3-DSpark.
#
# Same model as kimi-k3-tp8-h200.sh (12 KDA heads per GPU, 52 MiB fp32 state slot per GPU).
# On Blackwell SGLang already has a fast KDA verify (CuTe, nv_cutedsl); the plugin replaces it
# with its Triton kernels, which also handle ragged (compact) verify layouts that the CuTe kernel
# refuses. Compare against --attention-backend trtllm_mla (stock) on your traffic.
set -euo pipefail
MODEL=${MODEL:-moonshotai/Kimi-K3}
DRAFT=${DRAFT:-RadixArk/Kimi-K3-DSpark}
GAMMA=${GAMMA:-7}
export SGLANG_RAGGED_VERIFY_MODE=${SGLANG_RAGGED_VERIFY_MODE:-compact}
# MLA delegate of the dspark backend. The plugin's default on Blackwell is flashinfer (SGLang's
# own default MLA choice there); trtllm_mla is what SGLang's K3 override picks on sm_100 and is
# usually the faster MLA decode. It needs page size 32 or 64: SGLang enforces that only when the
# backend is *named* trtllm_mla, so with "dspark" the --page-size below must be set by hand.
export SGLANG_DSPARK_FULL_ATTN_BACKEND=${SGLANG_DSPARK_FULL_ATTN_BACKEND:-trtllm_mla}

args=(
  --model-path "$MODEL" --trust-remote-code
  --tp 8
  --attention-backend dspark                      # MLA -> $SGLANG_DSPARK_FULL_ATTN_BACKEND, KDA -> plugin
  # Page size 64: required by trtllm_mla (above) and by the trtllm_mha draft backend (16..128).
  --page-size 64
  --speculative-algorithm DSPARK
  --speculative-draft-model-path "$DRAFT"
  --speculative-dspark-block-size "$GAMMA"
  # trtllm_mha = SGLang's own sm_100 default for the K3 DSPARK draft; it is not applied
  # automatically here because the target backend is named "dspark".
  --speculative-draft-attention-backend trtllm_mha
  --enable-linear-replayssm-spec                  # rings, not snapshots
  --linear-replayssm-cache-len 16                 # power of two >= 2*(gamma+1)
  # fp32 state. (On sm_100 SGLang's flashinfer KDA decode/verify would want bf16 state; the plugin
  # kernels and the exact ReplaySSM fold use fp32.)
  --mamba-ssm-dtype float32
  --max-mamba-cache-size 768                      # 52 MiB/slot/GPU: ~40 GB of 180 GB per B200
  --max-running-requests 192
  --mem-fraction-static 0.85
  --host 0.0.0.0 --port "${PORT:-30000}"
)
exec python -m sglang.launch_server "${args[@]}" "$@"
