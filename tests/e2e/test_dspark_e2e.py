"""End to end: ``python -m sglang.launch_server --attention-backend dspark --speculative-algorithm
DSPARK`` on the bundled tiny Kimi-Linear (1 KDA + 1 MLA layer) and its tiny DSPARK draft.

For each configuration below (one shared server per configuration: the plugin's plain decode and
the speculative configurations):

* greedy output == greedy output of **stock SGLang** without speculation (``--attention-backend
  triton``, SGLang's own KDA kernels), token for token (``/generate`` output ids) and text for text
  through ``/v1/completions``, ``/v1/chat/completions`` and both streaming variants;
* the plugin's kernels for the configuration ran (decode; verify; fold) and nothing fell back;
* speculation really ran: ``/generate`` meta_info reports verify steps, their accepted-draft
  histogram is consistent, and at least one verify step accepted a draft token (more than the
  bonus token);
* >= 4 concurrent requests (6: 4 completions + 2 chats, max 4 running), all lossless;
* (one configuration) requests the server must reject get a clean HTTP 4xx and the server keeps
  serving correctly.

The draft is built so that acceptance happens honestly (its Markov head encodes the target's own
one-token next-token function, see ``tiny_models.py`` and docs/guide/cpu-testing.md).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, Optional

import pytest

from sglang_dspark_plugin.harness.serving import ServerStartError, tiny_model_args
from sglang_dspark_plugin.harness.tiny_models import DRAFT_DIR, SPS_TABLE_FILE, default_out_dir
from sglang_dspark_plugin.settings import gpu_available

from served_log import assert_served_by_plugin as assert_served_by_plugin_log

from e2e_kit import (
    EXAMPLES,
    MAX_TOKENS,
    PER_CONFIG_PROMPTS,
    PREFETCH,
    PROMPTS,
    SPEC_ORDER,
    SPEC_STATS,
    STREAM_PROMPTS,
    LaunchScriptServer,
    all_at_once,
    assert_served_by_plugin,
    assert_speculation_consistent,
    chat,
    chat_stream,
    completion,
    completion_stream,
    generate,
    prefetch_spec_server,
    raw_post,
    speculation_row,
    start_server,
    stop_server,
)

pytestmark = pytest.mark.e2e


# Why compact mode with real ragged windows cannot run where the MLA layers use SGLang's Triton
# attention backend (the dspark backend's MLA delegate without a Hopper/Blackwell GPU, i.e. on
# CPU). Measured here, with the plugin and with stock --attention-backend triton alike.
RAGGED_BLOCKED_ON_TRITON_MLA = (
    "refused at startup with DSPARK-E004 (test_compact_ragged_refused_on_triton_mla): "
    "SGLang 0.5.23's triton attention backend (the MLA delegate here) builds TARGET_VERIFY "
    "metadata for dense [bs, gamma+1] windows only and ignores spec_info.ragged_verify_layout; "
    "when the compact scheduler picks windows shorter than gamma+1 (SPS cost table given), its "
    "extend_attention_fwd kernel indexes past the packed verify tokens: segfault / 'double free "
    "or corruption' under the Triton interpreter, also with stock --attention-backend triton. "
    "Compact is covered with full-length windows (g3-compact*); this configuration runs where the "
    "MLA delegate is fa3/flashinfer (Hopper/Blackwell GPUs)."
)


def mla_delegate() -> str:
    """The stock SGLang backend the dspark backend uses for the MLA layers in the servers."""
    override = os.environ.get("SGLANG_DSPARK_FULL_ATTN_BACKEND")
    if override:
        return override
    if not gpu_available():
        return "triton"
    from sglang_dspark_plugin.plugin import full_attention_delegate

    return full_attention_delegate()


@dataclass(frozen=True)
class SpecConfig:
    name: str
    gamma: Optional[int]  # --speculative-dspark-block-size; None: no speculation (plain decode)
    replayssm: bool  # --enable-linear-replayssm-spec (ring length: smallest power of 2 >= 2(gamma+1))
    ragged_mode: str = "static"  # SGLANG_RAGGED_VERIFY_MODE
    sps_table: bool = False  # --speculative-dspark-sps-table-path: compact picks short windows
    bad_input: bool = False
    decode_ring: bool = False  # --enable-linear-replayssm (plain decode through SGLang's decode ring)
    lazy: bool = False  # the lazy record ring (--disable-radix-cache makes it safe on CPU); else every commit folds
    buffered_decode: Optional[str] = None  # SGLANG_DSPARK_BUFFERED_DECODE (decode ring); None = factored
    # how the server starts: "launch_server"; "serve": SGLang's CLI, ``sglang serve``; "example":
    # ``examples/launch_server.sh`` (its own flags: the tiny model, dspark, DSPARK, snapshot commit)
    launcher: str = "launch_server"

    def args(self):
        if self.launcher == "example":
            return []
        extra = ["--disable-radix-cache"] if self.lazy else []
        if self.sps_table:
            table = default_out_dir() / DRAFT_DIR / SPS_TABLE_FILE
            extra += ["--speculative-dspark-sps-table-path", str(table)]
        if self.decode_ring:  # L = 4: a flush every 4th token, two dozen per request
            extra = ["--enable-linear-replayssm", "--linear-replayssm-cache-len", "4"]
        return tiny_model_args(self.gamma, attention_backend="dspark", replayssm=self.replayssm, extra=extra)

    def env(self):
        env = {"SGLANG_RAGGED_VERIFY_MODE": self.ragged_mode}
        env["SGLANG_DSPARK_LAZY_RECORDS"] = "1" if self.lazy else "0"  # say which commit runs
        if self.buffered_decode is not None:
            env["SGLANG_DSPARK_BUFFERED_DECODE"] = self.buffered_decode
        if self.launcher == "example":
            env["GAMMA"] = str(self.gamma)  # the script's block size
        return env

    def server_kwargs(self):
        if self.launcher == "example":
            return {"server_cls": LaunchScriptServer}
        return {"launcher": self.launcher}

    def kernels(self):
        """The plugin kernels this configuration must run (their first-use log lines)."""
        if self.gamma is None:
            return [f"decode (buffered, {self.buffered_decode or 'factored'})"] if self.decode_ring else ["decode"]
        if self.lazy:
            return ["mtp_verify (ring, lazy records)", "lazy records commit"]
        return ["mtp_verify (ring)", "replayssm_fold"] if self.replayssm else ["mtp_verify (snapshot)"]

    def skip_reason(self) -> Optional[str]:
        if self.sps_table and mla_delegate() == "triton":
            return RAGGED_BLOCKED_ON_TRITON_MLA
        return None


CONFIGS = [
    # the plugin's plain decode kernel, no speculation
    SpecConfig("decode", gamma=None, replayssm=False),
    # the plugin's buffered decode in SGLang's decode ring (--enable-linear-replayssm)
    SpecConfig("decode-ring", gamma=None, replayssm=False, decode_ring=True),
    # the same with the buffered decode that forms the state every step (SGLANG_DSPARK_BUFFERED_DECODE=rows)
    SpecConfig("decode-ring-rows", gamma=None, replayssm=False, decode_ring=True, buffered_decode="rows"),
    # started by examples/launch_server.sh (test_example_launch_script_and_openai_client)
    SpecConfig("g3-static", gamma=3, replayssm=False, bad_input=True, launcher="example"),
    SpecConfig("g1-static", gamma=1, replayssm=False),
    # served through ``sglang serve`` (SGLang's CLI; the others through launch_server)
    SpecConfig("g3-static-replayssm", gamma=3, replayssm=True, launcher="serve"),
    # the lazy record ring (no fold per commit): turned on, here with the radix cache off
    SpecConfig("g1-static-lazy", gamma=1, replayssm=True, lazy=True),
    # compact = per-request ragged verify windows chosen by the confidence scheduler (needs the
    # draft's confidence head, which the tiny draft has).
    SpecConfig("g3-compact-lazy", gamma=3, replayssm=True, ragged_mode="compact", lazy=True),
    SpecConfig("g3-compact", gamma=3, replayssm=False, ragged_mode="compact"),
    # compact with real ragged windows (shorter than gamma+1), chosen from an SPS cost table.
    SpecConfig("g3-compact-ragged-replayssm", gamma=3, replayssm=True, ragged_mode="compact", sps_table=True),
]


class SpecServer:
    def __init__(self, config: SpecConfig, server):
        self.config = config
        self.server = server
        self._generate: Optional[Dict[str, dict]] = None
        self._api: Optional[Dict[tuple, dict]] = None

    def generate_results(self) -> Dict[str, dict]:
        """/generate for every per-config prompt, one request at a time, computed once per server."""
        if self._generate is None:
            self._generate = {p: generate(self.server, p) for p in PER_CONFIG_PROMPTS}
        return self._generate

    def api_results(self) -> Dict[tuple, dict]:
        """The OpenAI requests of this module's tests, keyed ``(function name, prompt)``, sent all
        at once and computed once per server: completions of every prompt and chats of two (the
        concurrent test), and on speculative configurations also the chats of the per-config
        prompts and the streamed completions and chats (the API-variant tests). One burst instead
        of a request at a time: the server batches them (CI time); each still meets its own
        assertions, against the baseline's one-at-a-time outputs."""
        if self._api is None:
            jobs = [(completion, p) for p in PROMPTS] + [(chat, p) for p in PROMPTS[:2]]
            if self.config.gamma is not None:
                jobs += [(chat, p) for p in PER_CONFIG_PROMPTS if (chat, p) not in jobs]
                jobs += [(fn, p) for fn in (completion_stream, chat_stream) for p in STREAM_PROMPTS]
            results = all_at_once(self.server, jobs)
            self._api = {(fn.__name__, p): out for (fn, p), out in zip(jobs, results)}
        return self._api


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda c: c.name)
def spec(request):
    """One speculative server per configuration, shared by the module's tests, always stopped.
    The baseline outputs are computed first (that server is stopped by then)."""
    config: SpecConfig = request.param
    if config.skip_reason():
        pytest.skip(config.skip_reason())
    request.getfixturevalue("baseline")
    # Every configuration that reaches this point must start: the one expected refusal (DSPARK-E004,
    # ragged windows on the triton MLA delegate) is skipped above by skip_reason() and checked by
    # test_compact_ragged_refused_on_triton_mla; any other startup failure, whatever its text, fails.
    server = PREFETCH.take(config.name, config.args(), env=config.env(), **config.server_kwargs())
    if config.name in SPEC_ORDER:  # start the next configuration's server meanwhile
        prefetch_spec_server(SPEC_ORDER.index(config.name) + 1)
    try:
        yield SpecServer(config, server)
    finally:
        stop_server(server)


