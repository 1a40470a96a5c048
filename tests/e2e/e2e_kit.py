"""Helpers of the end-to-end tests (servers, requests); fixtures live in ``conftest.py``."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from sglang_dspark_plugin.harness.serving import SGLangServer, tiny_model_args  # noqa: F401

import served_log  # tests/ (on sys.path via tests/conftest.py)

MAX_TOKENS = 12
# Prompts of the per-configuration tests; all four are used by the concurrency test. Chosen for
# numerical robustness: along their 12 greedy tokens the float64 reference's top-1/top-2 logit
# gap never drops below ~0.25 (raw prompt) / ~0.2 (chat template), far above bf16 noise, so
# "speculative == non-speculative" cannot hinge on a near-tie. (Any prompt works; many have a
# near-tie somewhere, e.g. "Once upon a time" has a 0.05 gap at token 10.)
PROMPTS = [
    "To be or not to be",
    "def add(a, b):",
    "An apple a day",
    "The cat sat on the mat",
]
PER_CONFIG_PROMPTS = PROMPTS[:3]
STREAM_PROMPTS = PROMPTS[:2]
LOG_DIR = Path(os.environ.get("DSPARK_E2E_LOG_DIR", "/tmp/dspark-e2e-logs"))

# Every server this session started (for the no-orphan check and the timing summary).
STARTED: List["ServerRecord"] = []
# Speculation statistics per configuration (printed in the terminal summary, used in docs).
SPEC_STATS: Dict[str, List[dict]] = {}
# Names of the speculative configurations in the order the selected tests will use them
# (filled at collection time by conftest.py): lets the next server start while the current one
# is being tested.
SPEC_ORDER: List[str] = []


@dataclass
class ServerRecord:
    name: str
    pgid: Optional[int] = None
    startup_s: Optional[float] = None
    lifetime_s: Optional[float] = None
    log: str = ""
    error: str = ""


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class LaunchScriptServer(SGLangServer):
    """``examples/launch_server.sh`` (its own model and flags; ``args`` are appended) under the
    harness's start / health / stop handling. The harness adds no CPU flags or environment
    (``cpu=False``): the script must set up a CPU run itself."""

    def __init__(self, args, **kwargs):
        super().__init__(args, **dict(kwargs, cpu=False))
        for name in ("TRITON_INTERPRET", "SGLANG_DSPARK_CPU"):
            self.env.pop(name, None)
        self.env.update(PYTHON=sys.executable, PORT=str(self.port))

    @property
    def command(self):
        return ["bash", str(EXAMPLES / "launch_server.sh"), *self.args]


def make_server(name: str, args: List[str], env: Optional[Dict[str, str]] = None,
                server_cls=SGLangServer, **server_kwargs) -> SGLangServer:
    """A not yet started server, registered for the timing summary and the no-orphan check.
    ``server_kwargs`` go to ``server_cls`` (e.g. ``launcher="serve"`` for ``sglang serve``)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    record = ServerRecord(name=name, log=str(LOG_DIR / f"{name}.log"))
    STARTED.append(record)
    log_path = Path(record.log)
    log_path.unlink(missing_ok=True)
    server = server_cls(args, env=env, log_path=log_path, name=f"e2e:{name}", **server_kwargs)
    server._record = record
    return server


def start_server(
    name: str,
    args: List[str],
    env: Optional[Dict[str, str]] = None,
    server: Optional[SGLangServer] = None,
    **server_kwargs,
) -> SGLangServer:
    """Start a server (raises ``ServerStartError``, stopping it first); the caller must stop it.
    ``server_kwargs`` go to :func:`make_server`."""
    server = server or make_server(name, args, env, **server_kwargs)
    record = server._record
    server._t0 = time.monotonic()
    try:
        server.start()
    except BaseException as exc:
        record.pgid = server.pgid
        record.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        server.stop()
        raise
    record.pgid = server.pgid
    record.startup_s = server.startup_seconds
    return server


def assert_served_by_plugin(server: SGLangServer, kernels=()) -> None:
    served_log.assert_served_by_plugin(server.log_text(), kernels)


