"""The GPU e2e fleet's plan and its judges, on CPU (tests/gpu/gpu_kit.py; the fleet itself runs on a
GPU): which configurations a GPU fleet serves (a control for every speculative configuration of
the plugin, the slot-reuse configurations of each commit path, the prefill-graph configurations
with their same-graph stock), the acceptance comparison with stock SGLang + DSPARK, and what the
slot-reuse check reads from a server log."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpu_kit  # noqa: E402


@pytest.fixture
def gpu_fleet(monkeypatch):
    """``configs`` as a GPU fleet plans it (the plan reads no GPU)."""
    monkeypatch.setattr(gpu_kit, "ON_CPU", False)
    monkeypatch.setattr(gpu_kit, "ONLY_CONFIGS", set())
    return lambda: {s.name: s for s in gpu_kit.configs("kimi32")}


def test_every_speculative_plugin_configuration_has_its_stock_control(gpu_fleet):
    fleet = gpu_fleet()
    speculative = [s for s in fleet.values() if s.backend == "dspark" and s.gamma]
    assert len(speculative) >= 8
    for s in speculative:
        control = fleet[s.control]  # served in the same fleet
        assert control.backend == "stock"
        assert (control.gamma, control.ragged, control.sps_table) == (s.gamma, s.ragged, s.sps_table), s.name
    assert all(s.control is None for s in fleet.values() if s.backend == "stock" or not s.gamma)
    assert not any(s.prefill_graph for s in fleet.values())  # prefill graphs only by name


def test_slot_reuse_covers_every_commit_path(gpu_fleet):
    """One small-pool configuration per commit path: the lazy record ring, the fold, snapshot."""
    reuse = [s for s in gpu_fleet().values() if s.mamba_slots]
    kernels = {tuple(s.expected_kernels()) for s in reuse}
    assert kernels == {("mtp_verify (ring, lazy records)", "lazy records commit"),
                       ("mtp_verify (ring)", "replayssm_fold"), ("mtp_verify (snapshot)",)}
    assert all(s.mamba_slots == gpu_kit.SLOT_REUSE_MAMBA_SLOTS < 512 for s in reuse)


def test_prefill_graph_configurations_are_judged_against_stock_on_the_same_graph(gpu_fleet, monkeypatch):
    monkeypatch.setattr(gpu_kit, "ONLY_CONFIGS", {"dspark-g3-replayssm-prefill-graph", "dspark-decode-prefill-graph"})
    fleet = gpu_fleet()
    assert set(fleet) == {"stock", "stock-prefill-graph", "stock-g3-replayssm-prefill-graph",
                          "dspark-g3-replayssm-prefill-graph", "dspark-decode-prefill-graph"}
    assert fleet["dspark-decode-prefill-graph"].baseline == "stock-prefill-graph"
    assert fleet["dspark-g3-replayssm-prefill-graph"].baseline == "stock-g3-replayssm-prefill-graph"
    assert fleet["dspark-g3-replayssm-prefill-graph"].control == "stock-g3-replayssm-prefill-graph"
    assert all(fleet[name].prefill_graph for name in fleet if name != "stock")


def _steps(accept_probability: float, gamma: int, n: int, seed: int):
    """A histogram of ``n`` verify steps whose drafts are each accepted with ``accept_probability``
    until the first rejection (the greedy chain's accept rule)."""
    rng = random.Random(seed)
    hist = [0] * (gamma + 1)
    for _ in range(n):
        k = 0
        while k < gamma and rng.random() < accept_probability:
            k += 1
        hist[k] += 1
    return hist


def test_acceptance_comparison():
    stock = _steps(0.7, 3, 800, seed=1)
    # the same speculation, another sample of steps: noise passes
    for seed in range(2, 12):
        verdict = gpu_kit.compare_acceptance(_steps(0.7, 3, 800, seed=seed), stock)
        assert verdict["same"], verdict
    # a plugin that accepted one draft in the whole run (what "accepted drafts" allowed before)
    one = [799, 1, 0, 0]
    assert not gpu_kit.compare_acceptance(one, stock)["same"]
    # a moderate loss: a draft accepted with 0.6 instead of 0.7
    assert not gpu_kit.compare_acceptance(_steps(0.6, 3, 800, seed=3), stock)["same"]
    # the histogram's mean: drafts accepted per verify step
    verdict = gpu_kit.compare_acceptance([1, 1, 2], [0, 0, 4])
    assert verdict["ours_mean"] == pytest.approx(5 / 4) and verdict["stock_mean"] == pytest.approx(2.0)
    assert not gpu_kit.compare_acceptance([], stock)["same"]  # no verify step: nothing shown
    rows = [{"spec_correct_drafts_histogram": [1, 2]}, {"spec_correct_drafts_histogram": [0, 1, 3]},
            {"spec_correct_drafts_histogram": None}]
    assert gpu_kit.accepted_histogram(rows) == [1, 3, 3]


# SGLang 0.5.23's lines (kv_cache_configurator.resolve_max_num_reqs, metrics_reporter's batch lines)
SIZING = ("max_running_requests is capped to 8 by the mamba state cache (max_mamba_cache_size=40, 5 state "
          "slots per request). To raise it: increase --mamba-full-memory-ratio or --max-mamba-cache-size, or "
          "halve the state size with --mamba-ssm-dtype bfloat16.")
BATCH = ("Decode batch, #running-req: 8, #full token: 900, full token usage: 0.01, mamba num: 32, "
         "mamba usage: 0.80, accept len: 2.10, gen throughput (token/s): 812.00, #queue-req: {}")


def test_slot_reuse_from_the_server_log():
    log = "\n".join(["[2026] " + SIZING, "[2026] " + BATCH.format(0), "[2026] " + BATCH.format(61)])
    reuse = gpu_kit.slot_reuse(log, requests=87)
    assert reuse == dict(running_cap=8, slots=40, ratio=5, max_queued=61, uses_per_slot=87 * 3 / 40)
    assert reuse["uses_per_slot"] >= gpu_kit.SLOT_REUSE_MIN_USES
    assert gpu_kit.slot_reuse("[2026] " + BATCH.format(3), requests=87) is None  # the pool set no cap


def test_robust_prompts_with_branches_keep_the_margin_on_both_turns():
    """The fleet's prompt search with the prefix-hit conversations (it runs before any GPU server
    starts): every prompt and both requests of every conversation keep ``MIN_MARGIN`` under an
    independent float64 greedy run of the model definition."""
    import torch
    from safetensors.torch import load_file

    from sglang_dspark_plugin.harness import tiny_models

    spec = tiny_models.TINY
    tiny_models.ensure_models(spec, tiny_models.default_out_dir())
    prompts = gpu_kit.robust_prompts(spec, n=2, batch=32, branches=True)
    assert len(prompts.ids) == 2 and len(prompts.turn1) == min(gpu_kit.BRANCH_PROMPTS, 2)
    weights = load_file(str(tiny_models.default_out_dir() / spec.target_dir / tiny_models.WEIGHTS_FILE))
    ref = tiny_models.ReferenceTarget(weights, spec)
    with torch.no_grad():
        tokens, margins = ref.greedy(torch.tensor(prompts.ids), gpu_kit.OUTPUT_LEN)
        assert tokens.tolist() == prompts.reference
        assert margins.min() >= gpu_kit.MIN_MARGIN
        turn1, m1 = ref.greedy(torch.tensor(prompts.turn1), gpu_kit.TURN1_LEN)
        branch = [gpu_kit.branch_prompt(p, t) for p, t in zip(prompts.turn1, turn1.tolist())]
        _, m2 = ref.greedy(torch.tensor(branch), gpu_kit.BRANCH_LEN)
    assert m1.min() >= gpu_kit.MIN_MARGIN and m2.min() >= gpu_kit.MIN_MARGIN