def test_generate_lossless_token_for_token(spec, baseline):
    for prompt, out in spec.generate_results().items():
        expected = baseline.generate[prompt]
        assert out["output_ids"] == expected["output_ids"], prompt
        assert out["text"] == expected["text"], prompt
        assert out["meta_info"]["completion_tokens"] == MAX_TOKENS


def test_speculation_exercised(spec):
    gamma = spec.config.gamma
    if gamma is None:
        pytest.skip("no speculation in this configuration")
    accepted_any = 0
    shortest_window = gamma + 1
    rows = SPEC_STATS.setdefault(spec.config.name, [])
    rows.clear()
    for prompt, out in spec.generate_results().items():
        meta = out["meta_info"]
        rows.append(speculation_row(prompt, meta))
        accepted_any += assert_speculation_consistent(meta, gamma)
        if spec.config.ragged_mode != "static":
            assert "spec_cap_length" in meta, meta
        shortest_window = min(shortest_window, meta.get("spec_cap_length", gamma + 1))
    assert accepted_any >= 1, "no verify step accepted more than the bonus token"
    if spec.config.sps_table:
        # spec_cap_length = mean verify_lens per request; a mean below gamma means windows shorter
        # than full ones whether verify_lens counts the anchor or not
        assert shortest_window < gamma, "the compact scheduler never picked a short window"


