"""Retract and resume under the lazy record ring, served (issue 15's correctness list).

With the lazy record ring a slot's pool state is a checkpoint plus pending records of accepted
tokens. When SGLang retracts a running request (KV pool full) it frees the request's slots with
their pending records and later re-prefills the request, prompt plus the tokens generated so far,
into a fresh slot. The output must not change.

``SGLANG_TEST_RETRACT=1`` is SGLang's own switch for this: the scheduler retracts decode
requests every third forward step (``scheduler.py``, "Testing retraction"), so requests are
retracted mid-ring and resumed several times per request. One server, DSPARK gamma 3, ReplaySSM
ring 8 with the lazy record ring on (``--disable-radix-cache``, as in ``g3-compact-lazy``).
Checked: the four prompts sent at once give ``/generate`` output ids equal to stock SGLang's
(the session's baseline, no speculation, no retraction); SGLang reports retractions in
``meta_info`` and logs them; the lazy kernels ran and nothing fell back.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_dspark_plugin.harness.serving import tiny_model_args

from e2e_kit import MAX_TOKENS, PROMPTS, assert_served_by_plugin, generate, start_server, stop_server

pytestmark = pytest.mark.e2e

LAZY_KERNELS = ["mtp_verify (ring, lazy records)", "lazy records commit"]


@pytest.fixture(scope="module")
def retracting(baseline):
    args = tiny_model_args(3, attention_backend="dspark", replayssm=True, extra=["--disable-radix-cache"])
    server = start_server("g3-lazy-retract", args, env={"SGLANG_TEST_RETRACT": "1"})
    try:
        with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
            futures = {p: pool.submit(generate, server, p) for p in PROMPTS}
            results = {p: f.result(timeout=900) for p, f in futures.items()}
        yield server, results
    finally:
        stop_server(server)


def test_retracted_requests_resume_lossless(retracting, baseline):
    server, results = retracting
    for prompt, out in results.items():
        assert out["output_ids"] == baseline.generate[prompt]["output_ids"], prompt
        assert out["meta_info"]["completion_tokens"] == MAX_TOKENS


def test_requests_were_retracted_under_the_lazy_ring(retracting):
    server, results = retracting
    retractions = sum(out["meta_info"].get("num_retractions", 0) for out in results.values())
    assert retractions >= 1, {p: out["meta_info"] for p, out in results.items()}
    log = server.log_text()
    assert "Testing retraction" in log
    assert "dspark: lazy record ring on" in log
    assert_served_by_plugin(server, LAZY_KERNELS)
