"""tiny_models: reproducible bytes, committed configs/tokenizers up to date, and a draft whose
Markov head really encodes the target's one-token successor function (no server needed)."""

from pathlib import Path

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


def test_committed_configs_match_generator(tmp_path):
    """configs/tiny-*/ (config.json, tokenizer files) are exactly what the generator writes."""
    tiny_models.ensure_tiny_models(tmp_path, log=lambda m: None)
    for sub in (tiny_models.TARGET_DIR, tiny_models.DRAFT_DIR):
        generated = {p.name for p in (tmp_path / sub).iterdir()} - {tiny_models.WEIGHTS_FILE}
        assert "config.json" in generated and "tokenizer.json" in generated
        for name in generated:
            assert (REPO_CONFIGS / sub / name).read_bytes() == (tmp_path / sub / name).read_bytes(), (
                f"configs/{sub}/{name} is stale: run python -m sglang_dspark_plugin.harness.tiny_models "
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