def assert_not_served_by_plugin(server: SGLangServer) -> None:
    served_log.assert_not_served_by_plugin(server.log_text())


def stop_server(server: SGLangServer) -> None:
    server.stop()
    record = getattr(server, "_record", None)
    if record is not None and getattr(server, "_t0", None) is not None:
        record.lifetime_s = time.monotonic() - server._t0


class Prefetcher:
    """Starts the *next* server in a background thread while the current one is under test.

    A server start is ~45-60 s of mostly single-threaded imports and model setup, while a server
    under test keeps about one core busy: on a 2-core machine overlapping the two saves most of
    a start per configuration. At most one server is prefetched at a time.
    ``DSPARK_E2E_PREFETCH=0`` turns it off (one server at a time, e.g. on a shared machine)."""

    def __init__(self):
        self._pending: Dict[str, tuple] = {}
        self.enabled = os.environ.get("DSPARK_E2E_PREFETCH", "1") != "0"

    def start(self, name: str, args: List[str], env: Optional[Dict[str, str]] = None, **server_kwargs) -> None:
        if name in self._pending or not self.enabled:
            return
        server = make_server(name, args, env, **server_kwargs)
        holder: dict = {}

        def run():
            try:
                start_server(name, args, env, server=server)
            except BaseException as exc:  # re-raised by take()
                holder["error"] = exc

        thread = threading.Thread(target=run, name=f"prefetch-{name}", daemon=True)
        thread.start()
        self._pending[name] = (thread, server, holder)

    def take(self, name: str, args: List[str], env: Optional[Dict[str, str]] = None, **server_kwargs) -> SGLangServer:
        """The prefetched server ``name`` (waiting for its start), or a fresh start."""
        if name not in self._pending:
            return start_server(name, args, env, **server_kwargs)
        thread, server, holder = self._pending.pop(name)
        thread.join()
        if "error" in holder:
            raise holder["error"]
        return server

    def close(self) -> None:
        """Stop prefetched servers nobody took (e.g. after ``-x`` ended the session), at once,
        even mid-startup (the starting thread then sees the stop and ends)."""
        for thread, server, _ in self._pending.values():
            stop_server(server)
            thread.join(timeout=60)
        self._pending.clear()


PREFETCH = Prefetcher()
# Speculative configurations by name (filled at collection time) for prefetching.
SPEC_CONFIGS_BY_NAME: Dict[str, object] = {}


def prefetch_spec_server(index: int) -> None:
    """Start the ``index``-th speculative server of this session in the background."""
    if 0 <= index < len(SPEC_ORDER):  # (skipped configurations are not in SPEC_ORDER)
        config = SPEC_CONFIGS_BY_NAME[SPEC_ORDER[index]]
        PREFETCH.start(config.name, config.args(), env=config.env(), **config.server_kwargs())


def next_param(session, fixture: str, current=None, module=None):
    """The parameter of the module-scoped ``fixture`` that this session's tests use after
    ``current`` (the first one when ``current`` is None; None when there is none). A parametrized
    server fixture starts that server in the background (``PREFETCH``) while the tests of the
    current one run; ``-k`` selections, collection-time skips and pytest's ordering are taken into
    account. ``module`` (the fixture's test module) keeps out other modules' fixtures of the same
    name."""
    order = []  # the fixture's parameters in the order the session's tests use them
    for item in session.items:
        if module is not None and getattr(item, "module", None) is not module:
            continue
        if item.get_closest_marker("skip"):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if fixture in params and params[fixture] not in order:
            order.append(params[fixture])
    following = order if current is None else order[order.index(current) + 1:] if current in order else []
    return following[0] if following else None


# ----------------------------------------------------------------------------------------------
# Requests
# ----------------------------------------------------------------------------------------------


def openai_client(server: SGLangServer):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", timeout=600, max_retries=0)


def model_name(server: SGLangServer) -> str:
    return server.get_json("/v1/models")["data"][0]["id"]


def generate(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    return server.post_json(
        "/generate",
        {"text": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}},
    )


