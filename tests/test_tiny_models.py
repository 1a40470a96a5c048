"""tiny_models: reproducible bytes, committed configs/tokenizers up to date, and a draft whose
Markov head really encodes the target's one-token successor function (no server needed)."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sglang_dspark_plugin.harness import tiny_models

REPO_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_generation_is_reproducible_and_idempotent(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tiny_models.ensure_tiny_models(a, log=lambda m: None)
    tiny_models.ensure_tiny_models(b, log=lambda m: None)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert Path(tiny_models.TARGET_DIR, tiny_models.WEIGHTS_FILE) in files
    assert Path(tiny_models.DRAFT_DIR, tiny_models.WEIGHTS_FILE) in files
    for rel in files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    weights = a / tiny_models.TARGET_DIR / tiny_models.WEIGHTS_FILE
    mtime = weights.stat().st_mtime_ns
    tiny_models.ensure_tiny_models(a, log=lambda m: None)  # nothing missing: nothing rewritten
    assert weights.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("model_spec", tiny_models.SPECS.values(), ids=lambda s: s.name)
def test_committed_configs_match_generator(tmp_path, model_spec):
    """configs/<model>/ (config.json, tokenizer files) are exactly what the generator writes."""
    tiny_models.ensure_models(model_spec, tmp_path, log=lambda m: None, weights=False)
    for sub in (model_spec.target_dir, model_spec.draft_dir):
        generated = {p.name for p in (tmp_path / sub).iterdir()}
        assert "config.json" in generated
        assert ("tokenizer.json" in generated) != model_spec.random_weights  # random: token ids only
        for name in generated:
            assert (REPO_CONFIGS / sub / name).read_bytes() == (tmp_path / sub / name).read_bytes(), (
                f"configs/{sub}/{name} is stale: run python -m sglang_dspark_plugin.harness.tiny_models --model {model_spec.name} "
                "after deleting it")


def test_draft_markov_head_predicts_target_successor():
    target = tiny_models.make_target_weights()
    draft = tiny_models.make_draft_weights(target)
    succ = tiny_models.ReferenceTarget(target).one_token_successor()
    w1 = draft["markov_head.markov_w1.weight"].float()
    w2 = draft["markov_head.markov_w2.weight"].float()
    bias = w1 @ w2.T  # [prev, next] Markov logits; base logits are exactly 0 (zero final norm)
    assert torch.equal(bias.argmax(-1), succ)
    top2 = bias.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).min()) > 2.0  # bf16-safe margin
    assert not draft["norm.weight"].float().any()


def test_special_tokens_are_never_emitted():
    lm_head = tiny_models.make_target_weights()["lm_head.weight"].float()
    assert not lm_head[: len(tiny_models.SPECIAL_TOKENS)].any()
    assert int(tiny_models.emittable_tokens().sum()) > 200


@pytest.mark.parametrize("base", [tiny_models.KIMI32, tiny_models.K3_12H], ids=lambda s: s.name)
def test_incremental_reference_equals_full_recompute(base):
    """``ReferenceTarget.greedy`` (one token per step from the cached KDA state, conv tail and MLA
    keys) picks the same tokens, with the same margins, as re-running the whole sequence; on a
    scaled-down kimi32 / k3-12h layout (KDA, KDA, KDA, MLA) so every cache kind is crossed by a
    layer (k3-12h: and K3's attention-residual bank, two snapshots)."""
    spec = dataclasses.replace(
        base, hidden=256, intermediate=256, kda_heads=2, mla_heads=2, q_lora_rank=base.q_lora_rank and 64,
        draft_heads=2, draft_kv_heads=2, draft_intermediate=256,
    )  # fmt: skip
    ref = tiny_models.ReferenceTarget(tiny_models.make_target_weights(spec), spec)
    ids = torch.randint(7, 200, (3, 5), generator=torch.Generator().manual_seed(0))
    tokens, margins = ref.greedy(ids, 6)
    seq = ids
    for step in range(6):
        top = ref.logits(seq)[:, -1].topk(2)
        assert torch.equal(top.indices[:, 0], tokens[:, step])
        torch.testing.assert_close(top.values[:, 0] - top.values[:, 1], margins[:, step], rtol=1e-9, atol=1e-9)
        seq = torch.cat([seq, tokens[:, step : step + 1]], 1)


def test_random_weight_model_is_kimi_linear_48b_cut_to_8_layers():
    """kimi48-8l's config is read by SGLang as Kimi-Linear-48B-A3B's first 8 layers: MoE from layer
    1 on, KDA at 0-2 and 4-6, the real vocabulary; and its serving arguments load random weights
    (no checkpoint is ever generated for it)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.kimi_linear import _is_sparse_layer

    from sglang_dspark_plugin.harness.serving import tiny_model_args

    spec = tiny_models.KIMI48_8L
    config = ModelConfig(str(REPO_CONFIGS / spec.target_dir), trust_remote_code=True).hf_config
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (2304, 163840, 8)
    assert [i for i in range(8) if config.is_kda_layer(i)] == [0, 1, 2, 4, 5, 6]
    assert [_is_sparse_layer(config, i) for i in range(8)] == [False] + [True] * 7
    assert (config.num_experts, config.num_experts_per_token, config.moe_intermediate_size) == (256, 8, 1024)
    with pytest.raises(ValueError, match="dense models"):
        tiny_models.make_target_weights(spec)
    args = tiny_model_args(3, spec=spec, models_dir=REPO_CONFIGS)
    assert args[args.index("--load-format") + 1] == "dummy"
    assert args[args.index("--speculative-draft-load-format") + 1] == "dummy"
    assert "--skip-tokenizer-init" in args
    assert "--load-format" not in tiny_model_args(3, spec=tiny_models.TINY, models_dir=REPO_CONFIGS)


def test_random_weight_model_is_kimi_linear_48b_all_layers():
    """kimi48's config is read by SGLang as Kimi-Linear-48B-A3B itself: 27 layers, MLA where the
    real config's full_attn_layers are (4, 8, ..., 24, 27, 1-based), KDA at the other 20, MoE from
    layer 1 on; the draft reads 4 of its 27 layers."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.kimi_linear import _is_sparse_layer

    spec = tiny_models.KIMI48
    config = ModelConfig(str(REPO_CONFIGS / spec.target_dir), trust_remote_code=True).hf_config
    assert (config.hidden_size, config.vocab_size, config.num_hidden_layers) == (2304, 163840, 27)
    mla = [i + 1 for i in range(27) if not config.is_kda_layer(i)]
    assert mla == [4, 8, 12, 16, 20, 24, 27]
    assert sum(config.is_kda_layer(i) for i in range(27)) == 20
    assert [_is_sparse_layer(config, i) for i in range(27)] == [False] + [True] * 26
    draft = json.loads((REPO_CONFIGS / spec.draft_dir / "config.json").read_text())
    assert draft["num_target_layers"] == 27


def _k3_model(spec):
    """SGLang's parse of a K3 spec's committed config.json."""
    from sglang.srt.configs.model_config import ModelConfig

    return ModelConfig(str(REPO_CONFIGS / spec.target_dir), trust_remote_code=True).hf_config


K3_SPECS = [spec for spec in tiny_models.SPECS.values() if spec.k3]


@pytest.mark.parametrize("spec", K3_SPECS, ids=lambda s: s.name)
def test_k3_models_are_read_as_kimi_k3(spec):
    """The K3 configs are SGLang's Kimi-K3 text stack (``is_kimi_k3``) with K3's KDA (full-rank
    gate, lower bound -5, 12 heads per rank of 128) and MLA (output gate, NoPE) keys; the K3-shaped
    models have K3's hidden and MLA dims (query LoRA 1536)."""
    from sglang.srt.configs.model_config import is_kimi_k3

    config = _k3_model(spec)
    assert is_kimi_k3(config) and config.architectures == ["KimiK3LinearForCausalLM"]
    lin = config.linear_attn_config
    assert (lin["use_full_rank_gate"], lin["gate_lower_bound"], lin["head_dim"]) == (True, -5.0, 128)
    assert lin["num_heads"] % tiny_models.K3_HEADS_PER_RANK == 0
    assert config.mla_use_output_gate and config.mla_use_nope
    situ = (config.hidden_act, config.activation_situ_beta, config.activation_situ_linear_beta)
    assert situ == ("situ", 4.0, 25.0)
    assert config.attn_res_block_size == spec.attn_res_block
    assert [i for i in range(len(spec.layers)) if config.is_kda_layer(i)] == [
        i for i, kind in enumerate(spec.layers) if kind == "kda"]
    if spec is not tiny_models.TINY_K3:
        assert (config.hidden_size, config.q_lora_rank, config.kv_lora_rank) == (7168, 1536, 512)
        assert (config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim) == (128, 64, 128)


def test_k3_throughput_model_has_k3_latent_moe():
    """k3-8l is K3's first 8 layers with its dense layer 0 and LatentMoE from layer 1 on (experts
    at the 3584 latent, latent norm, top-16, 2 shared), fewer experts; random weights only."""
    from sglang.srt.models.kimi_k3 import _is_moe_layer, _uses_latent_moe

    from sglang_dspark_plugin.harness.serving import tiny_model_args

    spec = tiny_models.K3_8L
    config = _k3_model(spec)
    assert (config.vocab_size, config.num_hidden_layers, config.intermediate_size) == (163840, 8, 33792)
    assert [_is_moe_layer(config, i) for i in range(8)] == [False] + [True] * 7
    assert _uses_latent_moe(config) and config.latent_moe_use_norm
    assert (config.routed_expert_hidden_size, config.moe_intermediate_size) == (3584, 3072)
    assert (config.num_experts, config.num_experts_per_token, config.num_shared_experts) == (32, 16, 2)
    with pytest.raises(ValueError, match="dense models"):
        tiny_models.make_target_weights(spec)
    args = tiny_model_args(7, spec=spec, models_dir=REPO_CONFIGS)
    assert args[args.index("--load-format") + 1] == "dummy"

