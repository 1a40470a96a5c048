"""Tiny, reproducible Kimi-Linear target + DSPARK draft for CPU demos and end-to-end tests.

``python -m sglang_dspark_plugin.harness.tiny_models [--out DIR]`` writes, under ``DIR`` (default: the
checkout's ``configs/``):

* ``tiny-kimi-linear/``: a 2-layer ``KimiLinearForCausalLM`` (layer 0 KDA, layer 1 MLA with NoPE;
  KDA and MLA head_dim 128, hidden 256, vocab 512) with a byte-level BPE tokenizer and a chat
  template, all built here from a fixed corpus and a fixed seed;
* ``tiny-dspark-draft/``: a 1-layer ``DSparkDraftModel`` (Qwen3-shaped DFlash backbone with a
  vanilla Markov head and a confidence head) for that target, same tokenizer.

Only missing files are written, and every run writes the same bytes: weights come from a seeded
``torch.Generator`` on the CPU, the draft's Markov table is derived from the target in float64
(so BLAS threading cannot flip an argmax), and safetensors files are written with sorted keys.
``configs/*/model.safetensors`` is git-ignored; the configs and tokenizer files are committed.

How the weights are chosen (see docs/e2e.md for the measurements):

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

``reference_logits`` is a plain float64 PyTorch forward of the target, written from the model
definition (KDA recurrence, MLA attention, SwiGLU MLP); the e2e docs use it to check that SGLang
loads these weights as intended (its greedy output matches SGLang's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence

TARGET_DIR = "tiny-kimi-linear"
DRAFT_DIR = "tiny-dspark-draft"
WEIGHTS_FILE = "model.safetensors"
SEED = 20261130

VOCAB_SIZE = 512
HIDDEN = 256
INTERMEDIATE = 512
KDA_HEADS = 2
HEAD_DIM = 128
MLA_HEADS = 2
KV_LORA_RANK = 512
QK_NOPE = 128
QK_ROPE = 64
V_HEAD = 128
CONV_K = 4
MARKOV_RANK = 64
DEFAULT_BLOCK_SIZE = 3  # gamma; --speculative-dspark-block-size overrides it

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

# Scale knobs of the target's random weights (see the module docstring).
EMBED_STD = 1.0  # token embeddings ~ N(0, EMBED_STD^2): the "bigram" path
KDA_OUT_GAIN = 0.3  # KDA o_proj gain relative to a unit-variance output
MLA_OUT_GAIN = 0.3  # MLA o_proj gain
MLP_OUT_GAIN = 0.2  # MLP down_proj gain
MLA_Q_GAIN = 3.0  # sharpens MLA attention (scores ~ N(0, MLA_Q_GAIN^2))
LOGIT_STD = 6.0  # lm_head gain: std of the logits of a unit-RMS final hidden state
MARKOV_GAIN = 4.0  # c above: Markov bias peak c^2 = 16 logits
CONFIDENCE_BIAS = 2.0

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


def target_config() -> dict:
    """config.json of the tiny Kimi-Linear target (SGLang parses it with transformers' strict
    ``KimiLinearConfig`` first, hence the expert fields: all layers stay dense because
    ``first_k_dense_replace == num_hidden_layers``)."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 2,
        "num_attention_heads": MLA_HEADS,
        "num_key_value_heads": MLA_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 512,
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
        "num_experts": 4,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 64,
        "num_shared_experts": 1,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "linear_attn_config": {
            "kda_layers": [1],
            "full_attn_layers": [2],
            "num_heads": KDA_HEADS,
            "head_dim": HEAD_DIM,
            "short_conv_kernel_size": CONV_K,
        },
        "num_nextn_predict_layers": 0,
        "num_expert_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
    }


