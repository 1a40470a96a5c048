"""Radix-cache prefix hits on states the plugin committed, served (track snapshots and
prefix-cache copies stay lossless).

SGLang's default Mamba radix cache for Kimi models, ``extra_buffer``, keeps a request's recurrent
state at every multiple of the track grid (here 64 tokens) that its decode crosses: the DSPARK
commit writes it into a track slot (the plugin's ``replayssm_fold`` or, under the lazy record ring,
``materialize_records`` over the pending records; SGLang's own commit from the verify's snapshots
in snapshot mode; SGLang's decode track after the plugin's decode kernel). When the request
finishes, that state goes into the radix tree, and a later request that shares the sequence's
first 64 tokens (a branch of the conversation: another reply, an edited message) starts from a
copy of it instead of its own prefill. Nothing else in the CPU suite reaches that state
(``cpu_flags`` picks ``no_buffer``, whose finished requests are never hit below 64 tokens).
With ``extra_buffer`` SGLang's overlap scheduler runs, as in a GPU deployment (``no_buffer``
excludes it), so these are also the CPU suite's only servers with the overlap scheduler: the
next batch is scheduled while the current one runs, and the lazy ring's commits and cursor resets
meet it here.

Each conversation: turn 1, a 56-token prompt and 16 generated tokens (the decode crosses token
64, mid-ring for the lazy ring's records); then a branch, turn 1's first 64 tokens (prompt and 8
generated) and one new token, 12 generated. Three conversations at once per turn. The branch
prefills a single token on the cached state, so the state decides its output: the tiny model's
KDA forgets a state within ~10 tokens (per-token decays of e^-0.35 to e^-0.7), and a longer
prefill after the hit would hide a wrong state.
The oracle is the float64 forward of the model definition (``tiny_models.ReferenceTarget``), on
conversations whose greedy continuations keep a top-1/top-2 logit margin of at least
``MIN_MARGIN`` at every generated token of both requests, so bf16 rounding cannot flip a token.
Checked per configuration: both requests equal the reference token for token; every branch
reports 64 cached tokens, i.e. it started from the state that turn 1's decode committed; the
configuration's kernels ran and nothing fell back. Needs device gates 7 and 8 on CPU
(``harness/cpu_support.py``); unchanged on a GPU.

What it catches is the wiring: the plugin's commit writes the track slot that SGLang caches and
copies (a zeroed track state fails it). Small errors in the state's values flip no token of the
tiny model (the mutations run against it: docs/guide/cpu-testing.md, "The e2e tests"); those
values are checked against a float64 run in ``tests/test_backend.py::test_lazy_record_ring_through_sglang`` and
the kernel tests.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest

from sglang_dspark_plugin.harness import tiny_models
from sglang_dspark_plugin.harness.serving import tiny_model_args

from e2e_kit import PREFETCH, assert_served_by_plugin, next_param, stop_server

pytestmark = pytest.mark.e2e

TRACK_INTERVAL = 64  # --mamba-track-interval; the tiny model's Mamba cache chunk is 64 as well
PROMPT_LEN = 56
TURN1_TOKENS = 16  # 56 + 16 = 72: the turn-1 decode crosses the track point 64
NEW_TOKENS = 1  # the branch: turn 1's first TRACK_INTERVAL tokens and these
BRANCH_TOKENS = 12
CONVERSATIONS = 3
MIN_MARGIN = 0.2  # logits, float64 reference, every generated token of both turns
SEED = 20261205


@dataclass(frozen=True)
class Config:
    gamma: Optional[int]
    replayssm: bool
    env: Dict[str, str]
    kernels: List[str]  # first-use log lines that must appear
    mark: Optional[str] = None  # a log line that must appear


LAZY_ON = {"SGLANG_DSPARK_LAZY_RECORDS": "1"}
LAZY_OFF = {"SGLANG_DSPARK_LAZY_RECORDS": "0"}
CONFIGS = {
    # the lazy record ring: the track slot's state is materialised from checkpoint + records
    "g3-lazy-radix": Config(3, True, LAZY_ON, ["mtp_verify (ring, lazy records)", "lazy records commit"],
                            "dspark: lazy record ring on"),
    # ReplaySSM folding every commit: the fold writes the track slot
    "g3-fold-radix": Config(3, True, LAZY_OFF, ["mtp_verify (ring)", "replayssm_fold"],
                            "dspark: lazy record ring off"),
    # snapshot mode: SGLang's commit copies the tracked step from the verify's snapshots
    "g3-snapshot-radix": Config(3, False, {}, ["mtp_verify (snapshot)"]),
    # no speculation: the plugin's decode kernel, SGLang's decode track
    "decode-radix": Config(None, False, {}, ["decode"]),
}


@dataclass
class Conversation:
    prompt: List[int]
    turn1: List[int]  # the reference's greedy continuation
    new: List[int]
    branch: List[int]  # the reference's greedy continuation of branch_prompt
    min_margin: float

    @property
    def branch_prompt(self) -> List[int]:
        return (self.prompt + self.turn1)[:TRACK_INTERVAL] + self.new


@pytest.fixture(scope="module")
def conversations() -> List[Conversation]:
    """The first ``CONVERSATIONS`` seeded random conversations whose float64 greedy continuations
    keep ``MIN_MARGIN`` at every token of both requests."""
    import torch
    from safetensors.torch import load_file

    model_dir = tiny_models.default_out_dir() / tiny_models.TINY.target_dir
    tiny_models.ensure_models(tiny_models.TINY, tiny_models.default_out_dir())
    ref = tiny_models.ReferenceTarget(load_file(str(model_dir / tiny_models.WEIGHTS_FILE)), tiny_models.TINY)
    emittable = tiny_models.emittable_tokens().nonzero().flatten()
    gen = torch.Generator().manual_seed(SEED)
    out: List[Conversation] = []
    for _ in range(4):
        prompts = emittable[torch.randint(len(emittable), (64, PROMPT_LEN), generator=gen)]
        new = emittable[torch.randint(len(emittable), (64, NEW_TOKENS), generator=gen)]
        with torch.no_grad():
            turn1, m1 = ref.greedy(prompts, TURN1_TOKENS)
            shared = torch.cat([prompts, turn1], 1)[:, :TRACK_INTERVAL]
            branch, m2 = ref.greedy(torch.cat([shared, new], 1), BRANCH_TOKENS)
        margin = torch.minimum(m1.min(1).values, m2.min(1).values)
        for row in (margin >= MIN_MARGIN).nonzero().flatten().tolist():
            out.append(Conversation(prompts[row].tolist(), turn1[row].tolist(), new[row].tolist(),
                                    branch[row].tolist(), float(margin[row])))
            if len(out) == CONVERSATIONS:
                return out
    raise RuntimeError(f"only {len(out)} conversations keep a margin of {MIN_MARGIN}")


def _generate_all(server, prompts: List[List[int]], max_tokens: int) -> List[dict]:
    """/generate of token-id prompts, all sent at once."""

    def one(ids):
        return server.post_json("/generate", {"input_ids": ids,
                                              "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}})

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return [f.result(timeout=900) for f in [pool.submit(one, p) for p in prompts]]


def _server_args(name: str) -> List[str]:
    config = CONFIGS[name]
    extra = ["--mamba-radix-cache-strategy", "extra_buffer", "--mamba-track-interval", str(TRACK_INTERVAL)]
    return tiny_model_args(config.gamma, attention_backend="dspark", replayssm=config.replayssm, extra=extra)


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, conversations):
    """One server per configuration with the ``extra_buffer`` radix cache: turn 1 of every
    conversation at once, then every conversation's branch at once. The next configuration's
    server starts meanwhile."""
    server = PREFETCH.take(request.param, _server_args(request.param), env=CONFIGS[request.param].env)
    config = CONFIGS[request.param]
    try:
        following = next_param(request.session, "served", request.param, module=request.module)
        if following:
            PREFETCH.start(following, _server_args(following), env=CONFIGS[following].env)
        turn1 = _generate_all(server, [c.prompt for c in conversations], TURN1_TOKENS)
        branch = _generate_all(server, [c.branch_prompt for c in conversations], BRANCH_TOKENS)
        yield config, server, turn1, branch
    finally:
        stop_server(server)


def test_turn_one_matches_the_reference(served, conversations):
    _, _, turn1, _ = served
    for conv, out in zip(conversations, turn1):
        assert out["output_ids"] == conv.turn1, conv.min_margin


def test_branch_starts_from_the_decode_committed_state(served):
    """A radix hit past the prompt of turn 1: the state came from turn 1's decode."""
    _, _, _, branch = served
    cached = [out["meta_info"]["cached_tokens"] for out in branch]
    assert cached == [TRACK_INTERVAL] * CONVERSATIONS, cached


def test_branch_from_the_cached_state_matches_the_reference(served, conversations):
    _, _, _, branch = served
    for conv, out in zip(conversations, branch):
        assert out["output_ids"] == conv.branch, conv.min_margin


def test_served_by_the_plugin_kernels_with_the_overlap_scheduler(served):
    config, server, _, _ = served
    assert_served_by_plugin(server, config.kernels)
    log = server.log_text()
    if config.mark:
        assert config.mark in log
    assert "'disable_overlap_schedule': False" in log  # SGLang's server_args line
