"""End to end on a Kimi-K3 model: ``--attention-backend dspark`` serving ``tiny-k3``
(``harness.tiny_models.TINY_K3``: SGLang's ``KimiK3LinearForCausalLM`` with K3's KDA and MLA
layers, 12 KDA heads, attention residuals, SiTU) against **stock SGLang without speculation**
(``--attention-backend triton``).

At 12 KDA heads SGLang's K3 layer offers its output gate to the attention backend in decode and
verify forwards; the plugin's kernels then apply K3's gated RMSNorm themselves unless
``SGLANG_DSPARK_OUTPUT_GATE=0``. Per configuration (one server each, ``CONFIGS``): plain decode;
DSPARK block size 3 on the lazy record ring (the default under ``--enable-linear-replayssm-spec``);
block size 3 with snapshot commit and the output gate off; block size 7 with compact verify and
the ReplaySSM fold (``SGLANG_DSPARK_LAZY_RECORDS=0``):

* a ``/generate`` request, a ``/v1/completions`` and a ``/v1/chat/completions`` one, sent at once,
  equal the stock server's, token for token and text for text;
* speculation ran and accepted drafts;
* the plugin's decode / verify / commit kernels ran, the decode and verify ones with the output
  gate fused (``dspark: KDA kernel in use: <kernel> + output gate``) or, with the gate off,
  without it; nothing fell back to SGLang's KDA path.

The stock server's greedy tokens also equal the float64 reference's (``ReferenceTarget``): SGLang
loads the generated K3 checkpoint as the generator means it. Servers run one per configuration, the
next one starting while the current one is tested (``e2e_kit.PREFETCH``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest
import torch
from transformers import AutoTokenizer

from sglang_dspark_plugin.harness import tiny_models
from sglang_dspark_plugin.harness.serving import tiny_model_args
from sglang_dspark_plugin.settings import LAZY_RECORDS_MAX_WINDOW

from e2e_kit import (
    PREFETCH,
    SPEC_STATS,
    all_at_once,
    assert_speculation_consistent,
    chat,
    completion,
    generate,
    next_param,
    speculation_row,
    start_server,
    stop_server,
)
from served_log import OUTPUT_GATE_ENV, assert_not_served_by_plugin, assert_output_gate, assert_served_by_plugin

pytestmark = pytest.mark.e2e

SPEC = tiny_models.TINY_K3
# Fewer tokens than the Kimi-Linear tests: under the Triton interpreter a step of 12 KDA heads (and
# attention residuals at hidden 1024) costs several times the tiny model's.
MAX_TOKENS = 8
# Chosen with the float64 reference: along their first 12 greedy tokens (raw and chat template)
# its top-1/top-2 logit gap stays above 0.4, far above bf16 noise.
PROMPTS = ["A small draft proposes, a", "The answer is yes. The answer"]
# One wave per plugin server, all at once: /generate, completion and chat. The stock baseline also
# serves /generate for the second prompt (its completion's text must equal it).
WAVE = [(generate, PROMPTS[0]), (completion, PROMPTS[1]), (chat, PROMPTS[0])]
BASELINE_WAVE = WAVE + [(generate, PROMPTS[1])]
NEAR_TIE = 0.1  # logits; below this bf16 serving may legitimately pick the other token
# SGLang's one-line notice when the K3 layer offered its gate (``_k3_fused_decode_args``) to a
# decode its fused CUDA kernel does not cover (CPU tensors: cpu_support gate 11)
K3_GATE_OFFERED_MARK = "KDA fused decode rejected by covered()"


@dataclass(frozen=True)
class K3Config:
    name: str
    gamma: Optional[int]  # --speculative-dspark-block-size; None: plain decode
    replayssm: bool = False  # --enable-linear-replayssm-spec
    ragged_mode: str = "static"  # SGLANG_RAGGED_VERIFY_MODE
    lazy_records: Optional[str] = None  # SGLANG_DSPARK_LAZY_RECORDS; None: the default
    output_gate: bool = True  # False: SGLANG_DSPARK_OUTPUT_GATE=0

    @property
    def lazy(self) -> bool:
        """The lazy record ring runs (the default for windows up to 4 tokens)."""
        return self.replayssm and self.lazy_records != "0" and self.gamma + 1 <= LAZY_RECORDS_MAX_WINDOW

    def args(self) -> List[str]:
        # the lazy record ring stays off with CPU's no_buffer radix cache: no radix cache instead
        extra = ["--disable-radix-cache"] if self.lazy else []
        return tiny_model_args(self.gamma, spec=SPEC, attention_backend="dspark", replayssm=self.replayssm,
                               extra=extra)  # fmt: skip

    def env(self) -> Dict[str, str]:
        env = {"SGLANG_RAGGED_VERIFY_MODE": self.ragged_mode}
        if self.lazy_records is not None:
            env["SGLANG_DSPARK_LAZY_RECORDS"] = self.lazy_records
        if not self.output_gate:
            env[OUTPUT_GATE_ENV] = "0"
        return env

    def gated_kernels(self) -> List[str]:
        """The decode / verify kernel this configuration runs (the one that may fuse the gate)."""
        if self.gamma is None:
            return ["decode"]
        if self.lazy:
            return ["mtp_verify (ring, lazy records)"]
        return ["mtp_verify (ring)"] if self.replayssm else ["mtp_verify (snapshot)"]

    def commit_kernels(self) -> List[str]:
        if self.lazy:
            return ["lazy records commit"]
        return ["replayssm_fold"] if self.replayssm else []


CONFIGS = [
    K3Config("k3-decode", gamma=None),
    K3Config("k3-g3-lazy", gamma=3, replayssm=True),
    K3Config("k3-g3-snapshot-gate-off", gamma=3, output_gate=False),
    K3Config("k3-g7-compact-fold", gamma=7, replayssm=True, ragged_mode="compact", lazy_records="0"),
]


def _prefetch_after(request, config: Optional[K3Config]) -> None:
    """Start the server of the configuration after ``config`` (None: the first) meanwhile."""
    following = next_param(request.session, "k3", config, module=request.module)
    if following:
        PREFETCH.start(following.name, following.args(), env=following.env())


@pytest.fixture(scope="module")
def k3_baseline(request) -> dict:
    """Stock SGLang, no speculation: its responses (by (request kind, prompt)) and its log."""
    server = start_server("k3-baseline", tiny_model_args(None, spec=SPEC, attention_backend="triton"))
    _prefetch_after(request, None)
    try:
        outs = dict(zip(_keys(BASELINE_WAVE), all_at_once(server, BASELINE_WAVE, MAX_TOKENS)))
        log = server.log_text()
    finally:
        stop_server(server)
    assert_not_served_by_plugin(log)
    gen = [outs["generate", prompt] for prompt in PROMPTS]
    for out in gen:  # full-length, context-dependent outputs
        assert out["meta_info"]["completion_tokens"] == MAX_TOKENS
    assert gen[0]["output_ids"] != gen[1]["output_ids"]
    assert outs["completion", PROMPTS[1]]["text"] == gen[1]["text"]  # completion == /generate
    return {"outs": outs, "log": log}


def _keys(wave) -> list:
    return [(fn.__name__, prompt) for fn, prompt in wave]


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c.name)
def k3(request, k3_baseline):
    """One plugin server per configuration with the wave's responses, always stopped."""
    config: K3Config = request.param
    server = PREFETCH.take(config.name, config.args(), env=config.env())
    try:
        _prefetch_after(request, config)
        outs = dict(zip(_keys(WAVE), all_at_once(server, WAVE, MAX_TOKENS)))
        yield config, outs, server.log_text()
    finally:
        stop_server(server)


