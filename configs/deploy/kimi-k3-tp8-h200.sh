#!/usr/bin/env bash
# Kimi-K3 on 8x H200 (tensor parallel 8), DSPARK with the public RadixArk/Kimi-K3-DSpark draft.
#
# Model facts: 93 layers = 69 KDA + 24 MLA, hidden 7168, KDA 96 heads x 128 with
# gate_lower_bound -5 (so 12 KDA heads per GPU at TP8), LatentMoE 896 experts top-16 (MXFP4).
# fp32 state slot per GPU = 69 x 12 x 64 KiB = 52 MiB (+conv) -- without ReplaySSM a gamma=7
# verify also snapshots 8 of those per request ("8 slots x 57.81 MiB = 28.9 GiB per rank" was
# reported for exactly this setup), which is what caps concurrency.
set -euo pipefail
MODEL=${MODEL:-moonshotai/Kimi-K3}
DRAFT=${DRAFT:-RadixArk/Kimi-K3-DSpark}   # block size 7, confidence head included
GAMMA=${GAMMA:-7}
export SGLANG_RAGGED_VERIFY_MODE=${SGLANG_RAGGED_VERIFY_MODE:-compact}  # production DSPARK mode

args=(
  --model-path "$MODEL" --trust-remote-code
  --tp 8
  # MLA -> fa3 (Hopper), KDA -> plugin kernels. This is where the plugin matters most: on Hopper
  # SGLang has no fused KDA MTP-verify kernel (its CuTe one needs sm_100).
  --attention-backend dspark
  --speculative-algorithm DSPARK
  --speculative-draft-model-path "$DRAFT"
  --speculative-dspark-block-size "$GAMMA"    # the draft's trained block size
  --speculative-draft-attention-backend fa3   # K3 defaults the draft to trtllm_mha only on sm_100
  --enable-linear-replayssm-spec              # removes the 8-snapshot state cost above
  --linear-replayssm-cache-len 16             # power of two >= 2*(gamma+1) = 16
  --mamba-ssm-dtype float32                   # exact fold; K3 state is fp32 by default
  # 52 MiB per slot per GPU: 512 slots = 26 GB/GPU for 128 running requests.
  --max-mamba-cache-size 512
  --max-running-requests 128
  --mem-fraction-static 0.85
  --host 0.0.0.0 --port "${PORT:-30000}"
)
exec python -m sglang.launch_server "${args[@]}" "$@"
