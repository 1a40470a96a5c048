"""Reproducible Kimi-Linear test models + DSPARK drafts for demos, end-to-end tests and serving
benchmarks.

``python -m sglang_dspark_plugin.harness.tiny_models [--model tiny|kimi32|kimi48-8l|kimi48] [--out DIR]``
writes, under ``DIR`` (default: the checkout's ``configs/``), one target/draft pair built by the
same code from a ``ModelSpec``:

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

The tiny and kimi32 pairs share one byte-level BPE tokenizer (vocab 512) and chat template. Only missing files are
written, and every run writes the same bytes: weights come from a seeded ``torch.Generator`` on the
CPU, the draft's Markov table is derived from the target in float64 (so BLAS threading cannot flip
an argmax), and safetensors files are written with sorted keys. Weights are git-ignored; the tiny
pair's configs and tokenizer files are committed.

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
definition (KDA recurrence, MLA attention, SwiGLU MLP), batched and incremental: it derives the
draft, and the tests use it to check that SGLang loads these weights as intended and to choose
prompts without near-ties.
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

# Scale knobs of the target's random weights (see the module docstring).
EMBED_STD = 1.0  # token embeddings ~ N(0, EMBED_STD^2): the "bigram" path
KDA_OUT_GAIN = 0.3  # KDA o_proj gain relative to a unit-variance output
MLA_OUT_GAIN = 0.3  # MLA o_proj gain
MLP_OUT_GAIN = 0.2  # MLP down_proj gain
MLA_Q_GAIN = 3.0  # sharpens MLA attention (scores ~ N(0, MLA_Q_GAIN^2))
LOGIT_STD = 6.0  # lm_head gain: std of the logits of a unit-RMS final hidden state
MARKOV_GAIN = 4.0  # c above: Markov bias peak c^2 = 16 logits
CONFIDENCE_BIAS = 2.0


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

SPECS = {spec.name: spec for spec in (TINY, KIMI32, KIMI48_8L, KIMI48)}

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
    return {
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


def _kda_weights(w, gen, p: str, spec: ModelSpec) -> None:
    """One KDA layer under prefix ``p`` (checkpoint names SGLang's loader maps)."""
    import torch

    bf16, hidden, heads = torch.bfloat16, spec.hidden, spec.kda_heads
    proj = heads * HEAD_DIM
    for name in ("q_proj", "k_proj", "v_proj"):
        w[p + name + ".weight"] = _randn(gen, proj, hidden, std=hidden**-0.5).to(bf16)
    w[p + "b_proj.weight"] = _randn(gen, heads, hidden, std=hidden**-0.5).to(bf16)
    w[p + "f_a_proj.weight"] = _randn(gen, HEAD_DIM, hidden, std=hidden**-0.5).to(bf16)
    w[p + "f_b_proj.weight"] = _randn(gen, proj, HEAD_DIM, std=HEAD_DIM**-0.5).to(bf16)
    w[p + "g_a_proj.weight"] = _randn(gen, HEAD_DIM, hidden, std=hidden**-0.5).to(bf16)
    w[p + "g_b_proj.weight"] = _randn(gen, proj, HEAD_DIM, std=HEAD_DIM**-0.5).to(bf16)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = _randn(gen, proj, 1, CONV_K, std=0.4)
        conv[:, :, -1] += 1.0  # the current token dominates, earlier taps mix in context
        w[p + name + ".weight"] = conv  # fp32, like SGLang's conv parameter
    w[p + "dt_bias"] = _randn(gen, proj, std=0.5)  # fp32
    # Per-head decay rate exp(A_log), geometric over the heads (tiny: 0.5 and 1.0).
    lo, hi = spec.kda_decay
    log_decay = torch.linspace(torch.tensor(lo).log().item(), torch.tensor(hi).log().item(), heads)
    w[p + "A_log"] = log_decay.to(torch.float32).view(1, 1, heads, 1)
    w[p + "o_norm.weight"] = torch.ones(HEAD_DIM).to(bf16)
    w[p + "o_proj.weight"] = _randn(gen, hidden, proj, std=spec.kda_out_gain * proj**-0.5).to(bf16)


def _mla_weights(w, gen, p: str, spec: ModelSpec) -> None:
    """One MLA layer (q_lora_rank None, NoPE) under prefix ``p``."""
    import torch

    bf16, hidden, heads = torch.bfloat16, spec.hidden, spec.mla_heads
    qk_head = QK_NOPE + QK_ROPE
    w[p + "q_proj.weight"] = _randn(gen, heads * qk_head, hidden, std=MLA_Q_GAIN * hidden**-0.5).to(bf16)
    w[p + "kv_a_proj_with_mqa.weight"] = _randn(gen, KV_LORA_RANK + QK_ROPE, hidden, std=hidden**-0.5).to(bf16)
    w[p + "kv_a_layernorm.weight"] = torch.ones(KV_LORA_RANK).to(bf16)
    w[p + "kv_b_proj.weight"] = _randn(
        gen, heads * (QK_NOPE + V_HEAD), KV_LORA_RANK, std=KV_LORA_RANK**-0.5
    ).to(bf16)
    w[p + "o_proj.weight"] = _randn(
        gen, hidden, heads * V_HEAD, std=spec.mla_out_gain * (heads * V_HEAD) ** -0.5
    ).to(bf16)


def make_target_weights(spec: ModelSpec = TINY) -> Dict[str, "torch.Tensor"]:
    """Seeded random target weights under the checkpoint names SGLang's ``KimiLinearForCausalLM``
    loads (HF Kimi-Linear layout: separate q/k/v/b/f_a/f_b/g_a/g_b projections and
    q/k/v_conv1d, which SGLang fuses while loading). Draw order: embeddings, every layer's
    attention, every layer's MLP, lm_head."""
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
        w[p + "mlp.gate_proj.weight"] = _randn(gen, inter, hidden, std=hidden**-0.5).to(bf16)
        w[p + "mlp.up_proj.weight"] = _randn(gen, inter, hidden, std=hidden**-0.5).to(bf16)
        w[p + "mlp.down_proj.weight"] = _randn(
            gen, hidden, inter, std=spec.mlp_out_gain * inter**-0.5
        ).to(bf16)

    w["model.norm.weight"] = torch.ones(hidden).to(bf16)
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
        f = self._linear(self._linear(x, p + "f_a_proj.weight"), p + "f_b_proj.weight")
        A = torch.exp(self.w[p + "A_log"].view(H, 1))
        g = -A * F.softplus(f.view(B, T, H, K) + self.w[p + "dt_bias"].view(H, K))
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
        gate = self._linear(self._linear(x, p + "g_a_proj.weight"), p + "g_b_proj.weight")
        o = self._rms(o, self.w[p + "o_norm.weight"]) * torch.sigmoid(gate.view(B, T, H, K))
        return self._linear(o.reshape(B, T, H * K), p + "o_proj.weight")

    def _mla(self, x, p: str, cache: dict):
        import torch

        B, T, _ = x.shape
        H = self.spec.mla_heads
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
        o = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)
        return self._linear(o.reshape(B, T, H * V_HEAD), p + "o_proj.weight")

    def _mlp(self, x, layer):
        import torch.nn.functional as F

        p = f"model.layers.{layer}.mlp."
        return self._linear(
            F.silu(self._linear(x, p + "gate_proj.weight")) * self._linear(x, p + "up_proj.weight"),
            p + "down_proj.weight",
        )

    def forward(self, ids: "torch.Tensor", cache: Optional[List[dict]] = None):
        """ids [B, T] -> (logits [B, T, VOCAB] float64, cache to continue from)."""
        cache = cache if cache is not None else [{} for _ in self.spec.layers]
        h = self.w["model.embed_tokens.weight"][ids.to(self.device)]
        for layer, kind in enumerate(self.spec.layers):
            p = f"model.layers.{layer}."
            attn = self._kda if kind == "kda" else self._mla
            h = h + attn(self._rms(h, self.w[p + "input_layernorm.weight"]), p + "self_attn.", cache[layer])
            h = h + self._mlp(self._rms(h, self.w[p + "post_attention_layernorm.weight"]), layer)
        h = self._rms(h, self.w["model.norm.weight"])
        return h @ self.w["lm_head.weight"].T, cache

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
        description="Write a Kimi-Linear test target and its DSPARK draft (missing files only).",
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