def test_stock_follows_the_float64_reference(k3_baseline):
    """Stock SGLang's greedy tokens equal ``ReferenceTarget``'s (an independent float64 forward
    of K3's definition: lower-bound forget gate, full-rank output gate and gated RMSNorm, MLA with
    query LoRA and output gate, SiTU MLP, attention residuals) up to the reference's first
    near-tie: SGLang loads the generated weights as intended. SGLang's K3 layer offered its output
    gate (12 KDA heads), so the plugin's gate configurations below mean something."""
    model_dir = tiny_models.default_out_dir() / SPEC.target_dir
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ref = tiny_models.ReferenceTarget(tiny_models.make_target_weights(SPEC), SPEC)
    for prompt in PROMPTS:
        out = k3_baseline["outs"]["generate", prompt]
        with torch.no_grad():
            expected, margins = ref.greedy(tokenizer.encode(prompt), MAX_TOKENS)
        exact = next((i for i, m in enumerate(margins) if m < NEAR_TIE), MAX_TOKENS)
        assert out["output_ids"][:exact] == expected[:exact], (prompt, out["output_ids"], expected, margins)
        assert exact == MAX_TOKENS, f"{prompt!r}: reference near-tie at token {exact}; pick another prompt"
    assert K3_GATE_OFFERED_MARK in k3_baseline["log"], "SGLang's K3 layer did not offer its output gate"


def test_lossless_against_stock_sglang(k3, k3_baseline):
    """/generate (ids and text), /v1/completions and /v1/chat/completions, sent at once."""
    config, outs, _ = k3
    for key, out in outs.items():
        expected = k3_baseline["outs"][key]
        if key[0] == "generate":
            assert out["output_ids"] == expected["output_ids"], (config.name, key)
            assert out["text"] == expected["text"], (config.name, key)
        else:
            assert out == expected, (config.name, key)


def test_speculation_accepted_drafts(k3):
    config, outs, _ = k3
    if config.gamma is None:
        pytest.skip("no speculation in this configuration")
    rows = SPEC_STATS.setdefault(config.name, [])
    rows.clear()
    meta = outs["generate", PROMPTS[0]]["meta_info"]
    rows.append(speculation_row(PROMPTS[0], meta))
    accepted = assert_speculation_consistent(meta, config.gamma, MAX_TOKENS)
    assert accepted >= 1, "no verify step accepted more than the bonus token"


def test_plugin_kernels_with_the_output_gate(k3):
    """The plugin's kernels ran (nothing fell back to SGLang's KDA path), the decode / verify
    kernel with K3's output gate fused unless SGLANG_DSPARK_OUTPUT_GATE=0."""
    config, _, log = k3
    assert_served_by_plugin(log, config.gated_kernels() + config.commit_kernels())
    assert_output_gate(log, config.gated_kernels(), fused=config.output_gate)
