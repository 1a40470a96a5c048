"""Soak: thousands of mixed requests against real SGLang servers, every completed output compared
with stock SGLang's, and the servers checked for errors, leaks and memory growth.

    python3 benchmarks/soak.py [--requests 2000] [--concurrency 128] [--out DIR]   (a GPU: kimi32)
    python3 benchmarks/soak.py --small [--out DIR]                                 (CPU: the tiny model)

The workload (:func:`make_workload`, seeded, the same for every server, sent in its order by
``--concurrency`` clients): prompts of 8-2,000 token ids and outputs of 1-512 tokens, both
log-uniform, greedy, ``ignore_eos``; 10 % streams the client closes mid-way (``drop``); 20 % prefix
branches (an earlier request's prompt cut at a random point, with a new tail: radix-cache hits);
1 % malformed requests (:data:`MALFORMED`, each must get an HTTP 4xx); the others plain
``/generate`` requests (``complete``). The servers keep a small mamba pool (``--mamba-slots``), so
SGLang caps the running requests well below the clients' concurrency: requests queue and every
state slot is handed out many times.

Servers (:data:`SERVERS`, started together, each measured alone while the others sleep):

* ``reference``: stock SGLang without speculation; it also returns its top-2 log-probabilities,
  so its tokens/s include that;
* ``control``: stock SGLang + DSPARK (gamma 3, ReplaySSM: SGLang's own speculation);
* ``control-g7``: the same at gamma 7;
* ``dspark-g3``: the plugin + DSPARK at gamma 3 (the lazy record ring: the server must log it on);
* ``dspark-g7``: the plugin + DSPARK at gamma 7 (every commit folds).

Judged per server (:func:`verdicts`): no HTTP 5xx and no failed request other than the clients'
own drops; every malformed request answered 4xx; the server alive and healthy after its run; no
leaked slots or tokens once idle (SGLang's ``/metrics``: no running or queued request, no used KV
token or mamba slot; SGLang's own idle check logged no "memory leak detected"); GPU memory flat
over the second half of the run (the server's processes, ``nvidia-smi``). Greedy outputs of the
speculative servers against the reference's, request by request (:func:`judge`): a divergence is
a near-tie only where the reference's top-2 log-probability gap at the first differing token is
within the bf16 spacing of the logits there (their magnitude from the float64 forward of the model
definition, ``ReferenceTarget``) and the server took the other of the reference's top two (at an
exact tie the reference's pick may be the one it lists second). Each divergence also records the
float64 top-2 gap in bf16 spacings (``float64_spacings``), the same measure for every server. The plugin may have
no divergence outside that rule, and no more divergences than the control of its block size
(:func:`control_for`) plus noise (:data:`NOISE_SIGMAS` Poisson standard deviations).

Writes ``soak.json`` (every request's outcome, every divergence; :func:`for_file`) and ``soak.md`` (the table) to
``--out`` and prints the table. Exit status 1 when a verdict fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_dspark_plugin.harness import tiny_models  # noqa: E402
from sglang_dspark_plugin.harness.serving import SGLangServer, group_members, tiny_model_args  # noqa: E402

# ----------------------------------------------------------------------------------------------
# The workload
# ----------------------------------------------------------------------------------------------

KINDS = ("complete", "drop", "branch", "malformed")
# Malformed requests: (path, body) from the context length, the vocabulary size and a valid
# prompt. Each one SGLang must refuse with a 4xx and keep serving.
MALFORMED = {
    "prompt-longer-than-context": lambda ctx, vocab, ids: (
        "/generate", {"input_ids": (ids * (ctx // len(ids) + 2))[: ctx + 16], "sampling_params": {"max_new_tokens": 4}}),
    "negative-temperature": lambda ctx, vocab, ids: (
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": -1.0}}),
    "negative-max-new-tokens": lambda ctx, vocab, ids: (
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": -3}}),
    "truncated-json": lambda ctx, vocab, ids: ("/generate", '{"input_ids": [' + ", ".join(map(str, ids[:4]))),
    "logprob-token-out-of-vocabulary": lambda ctx, vocab, ids: (
        "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True,
                      "token_ids_logprob": [vocab + 5]}),
}


@dataclass
class Request:
    index: int
    kind: str  # one of KINDS
    input_ids: List[int]
    max_new_tokens: int
    parent: Optional[int] = None  # branch: the earlier request whose prompt it starts with
    drop_after: int = 0  # drop: stream chunks the client reads before it closes the connection
    malformed: Optional[str] = None  # malformed: a key of MALFORMED


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] whose logarithm is uniform."""
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def make_workload(n: int, *, seed: int, prompt: tuple, output: tuple, tokens: List[int], drop: float = 0.10,
                  branch: float = 0.20, malformed: float = 0.01) -> List[Request]:
    """``n`` requests (module docstring): ``round(fraction * n)`` of each special kind (from 10
    requests on at least one of each, and every kind of MALFORMED), in a seeded random order whose
    first request is a plain one.
    ``prompt`` / ``output``: (min, max) lengths; ``tokens``: the token ids prompts are drawn from."""
    rng = random.Random(seed)
    least = dict(drop=1, branch=1, malformed=len(MALFORMED))
    counts = {k: round(f * n) if n < 10 else max(least[k], round(f * n))
              for k, f in (("drop", drop), ("branch", branch), ("malformed", malformed))}
    kinds = [k for k, c in counts.items() for _ in range(c)]
    kinds += ["complete"] * (n - len(kinds))
    rng.shuffle(kinds)
    if kinds and kinds[0] != "complete":  # a branch needs an earlier prompt; start plainly
        first = kinds.index("complete")
        kinds[0], kinds[first] = kinds[first], kinds[0]
    out: List[Request] = []
    malformed_kinds = sorted(MALFORMED)
    for i, kind in enumerate(kinds):
        max_new = log_uniform(rng, *output)
        if kind == "branch":
            parent = rng.choice([r for r in out if r.kind != "malformed"])
            cut = rng.randint(1, len(parent.input_ids))
            tail = log_uniform(rng, 1, max(1, prompt[1] - cut))
            ids = parent.input_ids[:cut] + [rng.choice(tokens) for _ in range(tail)]
            out.append(Request(i, kind, ids, max_new, parent=parent.index))
            continue
        ids = [rng.choice(tokens) for _ in range(log_uniform(rng, *prompt))]
        if kind == "drop":
            max_new = max(max_new, 4)  # something to drop: the stream ends after at least 4 tokens
            out.append(Request(i, kind, ids, max_new, drop_after=rng.randint(1, max_new // 2)))
        elif kind == "malformed":
            which = malformed_kinds[sum(r.kind == "malformed" for r in out) % len(malformed_kinds)]
            out.append(Request(i, kind, ids, max_new, malformed=which))
        else:
            out.append(Request(i, kind, ids, max_new))
    return out


# ----------------------------------------------------------------------------------------------
# The client
# ----------------------------------------------------------------------------------------------

REQUEST_TIMEOUT = 900.0


def _post(base_url: str, path: str, body, timeout: float = REQUEST_TIMEOUT):
    """POST ``body`` (a dict as JSON, or a raw string); returns the open response or raises
    ``urllib.error.HTTPError``."""
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    req = urllib.request.Request(base_url + path, data=data, headers={"Content-Type": "application/json"},
                                 method="POST")
    return urllib.request.urlopen(req, timeout=timeout)


def send(base_url: str, req: Request, *, logprobs: bool, context_len: int, vocab: int) -> dict:
    """One request of the workload; its outcome: ``status`` (HTTP status, None when the connection
    failed), ``output_ids`` and ``top2`` (``[[logprob, token], [logprob, token]]`` per output
    token, with ``logprobs``) of a completed request, ``chunks`` read of a dropped stream."""
    row = dict(index=req.index, kind=req.kind, status=None, seconds=0.0)
    t0 = time.monotonic()
    try:
        if req.kind == "malformed":
            path, body = MALFORMED[req.malformed](context_len, vocab, req.input_ids)
            with _post(base_url, path, body) as resp:
                row["status"] = resp.status
                resp.read()
        elif req.kind == "drop":
            body = dict(input_ids=req.input_ids, stream=True,
                        sampling_params=dict(max_new_tokens=req.max_new_tokens, temperature=0, ignore_eos=True))
            chunks = 0
            with _post(base_url, "/generate", body) as resp:
                row["status"] = resp.status
                for line in resp:
                    if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                        chunks += 1
                        if chunks >= req.drop_after:
                            break  # leaving the block closes the connection mid-stream
            row["chunks"] = chunks
        else:
            body = dict(input_ids=req.input_ids,
                        sampling_params=dict(max_new_tokens=req.max_new_tokens, temperature=0, ignore_eos=True))
            if logprobs:
                body.update(return_logprob=True, top_logprobs_num=2)
            with _post(base_url, "/generate", body) as resp:
                row["status"] = resp.status
                out = json.loads(resp.read())
            row["output_ids"] = out["output_ids"]
            meta = out.get("meta_info", {})
            row["spec_verify_ct"] = meta.get("spec_verify_ct", 0)
            if logprobs:
                row["top2"] = [[[float(lp), int(tok)] for lp, tok, *_ in pos[:2]]
                               for pos in meta.get("output_top_logprobs") or []]
    except urllib.error.HTTPError as exc:
        row["status"] = exc.code
        row["error"] = exc.read().decode(errors="replace")[:300]
    except Exception as exc:  # noqa: BLE001 - a failed request is an outcome of the soak
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    row["seconds"] = time.monotonic() - t0
    return row


def run_workload(base_url: str, requests: List[Request], *, concurrency: int, logprobs: bool, context_len: int,
                 vocab: int, on_progress=None) -> dict:
    """Send ``requests`` in order with ``concurrency`` clients; rows in request order, the wall
    time, and tokens/s: the output tokens of the completed requests over the wall time.
    ``on_progress(done)`` is called from this thread as every tenth of the requests completes."""
    rows: List[Optional[dict]] = [None] * len(requests)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(send, base_url, r, logprobs=logprobs, context_len=context_len, vocab=vocab)
                   for r in requests]
        step, next_mark = max(1, len(futures) // 10), 0
        for i, future in enumerate(futures):
            rows[i] = future.result()
            if on_progress is not None and i + 1 >= next_mark:
                on_progress(i + 1)
                next_mark += step
    wall = time.monotonic() - t0
    tokens = sum(len(r.get("output_ids") or []) for r in rows)
    return dict(rows=rows, wall_s=wall, output_tokens=tokens, tokens_per_s=tokens / wall if wall else 0.0)


# ----------------------------------------------------------------------------------------------
# Comparison with the reference
# ----------------------------------------------------------------------------------------------

NOISE_SIGMAS = 3.0  # the plugin's divergences may exceed the control's by this many sqrt(control + 1)


def bf16_spacing(x: float) -> float:
    """The distance between consecutive bf16 numbers around ``x`` (8 significant bits): a logit of
    that magnitude is known to within it once rounded to bf16."""
    if x == 0.0:
        return 2.0 ** -133  # bf16's smallest subnormal
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def first_difference(got: List[int], want: List[int]) -> Optional[int]:
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def judge(got: List[int], ref_row: dict, logits_at) -> Optional[dict]:
    """None when ``got`` equals the reference's output; else the first divergence, with
    ``near_tie`` True only when there the reference's top-2 log-probability gap (= its logit gap)
    is at most the bf16 spacing of the larger of the two logits and ``got`` took the reference's
    runner-up. ``logits_at(position)`` gives the two tokens' float64 logits there (the float64
    forward of the prompt and the reference's output before ``position``)."""
    want = ref_row["output_ids"]
    pos = first_difference(got, want)
    if pos is None:
        return None
    info = dict(position=pos, got=got[pos] if pos < len(got) else None, want=want[pos] if pos < len(want) else None,
                near_tie=False)
    top2 = ref_row.get("top2") or []
    if pos < len(top2) and len(top2[pos]) == 2 and info["got"] is not None:
        (lp1, t1), (lp2, t2) = top2[pos]
        z1, z2 = logits_at(pos, t1, t2)
        spacing = bf16_spacing(max(abs(z1), abs(z2)))
        info.update(gap=lp1 - lp2, top1=t1, runner_up=t2, logits=[z1, z2], spacing=spacing,
                    float64_spacings=abs(z1 - z2) / spacing)
        # the reference picked one of its top two and the server the other; at an exact tie the
        # reference's listing order need not be its pick
        info["near_tie"] = {info["got"], info["want"]} == {t1, t2} and info["gap"] <= spacing
    return info


class Float64Logits:
    """The float64 logits of the model definition (``tiny_models.ReferenceTarget``) at a position
    of a request's greedy continuation."""

    def __init__(self, spec: tiny_models.ModelSpec):
        self.spec = spec
        self.ref = None  # loaded at the first divergence

    def __call__(self, prompt: List[int], output: List[int], pos: int, t1: int, t2: int):
        import torch

        if self.ref is None:
            from safetensors.torch import load_file

            path = tiny_models.default_out_dir() / self.spec.target_dir / tiny_models.WEIGHTS_FILE
            self.ref = tiny_models.ReferenceTarget(load_file(str(path)), self.spec,
                                                   device="cuda" if torch.cuda.is_available() else None)
        with torch.no_grad():
            logits = self.ref.logits(torch.tensor([prompt + output[:pos]]))[0, -1]
        return float(logits[t1]), float(logits[t2])


def compare(requests: List[Request], ref_rows: List[dict], rows: List[dict], logits) -> dict:
    """Every request completed by both the reference and this server, judged (:func:`judge`)."""
    compared, divergences = 0, []
    for req, ref, row in zip(requests, ref_rows, rows):
        if req.kind not in ("complete", "branch") or ref.get("status") != 200 or row.get("status") != 200:
            continue
        compared += 1
        found = judge(row["output_ids"], ref,
                      lambda pos, t1, t2: logits(req.input_ids, ref["output_ids"], pos, t1, t2))
        if found is not None:
            divergences.append(dict(index=req.index, **found))
    return dict(compared=compared, divergences=len(divergences),
                near_ties=sum(d["near_tie"] for d in divergences),
                outside_rule=[d for d in divergences if not d["near_tie"]], all=divergences)


def within_noise(ours: int, control: int) -> bool:
    return ours <= control + NOISE_SIGMAS * math.sqrt(control + 1)


# ----------------------------------------------------------------------------------------------
# Server health
# ----------------------------------------------------------------------------------------------

IDLE_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens",
               "sglang:mamba_used_tokens")
LEAK_LOG = re.compile(r"memory leak detected")
IDLE_WAIT_S = 45.0  # SGLang refreshes its idle pool gauges at once when stale, else every 30 s


def read_metrics(base_url: str) -> Dict[str, float]:
    """SGLang's Prometheus gauges (``--enable-metrics``), summed over label sets (data-parallel ranks)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: Dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return out


def idle_state(base_url: str, wait_s: float = IDLE_WAIT_S) -> dict:
    """Poll ``/metrics`` until the server is idle with nothing held (every IDLE_GAUGES at 0) or
    ``wait_s`` passes; the last gauges and whether they got there."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            gauges = {k: v for k, v in read_metrics(base_url).items() if k in IDLE_GAUGES}
        except (urllib.error.URLError, OSError) as exc:
            return dict(idle=False, error=str(exc))
        idle = len(gauges) == len(IDLE_GAUGES) and all(v == 0 for v in gauges.values())
        if idle or time.monotonic() > deadline:
            return dict(idle=idle, gauges=gauges)
        time.sleep(2.0)


def _nvidia_smi(query: str) -> List[List[str]]:
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[field.strip() for field in line.split(",")] for line in out.splitlines() if line.strip()]


def gpu_memory_mib(server: SGLangServer) -> Optional[float]:
    """GPU memory of the server's processes (``nvidia-smi``); where the GPU lists no process of
    this machine's (a container's own process ids), the memory used on the first GPU, every
    server's together (flat as well when this one is); None without a GPU."""
    pids = set(group_members(server.pgid)) if server.pgid else set()
    used = [float(mib) for pid, mib in _nvidia_smi("--query-compute-apps=pid,used_memory")
            if pid.isdigit() and int(pid) in pids]
    if used:
        return sum(used)
    device = _nvidia_smi("--query-gpu=memory.used")
    return float(device[0][0]) if device else None


MEMORY_GROWTH_MIB = 256.0  # allowed growth over the second half of a run


def memory_flat(samples: List[Optional[float]]) -> Optional[bool]:
    """GPU memory sampled at every tenth of the run: flat when the second half grew by at most
    MEMORY_GROWTH_MIB (the first half may still grow: the allocator meets new batch shapes)."""
    values = [s for s in samples if s is not None]
    if len(values) < 3:
        return None
    mid = values[len(values) // 2]
    return max(values[len(values) // 2:]) - mid <= MEMORY_GROWTH_MIB


def verdicts(name: str, run: dict, requests: List[Request], comparison: Optional[dict],
             control: Optional[dict], plugin: bool) -> Dict[str, bool]:
    """The checks of one server's run (module docstring); each True when it passed."""
    rows = run["rows"]
    out = {
        "no 5xx": not any((r.get("status") or 0) >= 500 for r in rows),
        "malformed 4xx": all(400 <= (r.get("status") or 0) < 500 for r in rows if r["kind"] == "malformed"),
        "no failed request": all(r.get("status") == 200 for r in rows if r["kind"] in ("complete", "branch", "drop")),
        "alive": run.get("alive", False),
        "no leak": run.get("idle", {}).get("idle", False) and run.get("leak_lines", 1) == 0,
    }
    if run.get("gpu"):
        out["GPU memory flat"] = run.get("memory_flat") is True
    if run.get("lazy_ring_expected") is not None:
        out["lazy ring as expected"] = run.get("lazy_ring") == run["lazy_ring_expected"]
    if plugin and comparison is not None:
        out["no divergence outside the bf16 rule"] = not comparison["outside_rule"]
        if control is not None:
            out["divergences within the control's noise"] = within_noise(comparison["divergences"],
                                                                         control["divergences"])
    return out


# ----------------------------------------------------------------------------------------------
# Servers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    name: str
    backend: str  # "stock" or "dspark"
    gamma: Optional[int] = None  # DSPARK block size (with ReplaySSM); None: no speculation
    lazy_ring: Optional[bool] = None  # the plugin must log the lazy record ring on (True) / off (False)


SERVERS = [
    ServerSpec("reference", "stock"),
    ServerSpec("control", "stock", 3),
    ServerSpec("control-g7", "stock", 7),
    ServerSpec("dspark-g3", "dspark", 3, lazy_ring=True),
    ServerSpec("dspark-g7", "dspark", 7, lazy_ring=False),
]


def control_for(spec: ServerSpec) -> str:
    """The control server a speculative server is judged against: SGLang's own speculation at the
    same block size (a divergence count depends on how many tokens each verify decides)."""
    return next((c.name for c in SERVERS if c.backend == "stock" and c.gamma == spec.gamma), "control")


def server_args(spec: ServerSpec, args, model: tiny_models.ModelSpec, gpu: bool) -> List[str]:
    extra = [
        "--enable-metrics",
        "--max-mamba-cache-size", str(args.mamba_slots),
        "--max-running-requests", str(args.concurrency),
        "--max-total-tokens", str(args.max_total_tokens),
        "--sleep-on-idle",  # the servers not being measured leave the host to the measured one
        # SGLang's default radix strategy on a GPU (the lazy ring runs with it); asked for on CPU
        "--mamba-radix-cache-strategy", "extra_buffer",
    ]  # fmt: skip
    if gpu:
        # decode graphs up to the running-request cap the pool sets (160 slots / 5 per request)
        extra += ["--cuda-graph-bs-decode", "1", "2", "4", "8", "16", "24", "32",
                  "--sampling-backend", "pytorch"]  # fmt: skip
    if spec.backend == "stock":
        from sglang_dspark_plugin.plugin import full_attention_delegate

        backend = full_attention_delegate() if gpu else "triton"
    else:
        backend = "dspark"
    return tiny_model_args(spec.gamma, spec=model, attention_backend=backend, replayssm=spec.gamma is not None,
                           extra=extra)


def run_server(spec: ServerSpec, server: SGLangServer, requests: List[Request], args, context_len: int,
               vocab: int, gpu: bool) -> dict:
    """The workload against a started server, then its health: alive, idle with nothing held, no
    leak line in its log, GPU memory at every tenth of the run."""
    log_offset = len(server.log_text())
    memory: List[Optional[float]] = []

    def progress(done):
        memory.append(gpu_memory_mib(server))
        print(f"[{spec.name}] {done}/{len(requests)} requests", flush=True)

    run = run_workload(server.base_url, requests, concurrency=args.concurrency, logprobs=spec.name == "reference",
                       context_len=context_len, vocab=vocab, on_progress=progress)
    run["idle"] = idle_state(server.base_url)
    memory.append(gpu_memory_mib(server))
    run["gpu"], run["gpu_memory_mib"] = gpu, memory
    run["memory_flat"] = memory_flat(memory)
    run["alive"] = server.alive() and server.healthy(timeout=120)
    log = server.log_text()
    run["leak_lines"] = len(LEAK_LOG.findall(log[log_offset:]))
    if spec.lazy_ring is not None:
        run["lazy_ring_expected"] = spec.lazy_ring
        run["lazy_ring"] = "dspark: lazy record ring on" in log
    cap = re.search(r"max_running_requests is capped to (\d+) by the mamba state cache", log)
    run["running_cap"] = int(cap.group(1)) if cap else None
    return run


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def float64_spacings(divergence: dict) -> float:
    """The float64 top-2 gap at a divergence in bf16 spacings (recorded by :func:`judge`; computed
    from its logits for results saved before it recorded it)."""
    if "float64_spacings" in divergence:
        return divergence["float64_spacings"]
    z1, z2 = divergence["logits"]
    return abs(z1 - z2) / divergence["spacing"]


def summarize(result: dict) -> str:
    head = ["server", "requests ok", "5xx", "malformed 4xx", "dropped", "compared", "divergences",
            "near-ties", "outside rule", "largest float64 gap (bf16 spacings)", "tokens/s", "GPU MiB (start, end)",
            "idle, no leak", "alive", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, run in result["servers"].items():
        if run.get("error"):
            lines.append(f"| {name} | error: {run['error'][:120]} |" + " |" * (len(head) - 2))
            continue
        rows = run["rows"]
        ok = sum(r.get("status") == 200 for r in rows if r["kind"] in ("complete", "branch"))
        done = sum(r["kind"] in ("complete", "branch") for r in rows)
        mal = [r for r in rows if r["kind"] == "malformed"]
        cmp_ = run.get("comparison") or {}
        mem = [m for m in run.get("gpu_memory_mib") or [] if m is not None]
        failed = [k for k, v in run.get("verdicts", {}).items() if not v]
        lines.append("| " + " | ".join([
            name + (" (top-2 log-probs)" if name == "reference" else ""),
            f"{ok}/{done}",
            str(sum((r.get("status") or 0) >= 500 for r in rows)),
            f"{sum(400 <= (r.get('status') or 0) < 500 for r in mal)}/{len(mal)}",
            str(sum(r["kind"] == "drop" for r in rows)),
            str(cmp_.get("compared", "-")), str(cmp_.get("divergences", "-")), str(cmp_.get("near_ties", "-")),
            str(len(cmp_["outside_rule"])) if cmp_ else "-",
            f"{max(spacings):.2f}" if (spacings := [float64_spacings(d) for d in (cmp_.get("all") or [])
                                                    if "logits" in d]) else "-",
            f"{run['tokens_per_s']:.0f}" if run["tokens_per_s"] >= 10 else f"{run['tokens_per_s']:.2f}",
            f"{mem[0]:.0f}, {mem[-1]:.0f}" if mem else "-",
            "yes" if run["verdicts"].get("no leak") else "NO",
            "yes" if run["verdicts"].get("alive") else "NO",
            "pass" if not failed else "FAIL: " + ", ".join(failed),
        ]) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true",
                   help="the CPU soak: tiny model, 24 requests of 8-48 prompt and 1-8 output tokens, 4 clients")
    p.add_argument("--model", choices=sorted(s for s, m in tiny_models.SPECS.items() if not m.random_weights))
    p.add_argument("--requests", type=int)
    p.add_argument("--concurrency", type=int)
    p.add_argument("--prompt-len", type=lambda s: tuple(int(x) for x in s.split("-")), help="min-max")
    p.add_argument("--output-len", type=lambda s: tuple(int(x) for x in s.split("-")), help="min-max")
    p.add_argument("--mamba-slots", type=int, help="--max-mamba-cache-size of every server")
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--seed", type=int, default=20261207)
    p.add_argument("--servers", default=",".join(s.name for s in SERVERS), help="comma list of SERVERS names")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--log-dir", default="/tmp/soak")
    p.add_argument("--render", metavar="SOAK_JSON", help="print the table of a saved soak.json (or .json.gz) and exit")
    return p


# --small (a CPU soak in a few minutes) and the default (a GPU)
DEFAULTS = {
    True: dict(model="tiny", requests=24, concurrency=4, prompt_len=(8, 48), output_len=(1, 8), mamba_slots=16,
               max_total_tokens=2048),
    False: dict(model="kimi32", requests=2000, concurrency=128, prompt_len=(8, 2000), output_len=(1, 512),
                mamba_slots=160, max_total_tokens=262144),
}


def for_file(result: dict) -> dict:
    """``result`` as ``soak.json`` keeps it: compact enough to come back from a GPU machine (a few
    MB at 2,000 requests): the reference's per-token top-2 log-probabilities are dropped (each
    divergence keeps the gap it was judged by) and the prompts are not repeated (``make_workload``
    regenerates them from ``args.seed``)."""
    out = dict(result, servers={})
    for name, run in result["servers"].items():
        if "rows" in run:
            run = dict(run, rows=[{k: v for k, v in row.items() if k != "top2"} for row in run["rows"]])
        out["servers"][name] = run
    return out


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.render:
        import gzip

        with (gzip.open if args.render.endswith(".gz") else open)(args.render, "rt") as f:
            print(summarize(json.load(f)))
        return 0
    for key, value in DEFAULTS[args.small].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    import torch

    gpu = torch.cuda.is_available()
    model = tiny_models.SPECS[args.model]
    tiny_models.ensure_models(model, log=lambda m: print(f"[models] {m}", flush=True))
    names = [n for n in args.servers.split(",") if n]
    specs = [s for s in SERVERS if s.name in names]
    if not specs or specs[0].name != "reference":
        raise SystemExit("--servers must start with reference (the outputs are judged against it)")
    emittable = tiny_models.emittable_tokens().nonzero().flatten().tolist()
    requests = make_workload(args.requests, seed=args.seed, prompt=args.prompt_len, output=args.output_len,
                             tokens=emittable)
    context_len, vocab = model.max_positions, model.vocab
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.log_dir, exist_ok=True)
    result = dict(date=datetime.date.today().isoformat(),
                  device=torch.cuda.get_device_name() if gpu else "cpu", sglang=__import__("sglang").__version__,
                  args={k: v for k, v in vars(args).items()},
                  workload=dict(requests=len(requests), kinds={k: sum(r.kind == k for r in requests) for k in KINDS}),
                  servers={})

    def save():
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(for_file(result), f, separators=(",", ":"))

    servers = {s.name: SGLangServer(server_args(s, args, model, gpu), name=s.name, startup_timeout=1500,
                                    progress_every=60, log_path=os.path.join(args.log_dir, f"{s.name}.log"))
               for s in specs}  # fmt: skip
    started: Dict[str, Optional[str]] = {}

    def start(name):
        try:
            servers[name].start()
            started[name] = None
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            started[name] = f"{type(exc).__name__}: {exc}"[-2000:]

    try:
        if gpu:  # together (the GPU has room; each compiles and captures at once), measured one by one
            with ThreadPoolExecutor(max_workers=len(specs)) as pool:
                list(pool.map(start, list(servers)))
        logits = Float64Logits(model)
        ref_rows = None
        for spec in specs:
            if not gpu:  # one at a time on a CPU
                start(spec.name)
            if started.get(spec.name):
                result["servers"][spec.name] = dict(error=started[spec.name])
                save()
                continue
            run = run_server(spec, servers[spec.name], requests, args, context_len, vocab, gpu)
            if spec.name == "reference":
                ref_rows = run["rows"]
            elif ref_rows is not None:
                run["comparison"] = compare(requests, ref_rows, run["rows"], logits)
            control = result["servers"].get(control_for(spec), {}).get("comparison")
            run["verdicts"] = verdicts(spec.name, run, requests, run.get("comparison"), control,
                                       plugin=spec.backend == "dspark")
            result["servers"][spec.name] = run
            save()
            print(f"[{spec.name}] {json.dumps(run['verdicts'])}", flush=True)
            if not gpu:
                servers[spec.name].stop()
    finally:
        for server in servers.values():
            server.stop()
    result["workload"]["requests_by_index"] = [
        dict(asdict(r), input_ids=None, input_len=len(r.input_ids)) for r in requests]  # ids: from the seed
    save()
    table = summarize(result)
    with open(os.path.join(args.out, "soak.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    ok = all(not r.get("error") and all(r["verdicts"].values()) for r in result["servers"].values())
    return 0 if ok and len(result["servers"]) == len(specs) else 1


if __name__ == "__main__":
    sys.exit(main())