def _skip_api_variants_without_speculation(spec) -> None:
    """The OpenAI / streaming variants differ from /generate only above the model (API parsing,
    chat template, detokenisation); with speculation they also change how tokens reach the
    client. Without speculation the concurrent test (completions + chats at once) covers the
    API side for these configurations, and /generate their KDA path (CI time)."""
    if spec.config.gamma is None:
        pytest.skip("API variants are checked on the speculative configurations and in the concurrent test")


def test_completions_lossless(spec, baseline):
    _skip_api_variants_without_speculation(spec)
    for prompt in PER_CONFIG_PROMPTS:
        out = spec.api_results()["completion", prompt]
        assert out == baseline.completion[prompt], prompt


def test_chat_completions_lossless(spec, baseline):
    _skip_api_variants_without_speculation(spec)
    for prompt in PER_CONFIG_PROMPTS:
        out = spec.api_results()["chat", prompt]
        assert out == baseline.chat[prompt], prompt


def test_streaming_lossless(spec, baseline):
    _skip_api_variants_without_speculation(spec)
    for prompt in STREAM_PROMPTS:
        out = spec.api_results()["completion_stream", prompt]
        assert out["text"] == baseline.completion[prompt]["text"], prompt
        assert out["finish_reason"] == "length"
        assert out["chunks"] >= 2  # really streamed
        out = spec.api_results()["chat_stream", prompt]
        assert out["text"] == baseline.chat[prompt]["text"], prompt
        assert out["finish_reason"] == "length"


