"""Retract and resume under the lazy record ring and the buffered decode, served.

With the lazy record ring (and with SGLang's decode ring, where the plugin's buffered decode runs)
a slot's pool state is a checkpoint plus pending records of accepted tokens. When SGLang retracts a running request (KV pool full) it frees the request's slots with
their pending records and later re-prefills the request, prompt plus the tokens generated so far,
into a fresh slot. The output must not change.

``SGLANG_TEST_RETRACT=1`` is SGLang's own switch for this: the scheduler retracts decode
requests every third forward step (``scheduler.py``, "Testing retraction"), so requests are
retracted mid-ring and resumed several times per request. Two servers: DSPARK gamma 3, ReplaySSM
ring 8 with the lazy record ring on (``--disable-radix-cache``, as in ``g3-compact-lazy``); plain
decode in SGLang's decode ring (``--enable-linear-replayssm``, ring 4) on the plugin's buffered
decode. Checked: the four prompts sent at once give ``/generate`` output ids equal to stock
SGLang's (the session's baseline, no speculation, no retraction); SGLang reports retractions in
``meta_info`` and logs them; the configuration's kernels ran and nothing fell back.
"""

from __future__ import annotations

import pytest

from sglang_dspark_plugin.harness.serving import tiny_model_args

from e2e_kit import PREFETCH, MAX_TOKENS, assert_served_by_plugin, generate_all_at_once, next_param, stop_server

pytestmark = pytest.mark.e2e

# name: (gamma, replayssm, extra flags, kernels that must run, log line that must appear)
CONFIGS = {
    "g3-lazy-retract": (3, True, ["--disable-radix-cache"],
                        ["mtp_verify (ring, lazy records)", "lazy records commit"], "dspark: lazy record ring on"),
    "decode-ring-retract": (None, False, ["--enable-linear-replayssm", "--linear-replayssm-cache-len", "4"],
                            ["decode (buffered, factored)"], None),
}


ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_DSPARK_LAZY_RECORDS": "1"}


def _server_args(name):
    gamma, replayssm, extra, _, _ = CONFIGS[name]
    return tiny_model_args(gamma, attention_backend="dspark", replayssm=replayssm, extra=extra)


@pytest.fixture(scope="module", params=list(CONFIGS))
def retracting(request, baseline):
    _, _, _, kernels, mark = CONFIGS[request.param]
    server = PREFETCH.take(request.param, _server_args(request.param), env=ENV)
    try:
        following = next_param(request.session, "retracting", request.param, module=request.module)
        if following:  # started while this one serves
            PREFETCH.start(following, _server_args(following), env=ENV)
        results = generate_all_at_once(server)
        yield server, results, kernels, mark
    finally:
        stop_server(server)


def test_retracted_requests_resume_lossless(retracting, baseline):
    server, results, _, _ = retracting
    for prompt, out in results.items():
        assert out["output_ids"] == baseline.generate[prompt]["output_ids"], prompt
        assert out["meta_info"]["completion_tokens"] == MAX_TOKENS


def test_requests_were_retracted_with_pending_records(retracting):
    server, results, kernels, mark = retracting
    retractions = sum(out["meta_info"].get("num_retractions", 0) for out in results.values())
    assert retractions >= 1, {p: out["meta_info"] for p, out in results.items()}
    log = server.log_text()
    assert "Testing retraction" in log
    if mark:
        assert mark in log
    assert_served_by_plugin(server, kernels)
