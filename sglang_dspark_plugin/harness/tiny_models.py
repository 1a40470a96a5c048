"""Reproducible Kimi-Linear and Kimi-K3 test models + DSPARK drafts for demos, end-to-end tests
and serving benchmarks.

``python -m sglang_dspark_plugin.harness.tiny_models [--model NAME] [--out DIR]`` (``NAME``: a key
of ``SPECS``) writes, under ``DIR`` (default: the checkout's ``configs/``), one target/draft pair
built by the same code from a ``ModelSpec``:

* ``tiny`` (``tiny-kimi-linear/`` + ``tiny-dspark-draft/``): 2 layers (KDA, MLA), 2 KDA heads,
  hidden 256; the CPU demo and CPU end-to-end model (weights 4 MB + 1.7 MB).
* ``kimi32`` (``kimi-linear-32h/`` + ``kimi-linear-32h-draft/``): Kimi-Linear-48B-shaped attention
  at TP1: 4 layers KDA, KDA, KDA, MLA (Kimi-Linear's 3:1), 32 KDA heads x 128, hidden 2304, MLA
  with 32 heads and Kimi-Linear's dims (kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, NoPE),
  a dense SwiGLU MLP of 9216 (the width of Kimi-Linear's 8 routed + 1 shared experts of 1024);
  the GPU end-to-end and serving-benchmark model (weights ~0.9 GB, generated where it runs).
* ``kimi48-8l`` (``kimi-linear-48b-8l/`` + ``-draft/``): configs only, for throughput: the first 8
  layers of Kimi-Linear-48B-A3B with its MoE and vocabulary, served with SGLang's random weights
  (``--load-format dummy``, token ids in and out), so that a served step is GPU-bound as in the
  real model (kimi32's 4 small layers leave the server host-bound; docs/guide/gpu-serving.md).
* ``kimi48`` (``kimi-linear-48b/`` + ``-draft/``): configs only, the same for all 27 layers of
  Kimi-Linear-48B-A3B (20 KDA, 7 MLA); one server per H200.
* ``tiny-k3`` (``tiny-kimi-k3/`` + ``-draft/``): Kimi-K3's text stack on CPU: KDA, MLA, 12 KDA
  heads, hidden 1024 (weights 34 MB + 10 MB); the CPU end-to-end K3 model (tests/e2e/test_k3_e2e.py).
* ``k3-12h`` (``kimi-k3-12h/`` + ``-draft/``): one TP8 rank of Kimi-K3 at TP1 (12 KDA and 12 MLA
  heads, hidden 7168, K3's MLA dims), its first 4 layers with a dense MLP; the K3 GPU end-to-end
  model (weights ~1.5 GB, generated where it runs). ``k3-24h``: the same with 24 + 24 heads, for
  TP2 (12 per rank).
* ``k3-8l`` (``kimi-k3-8l/`` + ``-draft/``): configs only, for throughput: K3's first 8 layers with
  its LatentMoE (32 of its 896 experts) and vocabulary, one TP8 rank's attention, random weights.

The tiny, kimi32 and K3 pairs share one byte-level BPE tokenizer (vocab 512) and chat template.
Only missing files are written, and every run writes the same bytes: weights come from a seeded
``torch.Generator`` on the CPU, the draft's Markov table is derived from the target in float64 (so
BLAS threading cannot flip an argmax), and safetensors files are written with sorted keys. Weights
are git-ignored; the configs and tokenizer files are committed.

Kimi-K3 (``family=KIMI_K3``). The config is the text-only form: architectures
``KimiK3LinearForCausalLM``, model_type ``kimi_linear``, K3's keys (``linear_attn_config``:
``use_full_rank_gate``, ``gate_lower_bound`` -5; ``mla_use_output_gate``, ``q_lora_rank``, SiTU
``hidden_act`` with K3's betas 4 / 25, ``attn_res_block_size``; LatentMoE keys on k3-8l). It
serves on CPU (``cpu_support``'s K3 gates 9-11) with nothing but a tokenizer. The multimodal
wrapper (model_type ``kimi_k3``, ``KimiK3ForConditionalGeneration``) always builds K3's vision
tower, and SGLang's K3 multimodal processor needs the checkpoint's own processor: with a plain
tokenizer the server stops at startup ("no attribute media_processor"), and
``--language-model-only`` does not take that architecture (tried on CPU). What the text-only form
costs: SGLang 0.5.23 keys some K3 serving defaults on the wrapper's architecture name: the
extra_buffer Mamba radix cache (refused for the text stack: the GPU K3 e2e serves without a radix
cache), K3's verify-backend pin (``harness.serving.tiny_model_args`` passes the Triton verify
backend instead, what the pin means below SM100) and the SM100 trtllm_mla override.
Every K3 model has 12 KDA heads per rank: SGLang's ``KimiK3DeltaAttention`` offers its output
gate to the attention backend (``_k3_onorm_gate``) only when ``_prepare_fused_decode`` accepts
the layer, i.e. exactly 12 heads of 128 per rank. The generated K3 weights follow the float64
``ReferenceTarget`` (the K3 forward below); the MLP is dense SiTU there: LatentMoE's top-k
routing is discontinuous, so a legitimate bf16 difference between two KDA implementations could
flip an expert choice and change tokens far from any logit near-tie, and the lossless comparison
would no longer be a test (k3-8l, random weights, has K3's LatentMoE for tokens/s).

What SGLang 0.5.23 turns on for the K3 models (read from ``models/kimi_k3.py``,
``layers/attn_residual.py``, ``kernels/ops/...``), and where:

* ``fused_qkvg_proj`` (one [q|k|v|g] GEMM) and the [f_a | b] merged GEMM with the f_b GEMV
  (``_merge_bfa_weights``, K3's ``kimi_k3_tiny_gemm``): every K3 model. On a GPU the tiny GEMM is
  a CUDA JIT kernel for K3's shapes (the (144, 7168) [f_a|b] and (1536, 128) f_b of 12 heads at
  hidden 7168: k3-12h, k3-24h at TP2, k3-8l; f_b only on tiny-k3); Hopper is supported. On CPU
  torch (cpu_support gate 10).
* Side CUDA streams (the [f_a|b]/f_b GEMVs of KDA, the MLA output-gate GEMM; under CUDA-graph
  capture, up to 64 tokens on Hopper): GPU only (gate 9 turns them off on CPU).
* The output-gate stash and SGLang's fused K3 decode (``_k3_fused_decode_args``,
  ``kda_fused_decode``: conv, recurrence and gated RMSNorm in one CUDA JIT kernel with TMA bulk
  copies, sm_90+): the stash at 12 heads per rank on every K3 model; stock SGLang's plain decode
  runs the fused kernel on the GPU rig (without ReplaySSM rings), not on CPU (gate 11). The plugin
  takes decode and verify itself and consumes the stash (unless its output-gate setting says 0).
* Attention residuals (``attn_res_block_size``): every K3 model; SGLang's TMA aggregation kernel
  needs SM100+, so the rig and CPU run its Triton score/combine pipeline (which reads rows in
  blocks of 1024: hidden must be a multiple of 1024). The float64 reference follows it exactly.
* MLA output gate (CUDA JIT ``mla_output_gate``; torch on CPU), SiTU (CUDA JIT ``situ_and_mul``;
  torch on CPU): every K3 model.
* LatentMoE (k3-8l): the merged MoE front (shared gate_up | router | latent down-projection in one
  GEMM, CUDA only), Triton fused MoE with SiTU for bf16 experts, the latent RMSNorm.
* Not on the GPU rig (H100/H200, sm_90) or not for these models: SGLang's CuTe DSPARK verify
  (``fused_kda_decode_mtp_dspark``, SM100 only, and only with the ``nv_cutedsl`` verify backend
  that K3's spec hook pins for the wrapper architecture), trtllm_mla with decode-mode verify
  (SM100, wrapper only), the attention-residual TMA kernel (SM100+), K3's fused all-reduce
  (``k3_ar_fusion``: SM100/103, TP > 1, NVLink multicast) and the attention all-reduce fusion
  built on it, the MoE's fused all-reduce + latent norm and gemm+all-gather tail (the same
  fusion, TP8), MegaMoE / MXFP4 expert runners (the test experts are bf16).

How the weights are chosen (see docs/guide/cpu-testing.md for the measurements):

* **Target.** Random Gaussian weights, scaled so the residual stream keeps a strong token-to-token
  ("bigram") path (embedding -> final norm -> lm_head) while the KDA and MLA layers add enough
  context that different prompts give different continuations (SGLang's ``--load-format dummy``
  weights give a degenerate 2-token cycle instead). Special tokens get all-zero lm_head rows, so
  greedy decoding never emits EOS and every request produces exactly ``max_tokens`` tokens.
* **Draft.** DSPARK drafts token ``i`` of a block as ``argmax(base_logits[i] + markov_bias(prev))``
  where ``prev`` is the anchor (the last verified token) for ``i = 0`` and the previous draft token
  after that. We make the base logits exactly zero (the draft's final RMSNorm weight is zero, so
  its hidden state and hence ``hidden @ lm_head.T`` vanish) and make the vanilla Markov head encode
  the *target's own* next-token function for a one-token context,
  ``f(t) = argmax target_logits([t])``, computed from the target weights with the reference forward
  below: ``markov_w2[j] = c * u_j`` and ``markov_w1[t] = c * u_{f(t)}`` for random unit vectors
  ``u_j`` in R^rank, so ``markov_bias(t)[j] = c^2 <u_{f(t)}, u_j>`` peaks exactly at ``f(t)``.
  The draft therefore proposes the chain ``f(anchor), f(f(anchor)), ...``; whenever the target's
  continuation agrees with its own one-token prediction the drafts are accepted. Nothing about the
  test prompts is baked in. The confidence head (used by the non-static ragged-verify modes) has
  zero weights and a positive bias: a constant survival probability of sigmoid(2) = 0.88.

``ReferenceTarget`` is a plain float64 PyTorch forward of a target, written from the model
definition (KDA recurrence, MLA attention, SwiGLU MLP; K3: the lower-bound forget gate, full-rank
output gate, MLA query LoRA and output gate, SiTU, attention residuals), batched and incremental:
it derives the draft, and the tests use it to check that SGLang loads these weights as intended
and to choose prompts without near-ties.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from .. import settings
from ..settings import CONV_WIDTH as CONV_K, HEAD_DIM

WEIGHTS_FILE = "model.safetensors"
SEED = 20261130

VOCAB_SIZE = 512
KV_LORA_RANK = 512
QK_NOPE = 128
QK_ROPE = 64
V_HEAD = 128
MARKOV_RANK = 64
DEFAULT_BLOCK_SIZE = 3  # gamma; --speculative-dspark-block-size overrides it

# Model families: Kimi-Linear (KimiLinearForCausalLM) and Kimi-K3's text stack
# (KimiK3LinearForCausalLM); see the module docstring for what the K3 family adds.
KIMI_LINEAR = "kimi_linear"
KIMI_K3 = "kimi_k3"
# Kimi-K3's constants (its published text_config)
K3_GATE_LOWER_BOUND = -5.0  # linear_attn_config.gate_lower_bound: g = lb * sigmoid(exp(A_log) (f + dt_bias))
K3_SITU_BETA = 4.0  # activation_situ_beta
K3_SITU_LINEAR_BETA = 25.0  # activation_situ_linear_beta
K3_HIDDEN = 7168
K3_Q_LORA_RANK = 1536
K3_HEADS_PER_RANK = 12  # 96 KDA (and MLA) heads over TP8; SGLang's K3 fused paths need exactly 12

# Scale knobs of the target's random weights (see the module docstring).
EMBED_STD = 1.0  # token embeddings ~ N(0, EMBED_STD^2): the "bigram" path
KDA_OUT_GAIN = 0.3  # KDA o_proj gain relative to a unit-variance output
MLA_OUT_GAIN = 0.3  # MLA o_proj gain
MLP_OUT_GAIN = 0.2  # MLP down_proj gain
MLA_Q_GAIN = 3.0  # sharpens MLA attention (scores ~ N(0, MLA_Q_GAIN^2))
LOGIT_STD = 6.0  # lm_head gain: std of the logits of a unit-RMS final hidden state
MARKOV_GAIN = 4.0  # c above: Markov bias peak c^2 = 16 logits
CONFIDENCE_BIAS = 2.0
# Kimi-K3 models: norm weights 1 + N(0, 0.5^2) (a norm whose weight is dropped, e.g. in a fused
# output-norm epilogue, changes the tokens) and MLP gate pre-activations of std 4 (SiTU's beta:
# where SiTU saturates and stops being SiLU)
K3_NORM_WEIGHT_STD = 0.5
K3_MLP_GATE_GAIN = 4.0


@dataclass(frozen=True)
class MoESpec:
    """Kimi-Linear's mixture of experts (``num_experts`` routed, ``top_k`` per token, each a SwiGLU
    of width ``intermediate``, plus ``shared`` always-on experts) in every layer from
    ``first_dense_layers`` on; the first layers keep the dense MLP of ``ModelSpec.intermediate``."""

    experts: int
    top_k: int
    intermediate: int
    shared: int
    first_dense_layers: int
    routed_scaling_factor: float
    latent: Optional[int] = None  # Kimi-K3's LatentMoE: routed experts at this width (routed_expert_hidden_size)


@dataclass(frozen=True)
class ModelSpec:
    """Shape and seed of one target + draft pair (everything else is shared)."""

    name: str  # --model name of the CLI
    target_dir: str
    draft_dir: str
    seed: int
    layers: Tuple[str, ...]  # "kda" or "mla", per layer
    hidden: int
    intermediate: int  # dense SwiGLU MLP width (every layer)
    kda_heads: int
    mla_heads: int
    kda_decay: Tuple[float, float]  # exp(A_log) per KDA head, geometric from [0] to [1]
    max_positions: int
    draft_heads: int
    draft_kv_heads: int
    draft_intermediate: int
    draft_target_layers: Tuple[int, ...]  # target layers whose hidden states the draft reads
    kda_out_gain: float = KDA_OUT_GAIN
    mla_out_gain: float = MLA_OUT_GAIN
    mlp_out_gain: float = MLP_OUT_GAIN
    vocab: int = VOCAB_SIZE
    moe: Optional[MoESpec] = None  # None: the dense MLP in every layer
    # True: no weights are generated (configs only); served with SGLang's random weights
    # (``--load-format dummy``) for throughput, never for output checks
    random_weights: bool = False
    family: str = KIMI_LINEAR  # KIMI_LINEAR or KIMI_K3 (checkpoint names, config keys, reference forward)
    # Kimi-K3 only:
    q_lora_rank: Optional[int] = None  # MLA query down-projection rank (None: one q_proj)
    attn_res_block: Optional[int] = None  # attention residuals: attn_res_block_size (None: plain residual)

    @property
    def k3(self) -> bool:
        return self.family == KIMI_K3


TINY = ModelSpec(
    name="tiny",
    target_dir="tiny-kimi-linear",
    draft_dir="tiny-dspark-draft",
    seed=SEED,
    layers=("kda", "mla"),
    hidden=256,
    intermediate=512,
    kda_heads=2,
    mla_heads=2,
    kda_decay=(0.5, 1.0),  # log-decay about -0.35 / -0.7 per token
    max_positions=512,
    draft_heads=2,
    draft_kv_heads=2,
    draft_intermediate=512,
    draft_target_layers=(0, 1),
)

# Kimi-Linear-48B-A3B's attention at TP1 (32 KDA heads x 128, hidden 2304, MLA 32 heads with its
# latent dims), KDA:MLA 3:1, in 4 layers. Slower-decaying heads than the tiny model (down to 0.05,
# a memory of ~25 tokens) so a wrong committed state shows up many tokens later.
KIMI32 = ModelSpec(
    name="kimi32",
    target_dir="kimi-linear-32h",
    draft_dir="kimi-linear-32h-draft",
    seed=SEED + 32,
    layers=("kda", "kda", "kda", "mla"),
    hidden=2304,
    intermediate=9216,
    kda_heads=32,
    mla_heads=32,
    kda_decay=(0.05, 1.0),
    max_positions=4096,
    draft_heads=16,
    draft_kv_heads=4,
    draft_intermediate=4608,
    draft_target_layers=(1, 3),
)

# Kimi-Linear-48B-A3B at TP1, its first 8 of 27 layers (KDA x3, MLA, KDA x3, MLA), with its MoE
# (256 experts top-8 of 1024 + 1 shared; layer 0 dense 9216) and vocabulary (163840): a serving
# benchmark model whose step is GPU-bound like the real model's (~28 GB of bf16 weights), served
# with random weights, so only for tokens/s (accept lengths there say nothing).
KIMI48_8L = replace(
    KIMI32,
    name="kimi48-8l",
    target_dir="kimi-linear-48b-8l",
    draft_dir="kimi-linear-48b-8l-draft",
    seed=SEED + 48,
    layers=("kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla"),
    draft_target_layers=(1, 3, 5, 7),
    vocab=163840,
    moe=MoESpec(experts=256, top_k=8, intermediate=1024, shared=1, first_dense_layers=1, routed_scaling_factor=2.446),
    random_weights=True,
)

# Kimi-Linear-48B-A3B at TP1, all 27 layers: MLA at layers 4, 8, 12, 16, 20, 24 and 27 (1-based, as
# its config's full_attn_layers), KDA at the other 20; MoE as above (~97 GB of bf16 weights, one
# server per H200). The served model whose step is GPU-bound at serving concurrency, where kimi48-8l
# still left the host the limit (docs/guide/gpu-serving.md); random weights, tokens/s only.
KIMI48 = replace(
    KIMI48_8L,
    name="kimi48",
    target_dir="kimi-linear-48b",
    draft_dir="kimi-linear-48b-draft",
    seed=SEED + 49,
    layers=tuple("mla" if layer in (3, 7, 11, 15, 19, 23, 26) else "kda" for layer in range(27)),
    draft_target_layers=(1, 9, 17, 25),
)

# Kimi-K3's text stack (KimiK3LinearForCausalLM) at CPU size: KDA, MLA with K3's layer types and
# gates (full-rank KDA output gate, lower-bound forget gate, MLA output gate, query LoRA, SiTU MLP,
# attention residuals) and 12 KDA heads, one TP8 rank of K3's 96: SGLang hands the KDA output gate
# to the attention backend only at 12 heads per rank. Hidden 1024: SGLang's attention-residual
# kernel reads rows in blocks of 1024. Block size 1 (K3: 12): both layers write the bank, so the
# final read mixes three rows. Dense SiTU MLP (no MoE, see the module docstring).
TINY_K3 = ModelSpec(
    name="tiny-k3",
    target_dir="tiny-kimi-k3",
    draft_dir="tiny-kimi-k3-draft",
    seed=SEED + 3,
    layers=("kda", "mla"),
    hidden=1024,
    intermediate=1024,
    kda_heads=K3_HEADS_PER_RANK,
    mla_heads=2,
    kda_decay=(0.02, 1.0),  # K3: per-token log-decay |g| at f = 0, geometric over the heads
    max_positions=512,
    draft_heads=2,
    draft_kv_heads=2,
    draft_intermediate=512,
    draft_target_layers=(0, 1),
    family=KIMI_K3,
    q_lora_rank=128,
    attn_res_block=1,
)

# One TP8 rank of Kimi-K3 at TP1: 12 KDA heads and 12 MLA heads, K3's hidden (7168) and MLA dims
# (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, NoPE), K3's first 4 layers
# (KDA x3, MLA), attention residuals with a block of 2 (K3: 12, i.e. one block in 4 layers), and a
# dense SiTU MLP of 6144 (the width of K3's two shared experts, 2 x 3072) in place of its
# LatentMoE. The K3 GPU end-to-end model (lossless against stock SGLang, float64 reference;
# weights ~1.5 GB, generated where it runs).
K3_12H = ModelSpec(
    name="k3-12h",
    target_dir="kimi-k3-12h",
    draft_dir="kimi-k3-12h-draft",
    seed=SEED + 312,
    layers=("kda", "kda", "kda", "mla"),
    hidden=K3_HIDDEN,
    intermediate=6144,
    kda_heads=K3_HEADS_PER_RANK,
    mla_heads=K3_HEADS_PER_RANK,
    kda_decay=(0.02, 1.0),
    max_positions=4096,
    draft_heads=16,
    draft_kv_heads=4,
    draft_intermediate=4608,
    draft_target_layers=(1, 3),
    family=KIMI_K3,
    q_lora_rank=K3_Q_LORA_RANK,
    attn_res_block=2,
)

# k3-12h with 24 KDA and MLA heads: served at --tp-size 2, each rank has K3's 12 (at TP2 the 12-head
# model has 6 per rank, where SGLang neither offers the output gate nor runs its fused decode).
K3_24H = replace(
    K3_12H,
    name="k3-24h",
    target_dir="kimi-k3-24h",
    draft_dir="kimi-k3-24h-draft",
    seed=SEED + 324,
    kda_heads=2 * K3_HEADS_PER_RANK,
    mla_heads=2 * K3_HEADS_PER_RANK,
)

# Kimi-K3's first 8 layers (KDA x3, MLA, KDA x3, MLA) at one TP8 rank's attention (12 KDA heads, 12
# MLA heads), its hidden, vocabulary, dense layer 0 (33792) and LatentMoE (top-16 of width 3072 at
# the 3584 latent, latent RMSNorm, 2 shared experts, SiTU) with 32 experts instead of 896, and
# attention residuals of block 12: K3's per-layer mix for tokens/s, configs only, served with
# SGLang's random weights (~24 GB bf16). 32 bf16 experts (2.1 GB per MoE layer) are about one TP8
# rank's share of K3's 896 MXFP4 experts (1.85 GB per layer).
K3_8L = replace(
    K3_12H,
    name="k3-8l",
    target_dir="kimi-k3-8l",
    draft_dir="kimi-k3-8l-draft",
    seed=SEED + 38,
    layers=("kda", "kda", "kda", "mla", "kda", "kda", "kda", "mla"),
    intermediate=33792,
    draft_target_layers=(1, 3, 5, 7),
    vocab=163840,
    moe=MoESpec(experts=32, top_k=16, intermediate=3072, shared=2, first_dense_layers=1,
                routed_scaling_factor=1.0, latent=3584),  # fmt: skip
    attn_res_block=12,
    random_weights=True,
)

SPECS = {spec.name: spec for spec in (TINY, KIMI32, KIMI48_8L, KIMI48, TINY_K3, K3_12H, K3_24H, K3_8L)}

# The tiny pair's directories (the demo, the examples and the CPU tests use them by these names).
TARGET_DIR = TINY.target_dir
DRAFT_DIR = TINY.draft_dir

# Special tokens (ids 0..6). bos/eos/pad follow the reference config; <mask> is the DSPARK mask
# token (mask_token_id); the role markers delimit chat turns.
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<mask>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS_ID, EOS_ID, PAD_ID, MASK_ID = 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# Fixed tokenizer training corpus (also the vocabulary the demo and the tests use).
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you today?",
    "Once upon a time there was a little model that wanted to talk.",
    "Speculative decoding drafts a few tokens and the target verifies them at once.",
    "A small draft proposes, a large target disposes.",
    "Kimi Delta Attention keeps a fixed-size state per head instead of a growing cache.",
    "Multi-head latent attention compresses keys and values into a shared latent vector.",
    "The server answers requests through an OpenAI compatible API.",
    "Write a short poem about the sea, the sky and the stars.",
    "What is the capital of France? Paris is the capital of France.",
    "Count with me: 1 2 3 4 5 6 7 8 9 10 11 12.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "The cat sat on the mat and the dog sat on the log.",
    "Tell me a story about a robot who learned to paint.",
    "Please summarize the following text in one sentence.",
    "Rain falls on the green hills while the river runs to the sea.",
    "Numbers like 42, 3.14 and 2026 appear in many sentences.",
    "Good morning, good afternoon, good evening and good night.",
    "The plugin adds an attention backend to the inference server.",
    "Tokens per second, latency and throughput are the numbers we measure.",
    "She sells sea shells by the sea shore.",
    "An apple a day keeps the doctor away.",
    "To be or not to be, that is the question.",
    "All models are wrong, but some are useful.",
    "Why is the sky blue? Because of the scattering of light.",
    "List three colors: red, green, blue.",
    "The answer is yes. The answer is no. The answer is maybe.",
    "system user assistant: you are a helpful assistant.",
    "Explain attention in simple words for a child.",
]


# ----------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------


def target_config(spec: ModelSpec = TINY) -> dict:
    """config.json of a target (SGLang parses it with transformers' strict ``KimiLinearConfig``
    first, hence the expert fields even for a dense model: all layers stay dense because
    ``first_k_dense_replace == num_hidden_layers``)."""
    num_layers = len(spec.layers)
    moe = spec.moe or MoESpec(experts=4, top_k=2, intermediate=64, shared=1, first_dense_layers=num_layers,
                              routed_scaling_factor=1.0)  # fmt: skip
    config = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": spec.mla_heads,
        "num_key_value_heads": spec.mla_heads,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": spec.max_positions,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "q_lora_rank": None,
        "kv_lora_rank": KV_LORA_RANK,
        "qk_nope_head_dim": QK_NOPE,
        "qk_rope_head_dim": QK_ROPE,
        "v_head_dim": V_HEAD,
        "mla_use_nope": True,
        "num_experts": moe.experts,
        "num_experts_per_token": moe.top_k,
        "moe_intermediate_size": moe.intermediate,
        "num_shared_experts": moe.shared,
        "first_k_dense_replace": moe.first_dense_layers,
        "moe_layer_freq": 1,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i, kind in enumerate(spec.layers) if kind == "kda"],
            "full_attn_layers": [i + 1 for i, kind in enumerate(spec.layers) if kind == "mla"],
            "num_heads": spec.kda_heads,
            "head_dim": HEAD_DIM,
            "short_conv_kernel_size": CONV_K,
        },
        "num_nextn_predict_layers": 0,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": moe.routed_scaling_factor,
    }
    if spec.k3:
        _k3_config(config, spec, moe)
    return config


def _k3_config(config: dict, spec: ModelSpec, moe: MoESpec) -> None:
    """Kimi-K3's text-stack keys on top of the Kimi-Linear ones (its published text_config):
    SGLang builds ``KimiK3LinearForCausalLM`` (the text-only form; the multimodal
    ``KimiK3ForConditionalGeneration`` adds a vision tower and an image processor, nothing the KDA
    layers see)."""
    config["architectures"] = ["KimiK3LinearForCausalLM"]
    config.update(
        hidden_act="situ",
        activation_situ_beta=K3_SITU_BETA,
        activation_situ_linear_beta=K3_SITU_LINEAR_BETA,
        q_lora_rank=spec.q_lora_rank,
        mla_use_output_gate=True,
        attn_res_block_size=spec.attn_res_block,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        topk_method="noaux_tc",
        use_grouped_topk=True,
    )
    if moe.latent is not None:
        config.update(routed_expert_hidden_size=moe.latent, latent_moe_use_norm=True)
    config["linear_attn_config"].update(gate_lower_bound=K3_GATE_LOWER_BOUND, use_full_rank_gate=True)


def draft_config(spec: ModelSpec = TINY) -> dict:
    """config.json of a DSPARK draft (fields: SGLang's ``models/dspark.py``)."""
    num_target_layers = len(spec.layers)
    return {
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,  # must equal the target's: the draft reuses its embed/lm_head
        "intermediate_size": spec.draft_intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": spec.draft_heads,
        "num_key_value_heads": spec.draft_kv_heads,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": spec.max_positions,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "num_target_layers": num_target_layers,
        "block_size": DEFAULT_BLOCK_SIZE,
        "markov_rank": MARKOV_RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "dflash_config": {
            "block_size": DEFAULT_BLOCK_SIZE,
            "target_layer_ids": list(spec.draft_target_layers),
            "mask_token_id": MASK_ID,
            "num_target_layers": num_target_layers,
        },
    }


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def build_tokenizer(model_max_length: int = TINY.max_positions):
    """A byte-level BPE trained on ``CORPUS`` (deterministic), wrapped for ``save_pretrained``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        mask_token="<mask>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _write_tokenizer(model_dir: Path, tokenizer=None) -> None:
    tokenizer = tokenizer or build_tokenizer()
    tokenizer.save_pretrained(str(model_dir))


def _has_tokenizer(model_dir: Path) -> bool:
    return (model_dir / "tokenizer.json").is_file() and (
        model_dir / "tokenizer_config.json"
    ).is_file()


# ----------------------------------------------------------------------------------------------
# Target weights
# ----------------------------------------------------------------------------------------------


def _randn(gen, *shape, std=1.0):
    import torch

    return torch.randn(*shape, generator=gen, dtype=torch.float32) * std


def _norm_weight(gen, n: int):
    """A K3 norm weight around 1 (not all ones: a norm whose weight is dropped changes the output)."""
    return 1.0 + _randn(gen, n, std=K3_NORM_WEIGHT_STD)


def _kda_weights(w, gen, p: str, spec: ModelSpec) -> None:
    """One KDA layer under prefix ``p`` (checkpoint names SGLang's loader maps). Kimi-Linear: low-rank
    output gate ``g_a``/``g_b``, forget gate ``-exp(A_log) softplus(f + dt_bias)``; Kimi-K3:
    full-rank output gate ``g_proj``, forget gate ``lb sigmoid(exp(A_log) (f + dt_bias))``."""
    import torch

    bf16, hidden, heads = torch.bfloat16, spec.hidden, spec.kda_heads
    proj = heads * HEAD_DIM
    for name in ("q_proj", "k_proj", "v_proj"):
        w[p + name + ".weight"] = _randn(gen, proj, hidden, std=hidden**-0.5).to(bf16)
    w[p + "b_proj.weight"] = _randn(gen, heads, hidden, std=hidden**-0.5).to(bf16)
    w[p + "f_a_proj.weight"] = _randn(gen, HEAD_DIM, hidden, std=hidden**-0.5).to(bf16)
    w[p + "f_b_proj.weight"] = _randn(gen, proj, HEAD_DIM, std=HEAD_DIM**-0.5).to(bf16)
    if spec.k3:
        w[p + "g_proj.weight"] = _randn(gen, proj, hidden, std=hidden**-0.5).to(bf16)
    else:
        w[p + "g_a_proj.weight"] = _randn(gen, HEAD_DIM, hidden, std=hidden**-0.5).to(bf16)
        w[p + "g_b_proj.weight"] = _randn(gen, proj, HEAD_DIM, std=HEAD_DIM**-0.5).to(bf16)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = _randn(gen, proj, 1, CONV_K, std=0.4)
        conv[:, :, -1] += 1.0  # the current token dominates, earlier taps mix in context
        w[p + name + ".weight"] = conv  # fp32, like SGLang's conv parameter
    lo, hi = spec.kda_decay
    log_decay = torch.linspace(torch.tensor(lo).log().item(), torch.tensor(hi).log().item(), heads)
    if spec.k3:
        # exp(A_log) from 0.5 to 2 over the heads; dt_bias centred per head so that the log-decay at
        # f = 0 is -exp(log_decay[h]) (|g| = -lb sigmoid(exp(A_log) dt)), then spread per channel.
        a_log = torch.linspace(-0.7, 0.7, heads)
        centre = torch.logit(log_decay.exp() / -K3_GATE_LOWER_BOUND) / a_log.exp()
        w[p + "dt_bias"] = (centre.repeat_interleave(HEAD_DIM) + _randn(gen, proj, std=0.3)).float()
        w[p + "A_log"] = a_log.float()  # K3's 1-D layout (Kimi-Linear: [1, 1, H, 1])
        w[p + "o_norm.weight"] = _norm_weight(gen, HEAD_DIM).to(bf16)
    else:
        w[p + "dt_bias"] = _randn(gen, proj, std=0.5)  # fp32
        # Per-head decay rate exp(A_log), geometric over the heads (tiny: 0.5 and 1.0).
        w[p + "A_log"] = log_decay.to(torch.float32).view(1, 1, heads, 1)
        w[p + "o_norm.weight"] = torch.ones(HEAD_DIM).to(bf16)
    w[p + "o_proj.weight"] = _randn(gen, hidden, proj, std=spec.kda_out_gain * proj**-0.5).to(bf16)


def _mla_weights(w, gen, p: str, spec: ModelSpec) -> None:
    """One MLA layer (NoPE) under prefix ``p``; K3: query LoRA (``q_a_proj``, ``q_a_layernorm``,
    ``q_b_proj``) when ``spec.q_lora_rank`` and the output gate ``g_proj``."""
    import torch

    bf16, hidden, heads = torch.bfloat16, spec.hidden, spec.mla_heads
    qk_head = QK_NOPE + QK_ROPE
    if spec.q_lora_rank:
        rank = spec.q_lora_rank
        w[p + "q_a_proj.weight"] = _randn(gen, rank, hidden, std=hidden**-0.5).to(bf16)
        w[p + "q_a_layernorm.weight"] = _norm_weight(gen, rank).to(bf16)
        w[p + "q_b_proj.weight"] = _randn(gen, heads * qk_head, rank, std=MLA_Q_GAIN * rank**-0.5).to(bf16)
    else:
        w[p + "q_proj.weight"] = _randn(gen, heads * qk_head, hidden, std=MLA_Q_GAIN * hidden**-0.5).to(bf16)
    w[p + "kv_a_proj_with_mqa.weight"] = _randn(gen, KV_LORA_RANK + QK_ROPE, hidden, std=hidden**-0.5).to(bf16)
    w[p + "kv_a_layernorm.weight"] = torch.ones(KV_LORA_RANK).to(bf16)
    w[p + "kv_b_proj.weight"] = _randn(
        gen, heads * (QK_NOPE + V_HEAD), KV_LORA_RANK, std=KV_LORA_RANK**-0.5
    ).to(bf16)
    w[p + "o_proj.weight"] = _randn(
        gen, hidden, heads * V_HEAD, std=spec.mla_out_gain * (heads * V_HEAD) ** -0.5
    ).to(bf16)
    if spec.k3:
        w[p + "g_proj.weight"] = _randn(gen, heads * V_HEAD, hidden, std=hidden**-0.5).to(bf16)


def _attn_res_weights(w, gen, p: str, spec: ModelSpec) -> None:
    """The score norm and projection (hidden -> 1) of one K3 attention-residual read (``p``:
    ``self_attention_res_``, ``mlp_res_`` or the model's ``output_attn_res_``): scores of about unit
    spread, so that the reads mix the bank's rows rather than pick one."""
    import torch

    w[p + "norm.weight"] = _norm_weight(gen, spec.hidden).to(torch.bfloat16)
    w[p + "proj.weight"] = _randn(gen, 1, spec.hidden, std=spec.hidden**-0.5).to(torch.bfloat16)


def make_target_weights(spec: ModelSpec = TINY) -> Dict[str, "torch.Tensor"]:
    """Seeded random target weights under the checkpoint names SGLang's ``KimiLinearForCausalLM``
    (``KimiK3LinearForCausalLM`` for the K3 family) loads (HF layout: separate q/k/v/b/f_a/f_b and
    output-gate projections and q/k/v_conv1d, which SGLang fuses while loading). Draw order:
    embeddings, every layer's attention, every layer's MLP (K3: and attention-residual reads), the
    final norm, K3's output read, lm_head."""
    import torch

    if spec.random_weights or spec.moe or spec.vocab != VOCAB_SIZE:
        raise ValueError(f"{spec.name}: the generator writes dense models of vocab {VOCAB_SIZE} only")

    gen = torch.Generator().manual_seed(spec.seed)
    bf16, hidden, inter = torch.bfloat16, spec.hidden, spec.intermediate
    w: Dict[str, torch.Tensor] = {}

    w["model.embed_tokens.weight"] = _randn(gen, VOCAB_SIZE, hidden, std=EMBED_STD).to(bf16)
    for layer, kind in enumerate(spec.layers):
        make = _kda_weights if kind == "kda" else _mla_weights
        make(w, gen, f"model.layers.{layer}.self_attn.", spec)
    for layer in range(len(spec.layers)):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden).to(bf16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden).to(bf16)
        gate_gain = K3_MLP_GATE_GAIN if spec.k3 else 1.0
        w[p + "mlp.gate_proj.weight"] = _randn(gen, inter, hidden, std=gate_gain * hidden**-0.5).to(bf16)
        w[p + "mlp.up_proj.weight"] = _randn(gen, inter, hidden, std=hidden**-0.5).to(bf16)
        w[p + "mlp.down_proj.weight"] = _randn(
            gen, hidden, inter, std=spec.mlp_out_gain * inter**-0.5
        ).to(bf16)
        if spec.attn_res_block:
            _attn_res_weights(w, gen, p + "self_attention_res_", spec)
            _attn_res_weights(w, gen, p + "mlp_res_", spec)

    w["model.norm.weight"] = torch.ones(hidden).to(bf16)
    if spec.attn_res_block:
        _attn_res_weights(w, gen, "model.output_attn_res_", spec)
    lm_head = _randn(gen, VOCAB_SIZE, hidden, std=LOGIT_STD * hidden**-0.5)
    # Tokens the model may emit: those that decode to printable ASCII. Special tokens (EOS
    # included) and bare byte fragments get all-zero rows: logit 0 never wins against hundreds of
    # N(0, LOGIT_STD^2) logits, so outputs are readable and never stop early.
    lm_head[~emittable_tokens()] = 0.0
    w["lm_head.weight"] = lm_head.to(bf16)
    return w


def emittable_tokens() -> "torch.Tensor":
    """Bool mask [VOCAB_SIZE]: tokens decoding to non-empty printable ASCII (no specials)."""
    import torch

    tok = build_tokenizer()
    mask = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    for i in range(len(SPECIAL_TOKENS), min(len(tok), VOCAB_SIZE)):
        text = tok.decode([i])
        mask[i] = bool(text) and all(32 <= ord(ch) < 127 for ch in text)
    return mask


# ----------------------------------------------------------------------------------------------
# Reference forward of a target (float64, plain PyTorch, batched and incremental)
# ----------------------------------------------------------------------------------------------


class ReferenceTarget:
    """Float64 forward of a target, from the model definition. Used to derive the draft's Markov
    table and, in tests, to cross-check what SGLang computes and to find prompts without
    near-ties.

    ``forward(ids, cache)`` takes ``ids [B, T]`` (equal lengths) and continues from ``cache`` (the
    per-layer state a previous call returned: KDA recurrent state ``[B, H, K, V]`` and the last
    ``CONV_K - 1`` pre-conv q/k/v rows; MLA keys and values), so greedy decoding costs one token
    per step. ``device`` may be a GPU: float64 there is exact enough and much faster."""

    def __init__(self, weights: Dict[str, "torch.Tensor"], spec: ModelSpec = TINY, eps: float = 1e-5, device=None):
        import torch

        self.spec = spec
        self.w = {k: v.to(device=device, dtype=torch.float64) for k, v in weights.items()}
        self.device = next(iter(self.w.values())).device
        self.eps = eps

    def _rms(self, x, weight):
        import torch

        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _linear(self, x, name):
        return x @ self.w[name].T

    def _kda(self, x, p: str, cache: dict):
        """x: [B, T, hidden] (already input-normed) -> [B, T, hidden]; updates ``cache``."""
        import torch
        import torch.nn.functional as F

        B, T, _ = x.shape
        H, K = self.spec.kda_heads, HEAD_DIM

        def conv_silu(y, name):  # causal depthwise conv over [cached tail, y], then SiLU
            weight = self.w[p + name + ".weight"][:, 0, :]  # [C, CONV_K]
            tail = cache.get(name)
            if tail is None:
                tail = y.new_zeros(B, CONV_K - 1, y.shape[-1])
            full = torch.cat([tail, y], 1)  # [B, CONV_K-1+T, C]
            cache[name] = full[:, -(CONV_K - 1) :]
            out = sum(full[:, j : j + T] * weight[:, j] for j in range(CONV_K))
            return F.silu(out)

        q = conv_silu(self._linear(x, p + "q_proj.weight"), "q_conv1d").view(B, T, H, K)
        k = conv_silu(self._linear(x, p + "k_proj.weight"), "k_conv1d").view(B, T, H, K)
        v = conv_silu(self._linear(x, p + "v_proj.weight"), "v_conv1d").view(B, T, H, K)
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        f = self._linear(self._linear(x, p + "f_a_proj.weight"), p + "f_b_proj.weight").view(B, T, H, K)
        A = torch.exp(self.w[p + "A_log"].view(H, 1))
        dt_bias = self.w[p + "dt_bias"].view(H, K)
        if self.spec.k3:  # lower-bound gate: log-decay in (lb, 0)
            g = K3_GATE_LOWER_BOUND * torch.sigmoid(A * (f + dt_bias))
        else:
            g = -A * F.softplus(f + dt_bias)
        beta = torch.sigmoid(self._linear(x, p + "b_proj.weight"))  # [B, T, H]
        scale = K**-0.5
        S = cache.get("S")
        if S is None:
            S = x.new_zeros(B, H, K, K)  # [key, value]
        outs = []
        for t in range(T):
            S = S * torch.exp(g[:, t]).unsqueeze(-1)
            kt, vt = k[:, t], v[:, t]
            u = (vt - torch.einsum("bhk,bhkv->bhv", kt, S)) * beta[:, t].unsqueeze(-1)
            S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
        cache["S"] = S
        o = torch.stack(outs, 1)  # [B, T, H, V]
        if self.spec.k3:  # full-rank output gate
            gate = self._linear(x, p + "g_proj.weight")
        else:
            gate = self._linear(self._linear(x, p + "g_a_proj.weight"), p + "g_b_proj.weight")
        o = self._rms(o, self.w[p + "o_norm.weight"]) * torch.sigmoid(gate.view(B, T, H, K))
        return self._linear(o.reshape(B, T, H * K), p + "o_proj.weight")

    def _mla(self, x, p: str, cache: dict):
        import torch

        B, T, _ = x.shape
        H = self.spec.mla_heads
        if self.spec.q_lora_rank:
            q_a = self._rms(self._linear(x, p + "q_a_proj.weight"), self.w[p + "q_a_layernorm.weight"])
            q = self._linear(q_a, p + "q_b_proj.weight").view(B, T, H, QK_NOPE + QK_ROPE)
        else:
            q = self._linear(x, p + "q_proj.weight").view(B, T, H, QK_NOPE + QK_ROPE)
        kv_a = self._linear(x, p + "kv_a_proj_with_mqa.weight")
        c, k_pe = kv_a[..., :KV_LORA_RANK], kv_a[..., KV_LORA_RANK:]
        c = self._rms(c, self.w[p + "kv_a_layernorm.weight"])
        kv = self._linear(c, p + "kv_b_proj.weight").view(B, T, H, QK_NOPE + V_HEAD)
        k_nope, v = kv[..., :QK_NOPE], kv[..., QK_NOPE:]
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, T, H, QK_ROPE)], -1)
        if "k" in cache:
            k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
        cache["k"], cache["v"] = k, v
        past = k.shape[1] - T
        scores = torch.einsum("bthd,bshd->bhts", q, k) * (QK_NOPE + QK_ROPE) ** -0.5
        # query t (absolute position past + t) sees keys 0 .. past + t
        mask = torch.ones(T, k.shape[1], dtype=torch.bool, device=x.device).triu(past + 1)
        scores = scores.masked_fill(mask, float("-inf"))
        o = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, H * V_HEAD)
        if self.spec.k3:  # output gate on the attention output, before o_proj
            o = o * torch.sigmoid(self._linear(x, p + "g_proj.weight"))
        return self._linear(o, p + "o_proj.weight")

    def _mlp(self, x, layer):
        import torch
        import torch.nn.functional as F

        p = f"model.layers.{layer}.mlp."
        gate, up = self._linear(x, p + "gate_proj.weight"), self._linear(x, p + "up_proj.weight")
        if self.spec.k3:  # SiTU: beta tanh(gate / beta) sigmoid(gate) * lb tanh(up / lb)
            act = K3_SITU_BETA * torch.tanh(gate / K3_SITU_BETA) * torch.sigmoid(gate)
            act = act * K3_SITU_LINEAR_BETA * torch.tanh(up / K3_SITU_LINEAR_BETA)
        else:
            act = F.silu(gate) * up
        return self._linear(act, p + "down_proj.weight")

    def _attn(self, x, layer: int, cache: dict):
        attn = self._kda if self.spec.layers[layer] == "kda" else self._mla
        return attn(x, f"model.layers.{layer}.self_attn.", cache)

    def _read(self, bank: list, head, p: str, norm: str):
        """K3's attention-residual read: the softmax mixture of the bank's rows and ``head`` (each
        row scored by ``<rms_norm(row, p.norm), p.proj>``, per token), then the RMSNorm ``norm``."""
        import torch

        if bank:
            rows = torch.stack(bank + [head], -2)  # [B, T, R, hidden]
            scores = self._rms(rows, self.w[p + "norm.weight"]) @ self.w[p + "proj.weight"][0]
            head = (scores.softmax(-1).unsqueeze(-1) * rows).sum(-2)
        return self._rms(head, self.w[norm])

    def forward(self, ids: "torch.Tensor", cache: Optional[List[dict]] = None):
        """ids [B, T] -> (logits [B, T, VOCAB] float64, cache to continue from)."""
        cache = cache if cache is not None else [{} for _ in self.spec.layers]
        h = self.w["model.embed_tokens.weight"][ids.to(self.device)]
        if self.spec.attn_res_block:
            return self._forward_attn_res(h, cache), cache
        for layer in range(len(self.spec.layers)):
            p = f"model.layers.{layer}."
            h = h + self._attn(self._rms(h, self.w[p + "input_layernorm.weight"]), layer, cache[layer])
            h = h + self._mlp(self._rms(h, self.w[p + "post_attention_layernorm.weight"]), layer)
        h = self._rms(h, self.w["model.norm.weight"])
        return h @ self.w["lm_head.weight"].T, cache

    def _forward_attn_res(self, h, cache: List[dict]):
        """Kimi-K3's attention residuals (SGLang's ``AttnResidual`` / ``AttnBankState``): every
        read (attention input, FFN input, the final norm's input) mixes the bank of per-token
        snapshots with the running head. Layer ``i`` with ``i % attn_res_block == 0`` snapshots its
        attention input's head into the bank and restarts the running residual empty."""
        bank, head = [], h
        for layer in range(len(self.spec.layers)):
            p = f"model.layers.{layer}."
            x = self._read(bank, head, p + "self_attention_res_", p + "input_layernorm.weight")
            residual = head
            if layer % self.spec.attn_res_block == 0:
                bank.append(head)
                residual = None
            a = self._attn(x, layer, cache[layer])
            head = a if residual is None else residual + a
            x = self._read(bank, head, p + "mlp_res_", p + "post_attention_layernorm.weight")
            head = head + self._mlp(x, layer)
        h = self._read(bank, head, "model.output_attn_res_", "model.norm.weight")
        return h @ self.w["lm_head.weight"].T

    def logits(self, ids: "torch.Tensor") -> "torch.Tensor":
        """ids [B, T] (same length) -> logits [B, T, VOCAB] in float64."""
        return self.forward(ids)[0]

    def greedy(self, prompt_ids, max_new_tokens: int):
        """Greedy continuation and the top-1 minus top-2 logit margin of every step.

        ``prompt_ids``: one prompt (a list of ids) -> (tokens, margins) as lists; or a
        ``[B, T]`` tensor of equal-length prompts -> (tokens, margins) as ``[B, max_new_tokens]``
        tensors."""
        import torch

        single = not isinstance(prompt_ids, torch.Tensor)
        ids = torch.tensor([list(prompt_ids)]) if single else prompt_ids
        logits, cache = self.forward(ids)
        tokens, margins = [], []
        for step in range(max_new_tokens):
            top = torch.topk(logits[:, -1], 2)
            tokens.append(top.indices[:, 0])
            margins.append(top.values[:, 0] - top.values[:, 1])
            if step + 1 < max_new_tokens:
                logits, cache = self.forward(tokens[-1].view(-1, 1), cache)
        tokens, margins = torch.stack(tokens, 1).cpu(), torch.stack(margins, 1).cpu()
        if single:
            return [int(t) for t in tokens[0]], [float(m) for m in margins[0]]
        return tokens, margins

    def one_token_successor(self) -> "torch.Tensor":
        """f(t) = argmax of the target's logits after the one-token context [t], for every t."""
        import torch

        ids = torch.arange(VOCAB_SIZE).view(-1, 1)
        return self.logits(ids)[:, 0].argmax(-1).cpu()