def test_concurrent_requests_lossless(spec, baseline):
    """Every prompt's completion and two chats, among the other OpenAI requests, all at once."""
    results = spec.api_results()
    jobs = [("completion", p) for p in PROMPTS] + [("chat", p) for p in PROMPTS[:2]]
    assert len(jobs) >= 4 and len(results) >= len(jobs)
    for name, prompt in jobs:
        expected = (baseline.completion if name == "completion" else baseline.chat)[prompt]
        assert results[name, prompt] == expected, (name, prompt)


def test_served_by_the_plugin(spec):
    """The KDA layers ran on the plugin's kernels for the whole run (no fallback to SGLang's own
    KDA path was logged) and the MLA layers on the dspark backend's delegate."""
    spec.generate_results()  # at least the /generate requests have run on this server
    assert_served_by_plugin(spec.server, spec.config.kernels())


def _healthy_soon(server, seconds: float = 180.0) -> bool:
    """The server is alive and answers /health within ``seconds``.

    SGLang's /health generates one token and waits at least a second; under the Triton
    interpreter on a loaded 2-core machine that took longer than the launcher's 5 s probe once
    (this test failed with a live, correct server). A crash is still caught at once (``alive``),
    and the lossless request after the bad ones proves the server still serves correctly."""
    deadline = time.monotonic() + seconds
    while server.alive() and time.monotonic() < deadline:
        if server.healthy(timeout=60.0):
            return True
        time.sleep(1.0)
    return False


def test_rejects_bad_requests_and_keeps_serving(spec, baseline):
    if not spec.config.bad_input:
        pytest.skip("bad input is checked on g3-static only (CI time)")
    server = spec.server
    too_long = "the cat sat on the mat " * 200  # > 512-token context of the tiny model
    bad = [
        ("/v1/completions", {"model": "x", "prompt": too_long, "max_tokens": 4}),
        ("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": too_long}], "max_tokens": 4}),
        ("/v1/completions", {"model": "x", "prompt": "Hello", "max_tokens": 4, "temperature": -1}),
        ("/generate", {"text": too_long, "sampling_params": {"max_new_tokens": 4}}),
    ]
    for path, payload in bad:
        status, body = raw_post(server, path, payload)
        assert 400 <= status < 500, (path, status, body)
        assert _healthy_soon(server), f"server died or stopped answering after a bad request to {path}"
    # and it still serves, losslessly
    prompt = PER_CONFIG_PROMPTS[0]
    assert completion(server, prompt) == baseline.completion[prompt]


def test_sglang_serve_cli_serves_dspark(spec, baseline):
    """``sglang serve`` (SGLang's CLI, which loads the plugins itself after picking its LLM
    backend) with ``--attention-backend dspark`` and DSPARK speculation. It starts the server of
    ``g3-static-replayssm``, so every per-configuration test of this module (/generate, completions,
    chat, streaming, concurrency) runs through it there; here: the CLI started it, the plugin's
    verify and fold ran, nothing fell back, and /generate answers as stock SGLang."""
    if spec.config.launcher != "serve":
        pytest.skip("sglang serve starts g3-static-replayssm (the others: launch_server)")
    server = spec.server
    assert server.command[-len(server.args) - 1] == "serve"
    for prompt, out in spec.generate_results().items():
        assert out["output_ids"] == baseline.generate[prompt]["output_ids"], prompt
    assert_served_by_plugin(server, spec.config.kernels())