def all_at_once(server: SGLangServer, jobs, max_tokens: int = MAX_TOKENS) -> List[dict]:
    """``jobs``: ``(request function, prompt)`` pairs (``generate``, ``completion``, ``chat``), all
    sent at once; their results in order."""
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(fn, server, prompt, max_tokens) for fn, prompt in jobs]
        return [f.result(timeout=900) for f in futures]


def generate_all_at_once(server: SGLangServer, prompts=PROMPTS) -> Dict[str, dict]:
    """/generate for every prompt, all sent at once (one batch when they fit the running limit)."""
    return dict(zip(prompts, all_at_once(server, [(generate, p) for p in prompts])))


def completion(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    resp = openai_client(server).completions.create(
        model=model_name(server), prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return {
        "text": resp.choices[0].text,
        "finish_reason": resp.choices[0].finish_reason,
        "completion_tokens": resp.usage.completion_tokens,
    }


def chat(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    resp = openai_client(server).chat.completions.create(
        model=model_name(server),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return {
        "text": resp.choices[0].message.content,
        "finish_reason": resp.choices[0].finish_reason,
        "completion_tokens": resp.usage.completion_tokens,
    }


def completion_stream(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    stream = openai_client(server).completions.create(
        model=model_name(server), prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    pieces, finish, chunks = [], None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            pieces.append(chunk.choices[0].text or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"text": "".join(pieces), "finish_reason": finish, "chunks": chunks}


def chat_stream(server: SGLangServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    stream = openai_client(server).chat.completions.create(
        model=model_name(server),
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
    )
    pieces, finish, chunks = [], None, 0
    for chunk in stream:
        chunks += 1
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return {"text": "".join(pieces), "finish_reason": finish, "chunks": chunks}


def raw_post(server: SGLangServer, path: str, payload: dict, timeout: float = 300.0):
    """POST without raising on HTTP errors: returns (status, decoded body or text)."""
    req = urllib.request.Request(
        server.base_url + path,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, body = err.code, err.read()
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body.decode(errors="replace")




def speculation_row(prompt: str, meta: dict) -> dict:
    """A /generate response's speculation statistics (a row of the terminal summary)."""
    return dict(
        prompt=prompt,
        verify_ct=meta.get("spec_verify_ct", 0),
        accept_length=meta.get("spec_accept_length", 0.0),
        correct=meta.get("spec_num_correct_drafts"),
        proposed=meta.get("spec_num_proposed_drafts"),
        histogram=meta.get("spec_correct_drafts_histogram"),
    )


def assert_speculation_consistent(meta: dict, gamma: int, max_tokens: int = MAX_TOKENS) -> int:
    """A speculative /generate response's meta_info reports verify steps and a consistent
    accepted-draft histogram; returns its verify steps that accepted a draft token (more than the
    bonus token)."""
    verify_ct = meta.get("spec_verify_ct", 0)
    assert verify_ct >= 1, f"no verify step reported: {meta}"
    hist = meta.get("spec_correct_drafts_histogram") or []
    assert len(hist) <= gamma + 1, meta
    assert sum(hist) == verify_ct, meta  # one histogram entry per verify step
    assert meta["spec_num_correct_drafts"] == sum(i * n for i, n in enumerate(hist)), meta
    assert meta["spec_num_proposed_drafts"] == verify_ct * gamma, meta
    # every verify step commits its accepted drafts + 1 bonus token and the prefill one more, until
    # max_tokens are reached: the last step may accept up to gamma drafts past them (SGLang counts
    # them, then cuts the output)
    committed = 1 + verify_ct + meta["spec_num_correct_drafts"]
    assert max_tokens <= committed <= max_tokens + gamma, meta
    assert abs(meta["spec_accept_length"] - max_tokens / verify_ct) < 1e-6, meta
    return sum(hist[1:])


@dataclass
class Baseline:
    generate: Dict[str, dict] = field(default_factory=dict)  # prompt -> /generate response
    completion: Dict[str, dict] = field(default_factory=dict)
    chat: Dict[str, dict] = field(default_factory=dict)
