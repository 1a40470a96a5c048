"""Shared pieces of the end-to-end tests: real ``sglang.launch_server`` processes on the bundled
tiny Kimi-Linear (``sglang_dspark_plugin.harness.tiny_models``), started through
``sglang_dspark_plugin.harness.serving`` (own process group, always stopped).

Cost model (2-core CPU machine, Triton interpreter): a server start is ~45-75 s, a greedy
12-token request ~4-10 s. So servers are shared: the baseline (no speculation) runs once per
session, computes every expected output and is stopped before the speculative servers start;
each configuration is one module-scoped server that all its tests share, and the next one
starts in the background meanwhile (``PREFETCH``, ``e2e_kit.next_param``).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang")
pytest.importorskip("openai")

from e2e_kit import (  # noqa: E402
    MAX_TOKENS,
    PREFETCH,
    PROMPTS,
    SPEC_CONFIGS_BY_NAME,
    SPEC_ORDER,
    SPEC_STATS,
    STARTED,
    Baseline,
    assert_not_served_by_plugin,
    chat,
    completion,
    generate,
    prefetch_spec_server,
    start_server,
    stop_server,
    tiny_model_args,
)


# ----------------------------------------------------------------------------------------------
# Baseline (no speculation), computed once
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def baseline() -> Baseline:
    """Greedy outputs of **stock SGLang** without speculation for every prompt and API.

    ``--attention-backend triton``: SGLang's own MLA backend and KDA kernels, so a bug shared by
    the plugin's decode and verify paths cannot hide in the baseline. Every configuration (the
    plugin's plain decode included) is compared against it."""
    server = start_server("baseline", tiny_model_args(None, attention_backend="triton"))
    prefetch_spec_server(0)
    try:
        out = Baseline()
        for prompt in PROMPTS:
            out.generate[prompt] = generate(server, prompt)
            out.completion[prompt] = completion(server, prompt)
            out.chat[prompt] = chat(server, prompt)
        assert_not_served_by_plugin(server)
    finally:
        stop_server(server)
    for prompt in PROMPTS:
        # Sanity of the tiny model itself: full-length, context-dependent outputs.
        assert out.generate[prompt]["meta_info"]["completion_tokens"] == MAX_TOKENS
        assert out.completion[prompt]["text"] == out.generate[prompt]["text"]
    assert len({tuple(out.generate[p]["output_ids"]) for p in PROMPTS}) == len(PROMPTS)
    return out


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Record the order in which the (already regrouped) tests use the speculative servers, and
    skip the configurations this machine cannot run (with the reason)."""
    SPEC_ORDER.clear()
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:  # (the hook sees the whole session's items: only this folder's are ours)
        if not str(item.fspath).startswith(here):
            continue
        callspec = getattr(item, "callspec", None)
        config = callspec.params.get("spec") if callspec else None
        if config is None:
            continue
        reason = config.skip_reason()
        if reason:  # skip at collection: no server (not even the baseline) starts for it
            item.add_marker(pytest.mark.skip(reason=reason))
        elif config.name not in SPEC_ORDER:
            SPEC_ORDER.append(config.name)
            SPEC_CONFIGS_BY_NAME[config.name] = config


@pytest.fixture(scope="session", autouse=True)
def _stop_prefetched_servers():
    yield
    PREFETCH.close()


def pytest_terminal_summary(terminalreporter):
    if not STARTED:
        return
    tr = terminalreporter
    if SPEC_STATS:
        tr.section("dspark e2e speculation (greedy /generate, max_tokens=%d)" % MAX_TOKENS)
        for name, rows in SPEC_STATS.items():
            for row in rows:
                tr.write_line(
                    f"{name:22s} {row['prompt'][:24]!r:28s} verify steps {row['verify_ct']:2d}  "
                    f"accept length {row['accept_length']:.2f}  accepted drafts "
                    f"{row['correct']}/{row['proposed']}  histogram {row['histogram']}"
                )
    tr.section("dspark e2e servers")
    for rec in STARTED:
        startup = f"{rec.startup_s:.0f} s" if rec.startup_s is not None else "-"
        life = f"{rec.lifetime_s:.0f} s" if rec.lifetime_s is not None else "-"
        note = f"  ERROR: {rec.error}" if rec.error else ""
        tr.write_line(f"{rec.name:28s} startup {startup:>6s}  up {life:>6s}  log {rec.log}{note}")
