"""Shared pieces of the end-to-end tests: real ``sglang.launch_server`` processes on the bundled
tiny Kimi-Linear (``sglang_dspark_plugin.tiny_models``), started through
``sglang_dspark_plugin.serving`` (own process group, always stopped).

Cost model (2-core CPU machine, Triton interpreter): a server start is ~45-75 s, a greedy
12-token request ~4-10 s. So servers are shared: the baseline (no speculation) runs once per
session, computes every expected output and is stopped before the speculative servers start;
each speculative configuration is one module-scoped server that all its tests share. Only one
server runs at a time.
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")
pytest.importorskip("openai")

from e2e_kit import (  # noqa: E402
    MAX_TOKENS,
    PROMPTS,
    STARTED,
    Baseline,
    chat,
    completion,
    generate,
    start_server,
    stop_server,
    tiny_model_args,
)


# ----------------------------------------------------------------------------------------------
# Baseline (no speculation), computed once
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def baseline() -> Baseline:
    """Greedy outputs of the non-speculative server for every prompt and API.

    This server also uses ``--attention-backend dspark`` (MLA layers on the delegate backend,
    KDA layers on the plugin's backend, plain DECODE steps): the speculative servers are compared
    against the plugin's own non-speculative path."""
    server = start_server("baseline", tiny_model_args(None, attention_backend="dspark"))
    try:
        out = Baseline()
        for prompt in PROMPTS:
            out.generate[prompt] = generate(server, prompt)
            out.completion[prompt] = completion(server, prompt)
            out.chat[prompt] = chat(server, prompt)
    finally:
        stop_server(server)
    for prompt in PROMPTS:
        # Sanity of the tiny model itself: full-length, context-dependent outputs.
        assert out.generate[prompt]["meta_info"]["completion_tokens"] == MAX_TOKENS
        assert out.completion[prompt]["text"] == out.generate[prompt]["text"]
    assert len({tuple(out.generate[p]["output_ids"]) for p in PROMPTS}) == len(PROMPTS)
    return out


def pytest_terminal_summary(terminalreporter):
    if not STARTED:
        return
    tr = terminalreporter
    tr.section("dspark e2e servers")
    for rec in STARTED:
        startup = f"{rec.startup_s:.0f} s" if rec.startup_s is not None else "-"
        life = f"{rec.lifetime_s:.0f} s" if rec.lifetime_s is not None else "-"
        note = f"  ERROR: {rec.error}" if rec.error else ""
        tr.write_line(f"{rec.name:28s} startup {startup:>6s}  up {life:>6s}  log {rec.log}{note}")