def draft_config() -> dict:
    """config.json of the tiny DSPARK draft (fields: dspark-on-cpu.md, ``models/dspark.py``)."""
    return {
        "architectures": ["DSparkDraftModel"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,  # must equal the target's: the draft reuses its embed/lm_head
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "num_target_layers": 2,
        "block_size": DEFAULT_BLOCK_SIZE,
        "markov_rank": MARKOV_RANK,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "dflash_config": {
            "block_size": DEFAULT_BLOCK_SIZE,
            "target_layer_ids": [0, 1],
            "mask_token_id": MASK_ID,
            "num_target_layers": 2,
        },
    }


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def build_tokenizer():
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
        model_max_length=512,
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


def make_target_weights() -> Dict[str, "torch.Tensor"]:
    """Seeded random target weights under the checkpoint names SGLang's ``KimiLinearForCausalLM``
    loads (HF Kimi-Linear layout: separate q/k/v/b/f_a/f_b/g_a/g_b projections and
    q/k/v_conv1d, which SGLang fuses while loading)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    bf16 = torch.bfloat16
    proj = KDA_HEADS * HEAD_DIM
    w: Dict[str, torch.Tensor] = {}

    w["model.embed_tokens.weight"] = _randn(gen, VOCAB_SIZE, HIDDEN, std=EMBED_STD).to(bf16)

    # Layer 0: KDA.
    p = "model.layers.0.self_attn."
    for name in ("q_proj", "k_proj", "v_proj"):
        w[p + name + ".weight"] = _randn(gen, proj, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "b_proj.weight"] = _randn(gen, KDA_HEADS, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "f_a_proj.weight"] = _randn(gen, HEAD_DIM, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "f_b_proj.weight"] = _randn(gen, proj, HEAD_DIM, std=HEAD_DIM**-0.5).to(bf16)
    w[p + "g_a_proj.weight"] = _randn(gen, HEAD_DIM, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "g_b_proj.weight"] = _randn(gen, proj, HEAD_DIM, std=HEAD_DIM**-0.5).to(bf16)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = _randn(gen, proj, 1, CONV_K, std=0.4)
        conv[:, :, -1] += 1.0  # the current token dominates, earlier taps mix in context
        w[p + name + ".weight"] = conv  # fp32, like SGLang's conv parameter
    w[p + "dt_bias"] = _randn(gen, proj, std=0.5)  # fp32
    # Per-head decay rate exp(A_log): 0.5 and 1.0 -> log-decay about -0.35 / -0.7 per token.
    w[p + "A_log"] = torch.log(torch.tensor([0.5, 1.0], dtype=torch.float32)).view(1, 1, KDA_HEADS, 1)
    w[p + "o_norm.weight"] = torch.ones(HEAD_DIM).to(bf16)
    w[p + "o_proj.weight"] = _randn(gen, HIDDEN, proj, std=KDA_OUT_GAIN * proj**-0.5).to(bf16)

    # Layer 1: MLA (q_lora_rank None, NoPE).
    p = "model.layers.1.self_attn."
    qk_head = QK_NOPE + QK_ROPE
    w[p + "q_proj.weight"] = _randn(gen, MLA_HEADS * qk_head, HIDDEN, std=MLA_Q_GAIN * HIDDEN**-0.5).to(bf16)
    w[p + "kv_a_proj_with_mqa.weight"] = _randn(gen, KV_LORA_RANK + QK_ROPE, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "kv_a_layernorm.weight"] = torch.ones(KV_LORA_RANK).to(bf16)
    w[p + "kv_b_proj.weight"] = _randn(
        gen, MLA_HEADS * (QK_NOPE + V_HEAD), KV_LORA_RANK, std=KV_LORA_RANK**-0.5
    ).to(bf16)
    w[p + "o_proj.weight"] = _randn(
        gen, HIDDEN, MLA_HEADS * V_HEAD, std=MLA_OUT_GAIN * (MLA_HEADS * V_HEAD) ** -0.5
    ).to(bf16)

    for layer in (0, 1):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(HIDDEN).to(bf16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN).to(bf16)
        w[p + "mlp.gate_proj.weight"] = _randn(gen, INTERMEDIATE, HIDDEN, std=HIDDEN**-0.5).to(bf16)
        w[p + "mlp.up_proj.weight"] = _randn(gen, INTERMEDIATE, HIDDEN, std=HIDDEN**-0.5).to(bf16)
        w[p + "mlp.down_proj.weight"] = _randn(
            gen, HIDDEN, INTERMEDIATE, std=MLP_OUT_GAIN * INTERMEDIATE**-0.5
        ).to(bf16)

    w["model.norm.weight"] = torch.ones(HIDDEN).to(bf16)
    lm_head = _randn(gen, VOCAB_SIZE, HIDDEN, std=LOGIT_STD * HIDDEN**-0.5)
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
# Reference forward of the target (float64, plain PyTorch)
# ----------------------------------------------------------------------------------------------


class ReferenceTarget:
    """Float64 forward of the tiny target, from the model definition. Used to derive the draft's
    Markov table and, in docs/tests, to cross-check what SGLang computes."""

    def __init__(self, weights: Dict[str, "torch.Tensor"], eps: float = 1e-5):
        import torch

        self.w = {k: v.to(torch.float64) for k, v in weights.items()}
        self.eps = eps

    def _rms(self, x, weight):
        import torch

        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _linear(self, x, name):
        return x @ self.w[name].T

    def _kda(self, x):
        """x: [B, T, HIDDEN] (already input-normed) -> [B, T, HIDDEN]."""
        import torch
        import torch.nn.functional as F

        p = "model.layers.0.self_attn."
        B, T, _ = x.shape
        H, K = KDA_HEADS, HEAD_DIM

        def conv_silu(y, name):  # causal depthwise conv, kernel CONV_K, then SiLU
            weight = self.w[p + name + ".weight"][:, 0, :]  # [C, CONV_K]
            pad = F.pad(y.transpose(1, 2), (CONV_K - 1, 0))  # [B, C, T+K-1]
            out = sum(pad[:, :, j : j + T] * weight[:, j : j + 1] for j in range(CONV_K))
            return F.silu(out.transpose(1, 2))

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
        S = x.new_zeros(B, H, K, K)  # [key, value]
        outs = []
        for t in range(T):
            S = S * torch.exp(g[:, t]).unsqueeze(-1)
            kt, vt = k[:, t], v[:, t]
            u = (vt - torch.einsum("bhk,bhkv->bhv", kt, S)) * beta[:, t].unsqueeze(-1)
            S = S + kt.unsqueeze(-1) * u.unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
        o = torch.stack(outs, 1)  # [B, T, H, V]
        gate = self._linear(self._linear(x, p + "g_a_proj.weight"), p + "g_b_proj.weight")
        o = self._rms(o, self.w[p + "o_norm.weight"]) * torch.sigmoid(gate.view(B, T, H, K))
        return self._linear(o.reshape(B, T, H * K), p + "o_proj.weight")

    def _mla(self, x):
        import torch

        p = "model.layers.1.self_attn."
        B, T, _ = x.shape
        H = MLA_HEADS
        q = self._linear(x, p + "q_proj.weight").view(B, T, H, QK_NOPE + QK_ROPE)
        kv_a = self._linear(x, p + "kv_a_proj_with_mqa.weight")
        c, k_pe = kv_a[..., :KV_LORA_RANK], kv_a[..., KV_LORA_RANK:]
        c = self._rms(c, self.w[p + "kv_a_layernorm.weight"])
        kv = self._linear(c, p + "kv_b_proj.weight").view(B, T, H, QK_NOPE + V_HEAD)
        k_nope, v = kv[..., :QK_NOPE], kv[..., QK_NOPE:]
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(B, T, H, QK_ROPE)], -1)
        scores = torch.einsum("bthd,bshd->bhts", q, k) * (QK_NOPE + QK_ROPE) ** -0.5
        mask = torch.ones(T, T, dtype=torch.bool).triu(1)
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

    def logits(self, ids: "torch.Tensor") -> "torch.Tensor":
        """ids [B, T] (same length) -> logits [B, T, VOCAB] in float64."""
        h = self.w["model.embed_tokens.weight"][ids]
        for layer, attn in ((0, self._kda), (1, self._mla)):
            p = f"model.layers.{layer}."
            h = h + attn(self._rms(h, self.w[p + "input_layernorm.weight"]))
            h = h + self._mlp(self._rms(h, self.w[p + "post_attention_layernorm.weight"]), layer)
        h = self._rms(h, self.w["model.norm.weight"])
        return h @ self.w["lm_head.weight"].T

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int):
        """Greedy continuation; returns (tokens, per-step top1-top2 logit margins)."""
        import torch

        ids = list(prompt_ids)
        out, margins = [], []
        for _ in range(max_new_tokens):
            logits = self.logits(torch.tensor([ids]))[0, -1]
            top = torch.topk(logits, 2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            ids.append(out[-1])
        return out, margins

    def one_token_successor(self) -> "torch.Tensor":
        """f(t) = argmax of the target's logits after the one-token context [t], for every t."""
        import torch

        ids = torch.arange(VOCAB_SIZE).view(-1, 1)
        return self.logits(ids)[:, 0].argmax(-1)


def reference_logits(weights, ids):
    return ReferenceTarget(weights).logits(ids)


# ----------------------------------------------------------------------------------------------
# Draft weights
# ----------------------------------------------------------------------------------------------


def make_draft_weights(target_weights: Dict[str, "torch.Tensor"]) -> Dict[str, "torch.Tensor"]:
    """Seeded draft weights (names as ``DSparkDraftModel.load_weights`` expects: backbone
    ``layers.*``, ``fc``, ``hidden_norm``, ``norm``; ``markov_head.*``; ``confidence_head.*``).
    The draft shares the target's ``embed_tokens``/``lm_head``, so it ships neither."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    bf16 = torch.bfloat16
    cfg = draft_config()
    heads, kv_heads, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_ctx = len(cfg["dflash_config"]["target_layer_ids"])
    w: Dict[str, torch.Tensor] = {}

    # Backbone: ordinary random init. It runs for real (context KV injection, block attention),
    # but its output is multiplied by a zero final-norm weight, so base logits are exactly 0.
    p = "layers.0."
    w[p + "self_attn.q_proj.weight"] = _randn(gen, heads * hd, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "self_attn.k_proj.weight"] = _randn(gen, kv_heads * hd, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "self_attn.v_proj.weight"] = _randn(gen, kv_heads * hd, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "self_attn.o_proj.weight"] = _randn(gen, HIDDEN, heads * hd, std=(heads * hd) ** -0.5).to(bf16)
    w[p + "self_attn.q_norm.weight"] = torch.ones(hd).to(bf16)
    w[p + "self_attn.k_norm.weight"] = torch.ones(hd).to(bf16)
    w[p + "input_layernorm.weight"] = torch.ones(HIDDEN).to(bf16)
    w[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN).to(bf16)
    w[p + "mlp.gate_proj.weight"] = _randn(gen, INTERMEDIATE, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "mlp.up_proj.weight"] = _randn(gen, INTERMEDIATE, HIDDEN, std=HIDDEN**-0.5).to(bf16)
    w[p + "mlp.down_proj.weight"] = _randn(gen, HIDDEN, INTERMEDIATE, std=INTERMEDIATE**-0.5).to(bf16)
    w["fc.weight"] = _randn(gen, HIDDEN, n_ctx * HIDDEN, std=(n_ctx * HIDDEN) ** -0.5).to(bf16)
    w["hidden_norm.weight"] = torch.ones(HIDDEN).to(bf16)
    w["norm.weight"] = torch.zeros(HIDDEN).to(bf16)  # base logits == 0: the Markov head decides

    # Markov head: bias(prev)[j] = MARKOV_GAIN^2 <u_f(prev), u_j>, maximal at j = f(prev).
    succ = ReferenceTarget(target_weights).one_token_successor()
    u = _randn(gen, VOCAB_SIZE, MARKOV_RANK)
    u = u / u.norm(dim=-1, keepdim=True)
    w["markov_head.markov_w2.weight"] = (MARKOV_GAIN * u).to(bf16)
    w["markov_head.markov_w1.weight"] = (MARKOV_GAIN * u[succ]).to(bf16)

    # Confidence head (read only by the non-static ragged-verify modes): constant sigmoid(2).
    w["confidence_head.proj.weight"] = torch.zeros(1, HIDDEN + MARKOV_RANK)
    w["confidence_head.proj.bias"] = torch.full((1,), CONFIDENCE_BIAS)
    return w


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def default_out_dir() -> Path:
    """The checkout's ``configs/`` when running from a source tree (an editable install), else a
    user cache dir, never site-packages (override with ``SGLANG_DSPARK_TINY_DIR``)."""
    env = os.environ.get("SGLANG_DSPARK_TINY_DIR")
    if env:
        return Path(env)
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


def ensure_tiny_models(out: Optional[os.PathLike] = None, *, log=print) -> Dict[str, Path]:
    """Write whatever is missing of the two tiny models under ``out``; return their paths."""
    out = Path(out) if out is not None else default_out_dir()
    target_dir, draft_dir = out / TARGET_DIR, out / DRAFT_DIR
    target_dir.mkdir(parents=True, exist_ok=True)
    draft_dir.mkdir(parents=True, exist_ok=True)

    for path, obj in (
        (target_dir / "config.json", target_config()),
        (draft_dir / "config.json", draft_config()),
        (draft_dir / SPS_TABLE_FILE, sps_cost_table()),
    ):
        if _write_json_if_missing(path, obj):
            log(f"wrote {path}")
    tokenizer = None
    for model_dir in (target_dir, draft_dir):
        if not _has_tokenizer(model_dir):
            tokenizer = tokenizer or build_tokenizer()
            _write_tokenizer(model_dir, tokenizer)
            log(f"wrote tokenizer to {model_dir}")

    need_target = not (target_dir / WEIGHTS_FILE).is_file()
    need_draft = not (draft_dir / WEIGHTS_FILE).is_file()
    if need_target or need_draft:
        target_weights = make_target_weights()
        if need_target:
            _save_safetensors(target_weights, target_dir / WEIGHTS_FILE)
            log(f"wrote {target_dir / WEIGHTS_FILE}")
        if need_draft:
            _save_safetensors(make_draft_weights(target_weights), draft_dir / WEIGHTS_FILE)
            log(f"wrote {draft_dir / WEIGHTS_FILE}")
    return {"target": target_dir, "draft": draft_dir}


def main(argv: Optional[Iterable[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_dspark_plugin.harness.tiny_models",
        description="Write the tiny Kimi-Linear target and DSPARK draft (missing files only).",
    )
    parser.add_argument("--out", default=None, help=f"output dir (default: {default_out_dir()})")
    parser.add_argument(
        "--force", action="store_true", help="rewrite the weights even if they exist"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    out = Path(args.out) if args.out else default_out_dir()
    if args.force:
        for sub in (TARGET_DIR, DRAFT_DIR):
            (out / sub / WEIGHTS_FILE).unlink(missing_ok=True)
    paths = ensure_tiny_models(out)
    print(f"target: {paths['target']}\ndraft:  {paths['draft']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
