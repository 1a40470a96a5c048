#!/usr/bin/env bash
# Kimi-Linear-48B-A3B-Instruct on ONE H200 (141 GB), DSPARK speculation, dspark attention backend.
#
# Model facts behind the numbers (docs/guide/deployment.md): 27 layers = 20 KDA + 7 MLA
# (NoPE), hidden 2304, KDA 32 heads x head_dim 128, MoE 256 experts top-8 (3B active).
# bf16 weights ~97 GB -> ~35 GB left for KV + recurrent state + activations at TP1.
#
# DRAFT: SGLang's DSPARK needs a DSparkDraftModel checkpoint trained for this target (hidden 2304,
# markov_rank > 0, mask_token_id, dflash_config.target_layer_ids); no public one exists for
# Kimi-Linear at the time of writing. Point DRAFT at yours.
set -euo pipefail
MODEL=${MODEL:-moonshotai/Kimi-Linear-48B-A3B-Instruct}
DRAFT=${DRAFT:?set DRAFT to a DSparkDraftModel checkpoint for Kimi-Linear-48B-A3B}
GAMMA=${GAMMA:-7}

# compact = per-request ragged verify windows picked by the draft's confidence head (the
# production DSPARK mode; needs enable_confidence_head in the draft and a full-attention backend
# that supports ragged verify graphs: fa3 and the plugin's KDA backend both do). Use "static"
# for a draft without a confidence head.
export SGLANG_RAGGED_VERIFY_MODE=${SGLANG_RAGGED_VERIFY_MODE:-compact}

args=(
  --model-path "$MODEL" --trust-remote-code
  --tp 1
  # The plugin: MLA layers on SGLang's fa3 (picked automatically on Hopper), KDA layers on the
  # plugin's Triton decode / MTP-verify / ReplaySSM kernels (SGLang's fast CuTe verify is
  # Blackwell-only; on H200 upstream falls back to its plain Triton varlen verify).
  --attention-backend dspark
  # DSPARK: gamma drafted tokens per block, verify window gamma+1. 7 is what DSPARK drafts are
  # trained with; at large batch (verify-bound) 3-4 can be faster: sweep it on your traffic.
  --speculative-algorithm DSPARK
  --speculative-draft-model-path "$DRAFT"
  --speculative-dspark-block-size "$GAMMA"
  # The draft is a Qwen3-style GQA stack with RoPE; fa3 is the Hopper backend for it (without
  # this flag it would inherit "dspark", which is no draft backend, and fall back to flashinfer).
  --speculative-draft-attention-backend fa3
  # ReplaySSM: verify writes ~1 KiB/head/token rings instead of (gamma+1) fp32 state snapshots
  # (64 KiB/head each); commit folds the accepted prefix into the state. Cuts verify state
  # traffic ~3x at gamma=7 and frees the snapshot memory (20 layers x 32 heads x 8 x 64 KiB =
  # 320 MiB per running request) for more concurrent requests.
  --enable-linear-replayssm-spec
  # Ring length: SGLang requires a power of two >= 2*(gamma+1): 16 for gamma=7 (32 for gamma 8-15).
  --linear-replayssm-cache-len 16
  # fp32 recurrent state: the fold replays the accepted tokens exactly; bf16 state would drift.
  # (ReplaySSM sets this when unset; explicit so nobody "optimises" it to bfloat16.)
  --mamba-ssm-dtype float32
  # One fp32 state slot = 20 KDA layers x 32 heads x 64 KiB = 40 MiB (+ conv windows). 384 slots
  # = ~15 GB, enough for --max-running-requests 128 (DSPARK keeps ~3 slots per request: the
  # request's own, radix-cache checkpoints and spec bookkeeping; SGLang logs the cap it derives).
  --max-mamba-cache-size 384
  --max-running-requests 128
  --mem-fraction-static 0.88
  --host 0.0.0.0 --port "${PORT:-30000}"
)
exec python -m sglang.launch_server "${args[@]}" "$@"