# ----------------------------------------------------------------------------------------------
# Draft weights
# ----------------------------------------------------------------------------------------------


def make_draft_weights(target_weights: Dict[str, "torch.Tensor"], spec: ModelSpec = TINY) -> Dict[str, "torch.Tensor"]:
    """Seeded draft weights (names as ``DSparkDraftModel.load_weights`` expects: backbone
    ``layers.*``, ``fc``, ``hidden_norm``, ``norm``; ``markov_head.*``; ``confidence_head.*``).
    The draft shares the target's ``embed_tokens``/``lm_head``, so it ships neither."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 1)
    bf16, hidden, inter = torch.bfloat16, spec.hidden, spec.draft_intermediate
    heads, kv_heads, hd = spec.draft_heads, spec.draft_kv_heads, HEAD_DIM
    n_ctx = len(spec.draft_target_layers)
    w: Dict[str, torch.Tensor] = {}

    # Backbone: ordinary random init. It runs for real (context KV injection, block attention),
    # but its output is multiplied by a zero final-norm weight, so base logits are exactly 0.
    p = "layers.0."
    w[p + "self_attn.q_proj.weight"] = _randn(gen, heads * hd, hidden, std=hidden**-0.5).to(bf16)
    w[p + "self_attn.k_proj.weight"] = _randn(gen, kv_heads * hd, hidden, std=hidden**-0.5).to(bf16)
    w[p + "self_attn.v_proj.weight"] = _randn(gen, kv_heads * hd, hidden, std=hidden**-0.5).to(bf16)
    w[p + "self_attn.o_proj.weight"] = _randn(gen, hidden, heads * hd, std=(heads * hd) ** -0.5).to(bf16)
    w[p + "self_attn.q_norm.weight"] = torch.ones(hd).to(bf16)
    w[p + "self_attn.k_norm.weight"] = torch.ones(hd).to(bf16)
    w[p + "input_layernorm.weight"] = torch.ones(hidden).to(bf16)
    w[p + "post_attention_layernorm.weight"] = torch.ones(hidden).to(bf16)
    w[p + "mlp.gate_proj.weight"] = _randn(gen, inter, hidden, std=hidden**-0.5).to(bf16)
    w[p + "mlp.up_proj.weight"] = _randn(gen, inter, hidden, std=hidden**-0.5).to(bf16)
    w[p + "mlp.down_proj.weight"] = _randn(gen, hidden, inter, std=inter**-0.5).to(bf16)
    w["fc.weight"] = _randn(gen, hidden, n_ctx * hidden, std=(n_ctx * hidden) ** -0.5).to(bf16)
    w["hidden_norm.weight"] = torch.ones(hidden).to(bf16)
    w["norm.weight"] = torch.zeros(hidden).to(bf16)  # base logits == 0: the Markov head decides

    # Markov head: bias(prev)[j] = MARKOV_GAIN^2 <u_f(prev), u_j>, maximal at j = f(prev).
    succ = ReferenceTarget(target_weights, spec).one_token_successor()
    u = _randn(gen, VOCAB_SIZE, MARKOV_RANK)
    u = u / u.norm(dim=-1, keepdim=True)
    w["markov_head.markov_w2.weight"] = (MARKOV_GAIN * u).to(bf16)
    w["markov_head.markov_w1.weight"] = (MARKOV_GAIN * u[succ]).to(bf16)

    # Confidence head (read only by the non-static ragged-verify modes): constant sigmoid(2).
    w["confidence_head.proj.weight"] = torch.zeros(1, hidden + MARKOV_RANK)
    w["confidence_head.proj.bias"] = torch.full((1,), CONFIDENCE_BIAS)
    return w


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def default_out_dir() -> Path:
    """The checkout's ``configs/`` when running from a source tree (an editable install), else a
    user cache dir, never site-packages (override with ``SGLANG_DSPARK_TINY_DIR``)."""
    override = settings.tiny_dir()
    if override:
        return Path(override)
    checkout = Path(__file__).resolve().parents[2]  # harness -> package -> checkout
    if (checkout / "pyproject.toml").is_file() and (checkout / "configs" / TARGET_DIR).is_dir():
        return checkout / "configs"
    return Path.home() / ".cache" / "sglang-dspark-plugin" / "configs"


def _save_safetensors(tensors: Dict[str, "torch.Tensor"], path: Path) -> None:
    from safetensors.torch import save_file

    ordered = {k: tensors[k].contiguous() for k in sorted(tensors)}
    tmp = path.with_suffix(".tmp")
    # One metadata key only: safetensors serialises metadata from a hash map, so several keys
    # would come out in a different order (different bytes) from run to run.
    save_file(ordered, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


SPS_TABLE_FILE = "sps_cost_table.json"


def sps_cost_table() -> dict:
    """A synthetic DSPARK SPS cost table (``--speculative-dspark-sps-table-path``): verify steps
    per second falling as ``tokens^-0.9``. With the draft's constant confidence 0.88 the compact
    scheduler then picks verify windows shorter than gamma+1 (real ragged layouts); without a
    table it verifies full windows. (A real table is profiled on the serving GPU.)"""
    tokens = list(range(1, 33))
    return {
        "sample_batch_tokens": tokens,
        "sample_steps_per_sec": [round(t**-0.9, 6) for t in tokens],
        "max_batch_tokens": tokens[-1],
    }


def _write_json_if_missing(path: Path, obj: dict) -> bool:
    if path.is_file():
        return False
    path.write_text(json.dumps(obj, indent=2) + "\n")
    return True


def ensure_models(
    spec: ModelSpec = TINY, out: Optional[os.PathLike] = None, *, log=print, weights: bool = True
) -> Dict[str, Path]:
    """Write whatever is missing of ``spec``'s target and draft under ``out`` (configs and
    tokenizers only with ``weights=False``); return their paths."""
    out = Path(out) if out is not None else default_out_dir()
    target_dir, draft_dir = out / spec.target_dir, out / spec.draft_dir
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)

    for path, obj in (
        (target_dir / "config.json", target_config(spec)),
        (draft_dir / "config.json", draft_config(spec)),
        (draft_dir / SPS_TABLE_FILE, sps_cost_table()),
    ):
        if _write_json_if_missing(path, obj):
            log(f"wrote {path}")
    tokenizer = None
    for model_dir in (target_dir, draft_dir):
        if not _has_tokenizer(model_dir) and not spec.random_weights:  # served with token ids only
            tokenizer = tokenizer or build_tokenizer(spec.max_positions)
            _write_tokenizer(model_dir, tokenizer)
            log(f"wrote tokenizer to {model_dir}")

    weights = weights and not spec.random_weights
    need_target = weights and not (target_dir / WEIGHTS_FILE).is_file()
    need_draft = weights and not (draft_dir / WEIGHTS_FILE).is_file()
    if need_target or need_draft:
        target_weights = make_target_weights(spec)
        if need_target:
            _save_safetensors(target_weights, target_dir / WEIGHTS_FILE)
            log(f"wrote {target_dir / WEIGHTS_FILE}")
        if need_draft:
            _save_safetensors(make_draft_weights(target_weights, spec), draft_dir / WEIGHTS_FILE)
            log(f"wrote {draft_dir / WEIGHTS_FILE}")
    return {"target": target_dir, "draft": draft_dir}


def ensure_tiny_models(out: Optional[os.PathLike] = None, *, log=print) -> Dict[str, Path]:
    """Write whatever is missing of the tiny pair under ``out``; return their paths."""
    return ensure_models(TINY, out, log=log)


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_dspark_plugin.harness.tiny_models",
        description="Write a Kimi-Linear / Kimi-K3 test target and its DSPARK draft (missing files only).",
    )
    parser.add_argument("--model", choices=sorted(SPECS), default=TINY.name, help="which pair (default: tiny)")
    parser.add_argument("--out", default=None, help=f"output dir (default: {default_out_dir()})")
    parser.add_argument(
        "--force", action="store_true", help="rewrite the weights even if they exist"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    spec = SPECS[args.model]
    out = Path(args.out) if args.out else default_out_dir()
    if args.force:
        for sub in (spec.target_dir, spec.draft_dir):
            (out / sub / WEIGHTS_FILE).unlink(missing_ok=True)
    paths = ensure_models(spec, out)
    print(f"target: {paths['target']}\ndraft:  {paths['draft']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
