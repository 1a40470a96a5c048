#!/usr/bin/env bash
# Kimi-Linear-48B-A3B-Instruct on TWO H200 (tensor parallel 2), DSPARK, dspark attention backend.
#
# Same model facts as kimi-linear-48b-a3b-1xh200.sh. With TP2 each GPU holds half the weights
# (~49 GB) and 16 of the 32 KDA heads, so a state slot is 20 x 16 x 64 KiB = 20 MiB per GPU and
# ~80 GB per GPU is left for KV + state: run twice the batch of the 1-GPU config.
set -euo pipefail
MODEL=${MODEL:-moonshotai/Kimi-Linear-48B-A3B-Instruct}
DRAFT=${DRAFT:?set DRAFT to a DSparkDraftModel checkpoint for Kimi-Linear-48B-A3B}
GAMMA=${GAMMA:-7}
export SGLANG_RAGGED_VERIFY_MODE=${SGLANG_RAGGED_VERIFY_MODE:-compact}  # see the 1xH200 file

args=(
  --model-path "$MODEL" --trust-remote-code
  # TP2: KDA heads (32) and MLA heads split over the GPUs; the plugin kernels see H=16.
  --tp 2
  --attention-backend dspark                  # MLA -> fa3, KDA -> plugin kernels (Hopper)
  --speculative-algorithm DSPARK
  --speculative-draft-model-path "$DRAFT"
  --speculative-dspark-block-size "$GAMMA"    # 7 = DSPARK training block; sweep 3..7
  --speculative-draft-attention-backend fa3   # Hopper draft attention (draft can't use "dspark")
  --enable-linear-replayssm-spec              # rings instead of per-step state snapshots
  --linear-replayssm-cache-len 16             # power of two >= 2*(gamma+1)
  --mamba-ssm-dtype float32                   # exact fold of the accepted prefix
  # 20 MiB per slot per GPU: 1024 slots = 20 GB/GPU, for 256 running requests.
  --max-mamba-cache-size 1024
  --max-running-requests 256
  --mem-fraction-static 0.88
  --host 0.0.0.0 --port "${PORT:-30000}"
)
exec python -m sglang.launch_server "${args[@]}" "$@"
