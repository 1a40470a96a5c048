"""Tensor parallelism end to end on CPU (the part a machine without two GPUs allows):
``python -m sglang.launch_server --tp-size 2 --attention-backend dspark --speculative-algorithm
DSPARK`` on the bundled tiny Kimi-Linear, as two real SGLang scheduler processes (ranks) talking
through ``torch.distributed`` over gloo.

Each rank holds one of the tiny model's two KDA heads (and one of its two MLA heads): the plugin's
backend, kernels, rings and the all-layer commit run on the rank's shard, the MLA layer on SGLang's
sharded delegate, and the KDA output projection's all-reduce joins the ranks. Checked, per
configuration (DSPARK snapshot verify; ReplaySSM with the fold; ReplaySSM with the lazy record
ring):

* greedy ``/generate`` output ids of all four prompts, sent at once (one batch of four requests),
  equal **stock SGLang without speculation at TP=2** (``--attention-backend triton``, SGLang's own
  KDA kernels) and at TP=1 (the session's baseline), token for token; one chat completion equals
  the TP=1 baseline's text;
* every rank ran the plugin's kernels for the configuration (their first-use log lines carry the
  rank, ``TP0`` / ``TP1``) and no KDA layer fell back;
* speculation ran and accepted drafts.

The stock TP=2 server is also compared with the TP=1 baseline: the two agree here, so "equal to
stock at TP=2" and "equal at TP=1" are both meaningful claims (a TP=2 reduction order that changed
a greedy token would show up there first, in SGLang's own path).

What a CPU machine cannot show: NCCL, custom all-reduce, CUDA graphs, the fa3 MLA delegate and
the per-rank kernel speed: those need two GPUs (tests/gpu, ``DSPARK_GPU_E2E_TP=2``). The CPU
harness needs one more SGLang device gate for this (``cpu_support._gate_pynccl_off_on_cpu``: no
PyNccl on CPU process groups) and the launcher sets ``SGLANG_CPU_OMP_THREADS_BIND``
(``serving.cpu_env``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import pytest

from sglang_dspark_plugin.harness.serving import tiny_model_args

from e2e_kit import (
    MAX_TOKENS,
    PREFETCH,
    PROMPTS,
    assert_not_served_by_plugin,
    assert_served_by_plugin,
    chat,
    generate,
    generate_all_at_once,
    next_param,
    start_server,
    stop_server,
)
from served_log import ranks_that_ran

pytestmark = pytest.mark.e2e

TP_SIZE = 2
GAMMA = 3


@dataclass(frozen=True)
class TPConfig:
    name: str
    replayssm: bool  # --enable-linear-replayssm-spec
    lazy: bool  # the lazy record ring, turned on (and the radix cache off on CPU: the no_buffer cache keeps it off)

    def args(self) -> List[str]:
        extra = ["--tp-size", str(TP_SIZE)]
        if self.lazy:
            extra.append("--disable-radix-cache")
        return tiny_model_args(GAMMA, attention_backend="dspark", replayssm=self.replayssm, extra=extra)

    def kernels(self) -> List[str]:
        if self.lazy:
            return ["mtp_verify (ring, lazy records)", "lazy records commit"]
        return ["mtp_verify (ring)", "replayssm_fold"] if self.replayssm else ["mtp_verify (snapshot)"]

    def env(self) -> Dict[str, str]:
        return {"SGLANG_DSPARK_LAZY_RECORDS": "1" if self.lazy else "0"}  # say which commit runs


CONFIGS = [
    TPConfig("tp2-g3-static", replayssm=False, lazy=False),
    TPConfig("tp2-g3-replayssm", replayssm=True, lazy=False),
    TPConfig("tp2-g3-lazy", replayssm=True, lazy=True),
]


def _prefetch_next(request, current=None) -> None:
    """Start the next TP2 configuration's server while the current server's tests run."""
    following = next_param(request.session, "tp2", current, module=request.module)
    if following:
        PREFETCH.start(following.name, following.args(), env=following.env())


@pytest.fixture(scope="module")
def stock_tp2(request, baseline) -> Dict[str, List[int]]:
    """Greedy output ids of stock SGLang (no speculation, ``triton`` backend) at TP=2."""
    server = start_server(
        "stock-tp2", tiny_model_args(None, attention_backend="triton", extra=["--tp-size", str(TP_SIZE)])
    )
    _prefetch_next(request)
    try:
        out = {p: generate(server, p)["output_ids"] for p in PROMPTS}
        assert_not_served_by_plugin(server)
    finally:
        stop_server(server)
    return out


def test_stock_tp2_equals_tp1(stock_tp2, baseline):
    for prompt in PROMPTS:
        assert stock_tp2[prompt] == baseline.generate[prompt]["output_ids"], prompt


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c.name)
def tp2(request, stock_tp2):
    config: TPConfig = request.param
    server = PREFETCH.take(config.name, config.args(), env=config.env())
    try:
        _prefetch_next(request, config)
        results = generate_all_at_once(server)
        yield config, server, results
    finally:
        stop_server(server)


def test_tp2_lossless_against_stock_tp2_and_tp1(tp2, stock_tp2, baseline):
    config, server, results = tp2
    for prompt, out in results.items():
        assert out["output_ids"] == stock_tp2[prompt], (config.name, prompt)
        assert out["output_ids"] == baseline.generate[prompt]["output_ids"], (config.name, prompt)
        assert out["meta_info"]["completion_tokens"] == MAX_TOKENS
    prompt = PROMPTS[0]
    assert chat(server, prompt) == baseline.chat[prompt], (config.name, prompt)


def test_tp2_speculation_exercised(tp2):
    config, server, results = tp2
    accepted = 0
    for prompt, out in results.items():
        meta = out["meta_info"]
        assert meta.get("spec_verify_ct", 0) >= 1, (prompt, meta)
        accepted += meta["spec_num_correct_drafts"]
    assert accepted >= 1, "no verify step accepted more than the bonus token"


def test_tp2_every_rank_ran_the_plugin(tp2):
    config, server, _ = tp2
    log = server.log_text()
    assert_served_by_plugin(server, config.kernels())
    for kernel in config.kernels():
        ranks = ranks_that_ran(log, kernel)
        assert ranks == {str(r) for r in range(TP_SIZE)}, (kernel, ranks)