def _printed(out: str, label: str) -> str:
    """The text ``openai_client.py`` printed after ``label (<seconds> s): `` (a Python repr)."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith(label + " (")]
    return ast.literal_eval(line.split("): ", 1)[1])


def test_example_launch_script_and_openai_client(spec, baseline):
    """The examples run as their docstrings say: ``examples/launch_server.sh`` serves the tiny
    Kimi-Linear with ``--attention-backend dspark`` and DSPARK speculation (started with no CPU
    environment from the harness: on a machine without a GPU it sets up the CPU run itself). It
    starts the g3-static server, so every per-configuration test of this module runs on it; here
    ``examples/openai_client.py --base-url`` talks to it, and its chat and completion texts equal
    stock SGLang's."""
    if spec.config.launcher != "example":
        pytest.skip("examples/launch_server.sh starts g3-static")
    server = spec.server
    assert server.command[:2] == ["bash", str(EXAMPLES / "launch_server.sh")] and "TRITON_INTERPRET" not in server.env
    prompt = PROMPTS[0]
    client = subprocess.run(
        [sys.executable, str(EXAMPLES / "openai_client.py"), "--base-url", server.base_url + "/v1",
         "--prompt", prompt, "--max-tokens", str(MAX_TOKENS)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert client.returncode == 0, client.stdout[-2000:] + client.stderr[-2000:]
    assert _printed(client.stdout, "chat") == baseline.chat[prompt]["text"]
    assert _printed(client.stdout, "completion") == baseline.completion[prompt]["text"]
    assert_served_by_plugin(server, ["mtp_verify (snapshot)"])


# sglang.Engine in a fresh interpreter (it spawns its scheduler processes, which inherit the CPU
# environment): the prompts' greedy output ids as one JSON line.
ENGINE_SCRIPT = """
import json, sys
from sglang_dspark_plugin.harness.serving import tiny_engine_kwargs, tiny_model_args

def main():
    prompts, max_tokens = json.loads(sys.argv[1]), int(sys.argv[2])
    kwargs = tiny_engine_kwargs(tiny_model_args(3, attention_backend="dspark", replayssm=True))
    kwargs["log_level"] = "info"  # the Engine's default hides the plugin's kernel lines
    import sglang
    engine = sglang.Engine(**kwargs)
    try:
        outs = engine.generate(prompt=prompts, sampling_params={"max_new_tokens": max_tokens, "temperature": 0})
    finally:
        engine.shutdown()
    print("ENGINE " + json.dumps([o["output_ids"] for o in outs]), flush=True)

if __name__ == "__main__":
    main()
"""


def test_offline_engine_serves_dspark(baseline, tmp_path):
    """``sglang.Engine`` (in-process, no HTTP server) with ``attention_backend="dspark"`` and
    DSPARK speculation: greedy output ids equal stock SGLang's, and the plugin's kernels ran."""
    script = tmp_path / "engine_run.py"
    script.write_text(ENGINE_SCRIPT)
    prompts = PER_CONFIG_PROMPTS[:2]
    proc = subprocess.run([sys.executable, str(script), json.dumps(prompts), str(MAX_TOKENS)],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("ENGINE ")]
    for prompt, ids in zip(prompts, json.loads(line[len("ENGINE "):])):
        assert ids == baseline.generate[prompt]["output_ids"], prompt
    assert_served_by_plugin_log(log, ["mtp_verify (ring)", "replayssm_fold"])


def test_compact_ragged_refused_on_triton_mla():
    """Where the MLA delegate is SGLang's triton backend, the ragged configuration (compact + SPS
    table) fails at startup with DSPARK-E004 and its fix, instead of crashing the scheduler on the
    first short verify window (docs/guide/cpu-testing.md, "Not covered on CPU")."""
    if mla_delegate() != "triton":
        pytest.skip("the MLA delegate reads ragged verify layouts here; the configuration is served")
    config = next(c for c in CONFIGS if c.sps_table)
    try:
        server = start_server(config.name + "-refused", config.args(), env=config.env())
    except ServerStartError as exc:
        message = str(exc)
    else:
        stop_server(server)
        pytest.fail("the compact + SPS-table server started on the triton MLA delegate")
    assert "DSPARK-E004" in message, message[-2000:]
    assert "SGLANG_DSPARK_FULL_ATTN_BACKEND" in message
