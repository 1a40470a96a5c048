"""Serving benchmark on one GPU: output tokens/s and inter-token latency of real SGLang servers on
the Kimi-Linear-shaped test model (``harness.tiny_models.KIMI32``: 32 KDA heads x 128, 3 KDA + 1
MLA layers), stock SGLang against the plugin, with and without DSPARK speculation.

    python3 benchmarks/bench_serving.py [--gamma 3] [--concurrency 1,8,32,64] [--out DIR] [--plot PNG]

Configurations (``CONFIGS``), every one with CUDA graphs for every batch size it meets, the
overlap scheduler and the same draft: ``stock`` (SGLang's own backend, no speculation),
``stock-dspark`` (SGLang's KDA verify path, snapshot commit), ``stock-dspark-replayssm``,
``dspark`` (our backend, plain decode), ``dspark-dspark`` (our verify, snapshot commit),
``dspark-dspark-replayssm`` (our verify with the lazy record ring: no fold per commit),
``dspark-dspark-replayssm-eager`` (our verify + ReplaySSM fold every commit),
``dspark-dspark-replayssm-lazy-all`` (the lazy record ring at windows above 4 tokens too), and plain decode through SGLang's decode
ring (``--enable-linear-replayssm``, which needs the no_buffer radix strategy and no overlap
scheduler): ``stock-ring`` (SGLang's buffered decode), ``dspark-ring`` (ours: the factored step),
``dspark-ring-rows`` (ours, the step that forms the state every step; by name only).

Load comes from SGLang's own serving benchmark, ``python -m sglang.bench_serving`` (in SGLang 0.5.23 a
deprecated alias of ``sglang.benchmark.serving``, which this script runs): per configuration and
concurrency ``c``, one client run with ``--max-concurrency c`` of ``max(16, 8c)`` requests of seeded
random token ids (``--dataset-name random-ids``, ``--prompt-len`` tokens, exactly ``--output-len``
greedy output tokens, streamed), after ``--warmup-rounds`` unrecorded rounds. Recorded from its
JSON output: output tokens/s, median inter-token latency and time to first token, and the
server's speculation accept length; this script adds the rounds and their spread, the server's
pure decode intervals (its own log), the profile and the table. With ``--profile`` the torch
profiler records ``--profile-steps`` steps of every configuration at ``--profile-concurrency``
and reports the share of GPU kernel time in the KDA attention core (conv + recurrence / verify /
fold kernels, matched by name: ``KDA_KERNEL``).

Servers start in parallel (the GPU and Triton cache are shared); each is measured alone, the
others idle (``--sleep-on-idle``, so they do not spin a CPU core each). ``--max-servers K`` runs the
configurations in groups of K (start, measure, stop, next group) for models too large to have all
servers up at once. ``--model kimi48-8l`` (the first 8 layers of Kimi-Linear-48B with its MoE and
vocabulary, random weights; ``kimi48``: all 27 layers, ``--max-servers 1``) makes a served step
more GPU-bound (``--model k3-8l``: Kimi-K3's first 8 layers with its LatentMoE, one TP8 rank's
attention, random weights; with ``--gamma 7``, K3's block size); its accept lengths are meaningless
(random draft and target), so it compares the cost of the same work per step, not speculation's
gain, and ``--concurrency`` levels beyond what its memory holds fail to start rather than swap. Writes ``serving.json`` and ``serving.md`` to ``--out`` and a plot with ``--plot``.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_dspark_plugin.harness import tiny_models  # noqa: E402
from sglang_dspark_plugin.harness.serving import PREFILL_GRAPH_ARGS, SGLangServer, tiny_model_args  # noqa: E402

# Kernels of the KDA attention core, ours and SGLang's (conv, recurrence, verify, fold or the lazy
# ring's commit and materialisation, snapshot copies of conv windows); projections, norms and the
# output gate of KDA layers are not counted.
KDA_KERNEL = re.compile(
    r"kda|delta_rule|conv1d|replayssm|mtp_verify|_verify_(prep|stream|finish)_kernel|^_decode_kernel"
    r"|copy_conv_windows|_fold_kernel|gating_verify|_(commit|materialize)_records_kernel",
    re.IGNORECASE,
)


# The KDA kernel launched once per KDA layer in every decode or verify forward (ours: the chunked
# streaming verify, the recurrent verify, the decode; SGLang's: its recurrent verify / decode):
# its calls / KDA layers = the decode and verify forwards in a trace. Prefill kernels (chunked
# KDA, the conv over a prompt) are left out of the per-step time.
STEP_KERNEL = re.compile(r"^_verify_stream_kernel$|^_mtp_verify_kernel$|^_decode_kernel$"
                         r"|^fused_sigmoid_gating_delta_rule_update_kernel$|^fused_recurrent_kda")
PREFILL_KERNEL = re.compile(r"^chunk_|_chunk_|^_causal_conv1d_fwd_kernel$")

# SGLang's scheduler logs a "Decode batch" line every --decode-log-interval (40) decode / verify
# steps with the generation throughput since its previous line, and a "Prefill batch" line per
# prefill batch (sglang/srt/managers/scheduler_components/metrics_reporter.py).
DECODE_LOG = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+)")
PREFILL_LOG = re.compile(r"Prefill batch")


def decode_intervals(log_text: str, running: int) -> List[float]:
    """Generation tokens/s of the server's pure decode intervals at ``running`` requests: "Decode
    batch" lines at ``#running-req: running`` whose previous decode or prefill line was also one.
    Such an interval held no prefill, so no request joined (a join is a prefill) and none left (the
    count would have dropped): every step in it ran the full batch. Unlike the client's tokens/s it
    leaves out the prefill and admission between the workload's waves, so it measures the served
    step itself (docs/guide/gpu-serving.md)."""
    found: List[float] = []
    previous_full = False  # the previous decode/prefill line was a decode line at `running`
    for line in log_text.splitlines():
        m = DECODE_LOG.search(line)
        if m:
            full = int(m.group(1)) == running
            if full and previous_full:
                found.append(float(m.group(2)))
            previous_full = full
        elif PREFILL_LOG.search(line):
            previous_full = False
    return found


def _log_size(server: SGLangServer) -> int:
    try:
        return os.path.getsize(server.log_path)
    except OSError:
        return 0


def _log_since(server: SGLangServer, offset: int) -> str:
    """The server's log written from byte ``offset`` on ("" when there is none)."""
    try:
        with open(server.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# Host-side (Python) functions of the KDA path, ours and SGLang's, in a --profile-cpu trace.
HOST_KDA = re.compile(r"sglang_dspark_plugin|kda_backend|hybrid_linear_attn_backend|update_mamba_state|"
                      r"replayssm|linear/utils")


@dataclass(frozen=True)
class Config:
    name: str
    backend: str  # "dspark" or "stock"
    speculative: bool
    replayssm: bool = False
    decode_ring: bool = False
    env: tuple = ()  # (name, value) pairs for the server's environment
    default: bool = True  # in the default --configs
    server_args: tuple = ()  # extra SGLang server arguments


CONFIGS = [
    Config("stock", "stock", False),
    Config("stock-dspark", "stock", True),
    Config("stock-dspark-replayssm", "stock", True, True),
    Config("dspark", "dspark", False),
    Config("dspark-dspark", "dspark", True),
    # the lazy record ring where it is safe (extra_buffer), the default since 2026-12-06; -eager: fold every commit
    Config("dspark-dspark-replayssm", "dspark", True, True, env=(("SGLANG_DSPARK_LAZY_RECORDS", "1"),)),
    Config("dspark-dspark-replayssm-eager", "dspark", True, True, env=(("SGLANG_DSPARK_LAZY_RECORDS", "0"),)),
    # the lazy record ring at windows above 4 tokens too (gamma > 3; off by default until measured)
    # (the same as dspark-dspark-replayssm at the default gamma 3: asked for by name, with --gamma 7)
    Config("dspark-dspark-replayssm-lazy-all", "dspark", True, True, env=(("SGLANG_DSPARK_LAZY_RECORDS", "all"),),
           default=False),
    # plain decode through SGLang's decode ring (--enable-linear-replayssm; no_buffer radix, no overlap)
    Config("stock-ring", "stock", False, decode_ring=True),
    Config("dspark-ring", "dspark", False, decode_ring=True),
    # ours with the buffered decode that forms the state every step (the default before the factored step)
    Config("dspark-ring-rows", "dspark", False, decode_ring=True, env=(("SGLANG_DSPARK_BUFFERED_DECODE", "rows"),),
           default=False),
    # SGLang's breakable prefill CUDA graph, which it leaves off for KDA models unless asked for:
    # eager prefill forwards left about half of the served step's GPU idle at c=64. Timings only:
    # on SGLang 0.5.23 the graph gives wrong greedy tokens on KDA models, stock included
    # (docs/guide/gpu-serving.md)
    Config("stock-dspark-replayssm-prefill-graph", "stock", True, True, default=False,
           server_args=PREFILL_GRAPH_ARGS),
    Config("dspark-dspark-replayssm-eager-prefill-graph", "dspark", True, True, default=False,
           env=(("SGLANG_DSPARK_LAZY_RECORDS", "0"),), server_args=PREFILL_GRAPH_ARGS),
]


def server_args(cfg: Config, args) -> List[str]:
    from sglang_dspark_plugin.plugin import full_attention_delegate

    max_c = max(args.concurrency)
    graph_bs = sorted({1, 2, 4, 8, *range(16, max_c + 1, 8)})
    extra = [
        "--cuda-graph-bs-decode", *map(str, graph_bs),
        "--max-running-requests", str(max_c),
        "--max-mamba-cache-size", str(args.mamba_slots_per_request * max_c),
        "--max-total-tokens", str(4 * max_c * (args.prompt_len + args.output_len)),
        "--sampling-backend", "pytorch",
        "--tp-size", str(args.tp_size),
        # an idle SGLang scheduler otherwise busy-polls one CPU core: with several servers up,
        # the idle ones would compete with the measured one for the host (it is host-bound)
        "--sleep-on-idle",
    ]  # fmt: skip
    if args.disable_radix_cache:  # no track slots: fewer mamba slots per request, higher concurrency
        extra += ["--disable-radix-cache"]
    if cfg.decode_ring:
        extra += ["--enable-linear-replayssm", "--linear-replayssm-cache-len", "16",
                  "--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]  # fmt: skip
    extra += list(cfg.server_args)
    backend = full_attention_delegate() if cfg.backend == "stock" else "dspark"
    return tiny_model_args(
        args.gamma if cfg.speculative else None,
        spec=tiny_models.SPECS[args.model],
        attention_backend=backend,
        replayssm=cfg.replayssm,
        replayssm_cache_len=args.ring_len,
        extra=extra,
    )


# SGLang's own serving benchmark client, ``python -m sglang.bench_serving`` (SGLang 0.5.23 keeps that
# name as a deprecated alias of the module run here). It drives every level; this script starts the
# servers and adds what the client lacks (rounds and their spread, the server's pure decode
# intervals, the profile's KDA share, the table and the plot).
CLIENT = [sys.executable, "-m", "sglang.benchmark.serving"]
# The client prints this after its warm-up request and starts the load about a second later.
CLIENT_LOAD_STARTS = "Starting main benchmark run"


def client_tokenizer(spec: tiny_models.ModelSpec) -> str:
    """A local tokenizer for the client (it reads the vocabulary size for its random token ids): the
    target's own, or, for the configs-only models served with ``--skip-tokenizer-init``, the tiny
    model's (prompt ids then stay below its 512 tokens; the weights are random anyway)."""
    name = tiny_models.TINY.target_dir if spec.random_weights else spec.target_dir
    return str(tiny_models.default_out_dir() / name)


def client_command(base_url: str, *, concurrency: int, num_prompts: int, prompt_len: int, output_len: int,
                   seed: int, tokenizer: str, output_file: str) -> List[str]:
    """The client's command line for one level: ``num_prompts`` requests of ``prompt_len`` random
    token ids (seeded: the same ``seed`` serves the same prompts) and exactly ``output_len`` greedy
    output tokens each, streamed, at most ``concurrency`` in flight. ``random-ids`` with
    ``--tokenize-prompt`` sends token ids and needs no download (``random`` samples ShareGPT text)."""
    return [
        *CLIENT, "--backend", "sglang", "--base-url", base_url,
        "--dataset-name", "random-ids", "--tokenize-prompt", "--tokenizer", tokenizer,
        "--random-input-len", str(prompt_len), "--random-output-len", str(output_len), "--random-range-ratio", "1",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
        "--output-file", output_file, "--disable-tqdm",
    ]  # fmt: skip


def _finite(value) -> Optional[float]:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def read_client_result(path: str, num_prompts: int) -> dict:
    """One level from the client's ``--output-file`` (JSON lines; the last line is this run):
    output tokens/s, median inter-token latency and time to first token, the server's accept length
    (SGLang's ``avg_spec_accept_length``: over all of the server's speculative steps so far), and
    the client's whole record (``bench_serving``, non-finite numbers as None) without its copy of
    the server's arguments.

    A server started with ``--skip-tokenizer-init`` streams token ids without text, and the client
    times tokens by their text: it then reports 0 for every time to first token and inter-token
    latency, recorded here as None (its tokens/s counts the requested output tokens)."""
    with open(path) as f:
        record = [json.loads(line) for line in f if line.strip()][-1]
    timed = record["median_ttft_ms"] > 0  # text was streamed
    client = {key: (_finite(value) if isinstance(value, float) else value)
              for key, value in record.items() if key != "server_info"}
    return {
        "concurrency": record["max_concurrency"],
        "requests": record["completed"],
        "failed_requests": num_prompts - record["completed"],
        "output_tokens": record["total_output_tokens"],
        "wall_s": record["duration"],
        "tokens_per_s": record["output_throughput"],
        "median_itl_ms": record["median_itl_ms"] if timed else None,
        "median_ttft_ms": record["median_ttft_ms"] if timed else None,
        "accept_length": record.get("accept_length"),
        "bench_serving": client,
    }


def start_client(server: SGLangServer, args, *, concurrency: int, num_prompts: int, output_len: int, seed: int,
                 name: str):
    """The client serving one level to ``server`` in the background: ``(process, its output file,
    its log)``, both files under ``--log-dir``/client, named ``name``."""
    folder = os.path.join(args.log_dir, "client")
    os.makedirs(folder, exist_ok=True)
    out, log = os.path.join(folder, name + ".jsonl"), os.path.join(folder, name + ".log")
    if os.path.exists(out):
        os.remove(out)  # the client appends
    cmd = client_command(server.base_url, concurrency=concurrency, num_prompts=num_prompts, prompt_len=args.prompt_len,
                         output_len=output_len, seed=seed, tokenizer=client_tokenizer(tiny_models.SPECS[args.model]),
                         output_file=out)  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, out, log


def finish_client(proc, out: str, log: str, num_prompts: int) -> dict:
    """Wait for a :func:`start_client` client and read its level."""
    rc = proc.wait()
    if rc != 0 or not os.path.exists(out):
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"sglang.benchmark.serving exited with {rc} (log {log}):\n{tail}")
    return read_client_result(out, num_prompts)


def measure_level(server: SGLangServer, args, *, concurrency: int, num_prompts: int, output_len: int, seed: int,
                  name: str) -> dict:
    """One level served by the client, waited for."""
    started = start_client(server, args, concurrency=concurrency, num_prompts=num_prompts, output_len=output_len,
                           seed=seed, name=name)
    return finish_client(*started, num_prompts)


def machine() -> dict:
    """Which machine served: CPU model, logical CPUs and the kernel's boot id (two runs on one
    machine share it; another machine has another). Host-bound servers run at the host's
    speed, so runs from different machines differ by more than the code under test
    (docs/benchmarks.md, "Method")."""

    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return ""

    cpu = next((line.split(":", 1)[1].strip() for line in read("/proc/cpuinfo").splitlines()
                if line.startswith("model name")), None)
    return {"cpu": cpu, "cpus": os.cpu_count(), "boot_id": read("/proc/sys/kernel/random/boot_id").strip() or None}


def _union_us(intervals: List[tuple]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlapping kernels count once)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def _gaps(ordered_kernels: List[tuple]):
    """``(A, B, start, stop)`` for every stretch ``[start, stop)`` in which none of the
    ``(start, end, what)`` kernels (in start order) ran: A is the ``what`` of the kernel that ended
    last before it, B that of the one that ended it. The time before the first kernel is no gap."""
    end, last = float("-inf"), None
    for a, b, what in ordered_kernels:
        if end > float("-inf") and a > end:  # after a first kernel (its ``what`` may be None)
            yield last, what, end, a
        if b > end:
            end, last = b, what


def _add(into: Dict[str, List[float]], key: str, us: float, count: int = 1) -> None:
    """Accumulate ``us`` and ``count`` into ``into[key]`` (``[us, count]``)."""
    acc = into.setdefault(key, [0.0, 0])
    acc[0] += us
    acc[1] += count


def _merge(into: Dict[str, List[float]], found: Dict[str, List[float]]) -> None:
    """Accumulate every ``[us, count]`` entry of ``found`` into ``into``."""
    for key, (us, count) in found.items():
        _add(into, key, us, count)


def _top(acc: Dict[str, List[float]], n: int = 20) -> Dict[str, dict]:
    """The ``n`` largest ``[us, count]`` entries as ``{key: {"us", "count"}}``, largest first."""
    return {key: {"us": us, "count": count} for key, (us, count) in sorted(acc.items(), key=lambda kv: -kv[1][0])[:n]}


# gap sizes: launch gaps inside a CUDA graph are ~1-5 us; the host between steps takes far longer
GAP_SIZES = ((5.0, "< 5 us"), (50.0, "5-50 us"), (500.0, "50-500 us"), (float("inf"), ">= 500 us"))


def idle_gaps(kernels: List[tuple]) -> Dict[str, List[float]]:
    """The GPU's idle time between ``(start, end, name)`` kernels, summed by where it happens:
    ``"A -> B"`` (A: the kernel that ended last before the gap, B: the one that ended it) maps to
    ``[us, count]``. The gaps add up to span - busy (:func:`_union_us`); a long gap after a verify's
    last kernel and before the next step's first is the host between steps (commit, scheduling)."""
    gaps: Dict[str, List[float]] = {}
    for before, after, start, stop in _gaps(sorted(kernels)):
        _add(gaps, f"{before[:60]} -> {after[:60]}", stop - start)
    return gaps


def gap_sizes(kernels: List[tuple]) -> Dict[str, List[float]]:
    """The same idle time by the size of each gap (:data:`GAP_SIZES`): ``[us, count]`` per class."""
    sizes: Dict[str, List[float]] = {label: [0.0, 0] for _, label in GAP_SIZES}
    for _, _, start, stop in _gaps(sorted(kernels)):
        us = stop - start
        _add(sizes, next(label for bound, label in GAP_SIZES if us < bound), us)
    return sizes


# CUDA runtime calls in which the host waits for the GPU (a D2H copy to pageable memory, .item(),
# an event or stream synchronize)
HOST_WAIT = re.compile(r"Synchronize|^cudaMemcpy$|^cuMemcpyDtoH")
# Python frames that say where a wait comes from (SGLang's and the plugin's code, not torch's)
OWN_FRAME = re.compile(r"sglang")


def _own_frames(by_tid: Dict[object, List[tuple]], depth: int, outer: bool = False):
    """Sweep each thread's ``python_function`` frames ``(ts, -dur, 0, name)`` with its queries
    ``(ts, -dur, 1, payload)`` (sorted together: a frame that opens at a query's time encloses it)
    and yield ``(frames, payload)`` per query: the ``depth`` innermost SGLang / plugin frames open
    at the query's time, innermost first, joined by " <- " (or "(no SGLang frame)"); with
    ``outer``, the ``depth`` outermost below the scheduler's event loop (:data:`LOOP_FRAME`; the
    frames around it are the same in every gap), outermost first, joined by " > ": the phase of
    the loop."""
    for items in by_tid.values():
        stack: List[tuple] = []  # open frames: (end, name)
        for ts, neg_dur, is_query, what in sorted(items, key=lambda item: item[:3]):
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if not is_query:
                stack.append((ts - neg_dur, what))
                continue
            frames = [frame for _, frame in (stack if outer else reversed(stack)) if OWN_FRAME.search(frame)]
            if outer:
                loops = [i for i, frame in enumerate(frames) if LOOP_FRAME.search(frame)]
                frames = frames[loops[-1] + 1 :] if loops else frames
            yield (" > " if outer else " <- ").join(frames[:depth]) or "(no SGLang frame)", what


def _python_frames(events: List[dict]) -> Dict[object, List[tuple]]:
    """Each thread's ``python_function`` events as sweep items of :func:`_own_frames`."""
    by_tid: Dict[object, List[tuple]] = {}
    for ev in events:
        if ev.get("cat") == "python_function" and "ts" in ev:
            item = (float(ev["ts"]), -float(ev.get("dur", 0.0)), 0, ev.get("name", ""))
            by_tid.setdefault(ev.get("tid"), []).append(item)
    return by_tid


def host_waits(events: List[dict], depth: int = 3) -> Dict[str, List[float]]:
    """Host waits for the GPU in one trace, by where they happen: ``{frames: [total us, count]}``,
    ``frames`` = the ``depth`` innermost enclosing SGLang / plugin Python frames of the waiting
    CUDA runtime call on its thread, innermost first, joined by " <- " (``python_function`` events
    nest per thread; ``--profile-cpu`` records them)."""
    by_tid = _python_frames(events)
    for ev in events:
        if ev.get("cat") == "cuda_runtime" and "ts" in ev and HOST_WAIT.search(ev.get("name", "")):
            dur = float(ev.get("dur", 0.0))
            by_tid.setdefault(ev.get("tid"), []).append((float(ev["ts"]), -dur, 1, dur))
    waits: Dict[str, List[float]] = {}
    for key, us in _own_frames(by_tid, depth):
        _add(waits, key, us)
    return waits


HOST_GAP_MIN_US = 50.0  # shorter gaps are launch gaps (GAP_SIZES), not the host at work
# Kineto's categories of kernel launches: the CUDA runtime (torch's own kernels, graph replays)
# and the driver (Triton launches through cuLaunchKernelEx, with no runtime call at all)
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# the scheduler's event loop frames (run_event_loop, event_loop_overlap, ...): the phases of a
# step (run_batch, process_batch_result, ...) are the frames below the innermost of them
LOOP_FRAME = re.compile(r"event_loop")
HOST_PHASE_DEPTH = 3


def host_gaps(events: List[dict], depth: int = 3, outer: bool = False) -> Dict[str, List[float]]:
    """What the host was doing while the GPU idled, in one trace with host frames
    (``--profile-cpu``): each gap between kernels of at least :data:`HOST_GAP_MIN_US` is charged
    to the SGLang / plugin frames open at its midpoint on the thread that launched the kernel that
    ended it (the kernel's ``correlation`` to its CUDA runtime or driver launch), like :func:`host_waits`:
    ``{frames: [us, count]}``; with ``outer``, to the outermost frames instead (which phase of the
    scheduler loop: :func:`_own_frames`). A gap whose ending kernel has no traced launch counts under
    "(launch not traced)"."""
    return _charge_gaps(*_gap_queries(events), depth, outer)


def _gap_queries(events: List[dict]) -> tuple:
    """The sweep items of :func:`host_gaps` for one trace: each thread's frames with a query
    ``(midpoint, 0, 1, us)`` per gap of at least :data:`HOST_GAP_MIN_US` on the thread that
    launched the kernel ending it, and the gaps whose ending kernel has no traced launch (``[us]``)."""
    launch_tid = {ev["args"]["correlation"]: ev.get("tid") for ev in events
                  if ev.get("cat") in LAUNCH_CATS and "correlation" in ev.get("args", {})}
    kernels = [(float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)), ev.get("args", {}).get("correlation"))
               for ev in events if ev.get("cat") == "kernel" and "ts" in ev]
    by_tid = _python_frames(events)
    untraced: List[float] = []
    for _, correlation, start, stop in _gaps(sorted(kernels, key=lambda k: k[:2])):
        if stop - start < HOST_GAP_MIN_US:
            continue
        if correlation in launch_tid:
            by_tid.setdefault(launch_tid[correlation], []).append(((start + stop) / 2, 0.0, 1, stop - start))
        else:
            untraced.append(stop - start)
    return by_tid, untraced


def _charge_gaps(by_tid: Dict[object, List[tuple]], untraced: List[float], depth: int, outer: bool) -> Dict[str, List[float]]:
    """:func:`host_gaps` from the items of :func:`_gap_queries` (one trace's queries, swept as often
    as there are records to charge)."""
    gaps: Dict[str, List[float]] = {}
    for us in untraced:
        _add(gaps, "(launch not traced)", us)
    for key, us in _own_frames(by_tid, depth, outer):
        _add(gaps, key, us)
    return gaps


def kda_share(trace_dir: str, kda_layers: Optional[int] = None) -> dict:
    """Share of GPU kernel time in KDA-core kernels over every trace file under ``trace_dir`` (each
    KDA kernel's total time and call count), and how busy the GPU was: ``gpu_busy_share`` = union
    of kernel intervals / span from the first kernel's start to the last one's end (a served step
    far below 1 is host-bound, and kernel speed-ups then barely move tokens/s), and where the GPU
    idled: ``idle_gaps_us``, the gaps between kernels by the kernels around them (:func:`idle_gaps`),
    and ``idle_by_gap_size_us`` by their size (:func:`gap_sizes`; the traces themselves are too
    large to bring back from the device). Host-side events
    (the second trace of ``--profile-cpu``) are summed by name into ``host_top_us`` (nested events
    each count: an indication, not a partition), the host's waits for the GPU by where they
    happen into ``host_waits_us`` (:func:`host_waits`), and what the host was doing while the GPU
    idled into ``host_gaps_us`` (:func:`host_gaps`; empty without host frames) and, by the
    phase of the scheduler loop (outermost frames), into ``host_gap_phases_us``.

    With ``kda_layers`` (the model's KDA layer count): ``kda_steps``, the decode / verify forwards
    in the traces (:data:`STEP_KERNEL` calls / layers), and ``kda_step_us``, their KDA kernel time
    per forward (prefill kernels left out): comparable between servers whose profiled windows
    caught different numbers of prefills.

    Every kernel, KDA or not, is also summed by name into ``kernels_us`` / ``kernel_calls`` (the
    top 40 by time): ``compare_serving.py --profiles`` diffs two servers' kernels per step."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True)
    total = kda = span = busy = 0.0
    names: Dict[str, float] = {}
    calls: Dict[str, int] = {}
    every: Dict[str, float] = {}
    every_calls: Dict[str, int] = {}
    host: Dict[str, float] = {}
    waits: Dict[str, List[float]] = {}
    gaps: Dict[str, List[float]] = {}
    sizes: Dict[str, List[float]] = {}
    host_gap: Dict[str, List[float]] = {}
    host_phase: Dict[str, List[float]] = {}
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        _merge(waits, host_waits(events))
        if any(ev.get("cat") == "python_function" for ev in events):  # a trace with host frames
            queries = _gap_queries(events)  # one pass over the trace for both records
            _merge(host_gap, _charge_gaps(*queries, depth=3, outer=False))
            _merge(host_phase, _charge_gaps(*queries, depth=HOST_PHASE_DEPTH, outer=True))
        intervals = []
        for ev in events:
            cat = ev.get("cat")
            if cat in ("cpu_op", "user_annotation", "python_function"):
                host[ev.get("name", "")] = host.get(ev.get("name", ""), 0.0) + float(ev.get("dur", 0.0))
            if cat != "kernel":
                continue
            dur = float(ev.get("dur", 0.0))
            total += dur
            every[ev.get("name", "")] = every.get(ev.get("name", ""), 0.0) + dur
            every_calls[ev.get("name", "")] = every_calls.get(ev.get("name", ""), 0) + 1
            if "ts" in ev:
                intervals.append((float(ev["ts"]), float(ev["ts"]) + dur, ev.get("name", "")))
            if KDA_KERNEL.search(ev.get("name", "")):
                kda += dur
                names[ev["name"]] = names.get(ev["name"], 0.0) + dur
                calls[ev["name"]] = calls.get(ev["name"], 0) + 1
        if intervals:
            span += max(b for _, b, _ in intervals) - min(a for a, _, _ in intervals)
            busy += _union_us([(a, b) for a, b, _ in intervals])
            _merge(gaps, idle_gaps(intervals))
            _merge(sizes, gap_sizes(intervals))
    step_calls = max((n for name, n in calls.items() if STEP_KERNEL.search(name)), default=0)
    steps = step_calls // kda_layers if kda_layers else 0
    step_kda = sum(us for name, us in names.items() if not PREFILL_KERNEL.search(name))
    return {
        "trace_files": len(files),
        "kernel_us": total,
        "kda_us": kda,
        "kda_share": kda / total if total else None,
        "kda_kernels_us": dict(sorted(names.items(), key=lambda kv: -kv[1])[:12]),
        # per call: comparable with bench_kernels.py's per-kernel times at the served batch
        "kda_kernel_calls": {name: calls[name] for name in sorted(names, key=lambda n: -names[n])[:12]},
        "kda_steps": steps,
        "kda_step_us": step_kda / steps if steps else None,
        "kernels_us": dict(sorted(every.items(), key=lambda kv: -kv[1])[:40]),
        "kernel_calls": {name: every_calls[name] for name in sorted(every, key=lambda n: -every[n])[:40]},
        "span_us": span,
        "gpu_busy_us": busy,
        "gpu_busy_share": busy / span if span else None,
        "idle_gaps_us": _top(gaps),
        "idle_by_gap_size_us": {key: {"us": us, "count": count} for key, (us, count) in sizes.items()},
        "host_top_us": dict(sorted(host.items(), key=lambda kv: -kv[1])[:40]),
        "host_kda_us": {k: v for k, v in sorted(host.items(), key=lambda kv: -kv[1]) if HOST_KDA.search(k)},
        "host_waits_us": _top(waits),
        "host_gaps_us": _top(host_gap),
        "host_gap_phases_us": _top(host_phase),
    }


def _wait_for_line(path: str, text: str, proc, timeout: float = 600.0) -> None:
    """Until the running ``proc`` has written ``text`` into its log ``path`` (or has ended)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        with open(path, errors="replace") as f:
            if text in f.read():
                return
        time.sleep(0.2)


def profile(server: SGLangServer, args, out_dir: str, host: bool = False) -> dict:
    """Torch-profile ``--profile-steps`` forward steps under load at ``--profile-concurrency``
    (GPU kernels; with ``host``, also host-side ops and Python functions, which slow the host).

    The load (the client, ``4 x concurrency`` requests of ``--output-len`` tokens) outlasts the
    steps; the profiler starts a second into it, past the first prefills. If no trace appeared
    when the load ends, ``/stop_profile`` writes it."""
    os.makedirs(out_dir, exist_ok=True)
    c = args.profile_concurrency
    name = "profile-host" if host else "profile"
    proc, out, log = start_client(server, args, concurrency=c, num_prompts=4 * c, output_len=args.output_len,
                                  seed=999, name=f"{os.path.basename(out_dir)}-{name}")  # fmt: skip
    _wait_for_line(log, CLIENT_LOAD_STARTS, proc)
    time.sleep(2.0)  # the client's own pause before the load, then a second into it
    activities = ["CPU", "GPU"] if host else ["GPU"]
    _post_text(server, "/start_profile", {"output_dir": out_dir, "num_steps": args.profile_steps, "activities": activities})
    finish_client(proc, out, log, 4 * c)

    def traces():
        return glob.glob(os.path.join(out_dir, "**", "*.json*"), recursive=True)

    if not traces():
        _post_text(server, "/stop_profile", {})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not traces():
        time.sleep(1.0)
    time.sleep(2.0)  # the exporter writes the file in one go; let it finish
    return kda_share(out_dir, kda_layers=tiny_models.SPECS[args.model].layers.count("kda"))


def _post_text(server: SGLangServer, path: str, payload: dict) -> str:
    req = urllib.request.Request(server.base_url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as resp:  # SGLang answers these in plain text
        return resp.read().decode(errors="replace")


def start_all(configs: List[Config], args) -> Dict[str, dict]:
    """Start every server in parallel and wait for all of them: nothing is measured while a server
    compiles or captures graphs (that skewed a concurrent measurement by tens of percent)."""
    runs: Dict[str, dict] = {cfg.name: {"config": cfg.__dict__, "samples": {}, "server": None} for cfg in configs}

    def start(cfg: Config) -> None:
        run = runs[cfg.name]
        server = SGLangServer(server_args(cfg, args), log_path=os.path.join(args.log_dir, f"{cfg.name}.log"),
                              name=cfg.name, startup_timeout=1200, progress_every=60, env=dict(cfg.env))  # fmt: skip
        try:
            server.start()
            run["server"], run["startup_s"] = server, server.startup_seconds
        except BaseException as exc:  # noqa: BLE001 - recorded in the results
            run["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
            server.stop()

    with ThreadPoolExecutor(max_workers=len(configs)) as pool:
        list(pool.map(start, configs))
    return runs


WARMUP_SEED = 7_000_000  # warm-up prompts: seeds far from the measured rounds' 1000 * round + c


def level_requests(c: int) -> int:
    """The requests of one round at concurrency ``c``."""
    return max(16, 8 * c)


def _ms(value: Optional[float]) -> str:
    return f"{value:.2f} ms" if value is not None else "-"


def measure_all(runs: Dict[str, dict], args, save) -> None:
    """``--warmup-rounds`` unrecorded rounds, then ``--repeats`` rounds; in each, every concurrency
    level of every live server, one at a time, round-robin, on fresh prompts (no radix-cache hits
    across rounds). Round ``r`` at concurrency ``c`` always serves the same prompts (seed ``1000 r +
    c``), so rounds of separate runs pair up (``benchmarks/compare_serving.py``). Saves after each round."""
    live = {name: run for name, run in runs.items() if run.get("server")}
    top = max(args.concurrency)
    for name, run in live.items():  # warm every batch size once
        measure_level(run["server"], args, concurrency=top, num_prompts=top, output_len=8, seed=7, name=f"{name}-warm")
    # full-length rounds that are not recorded: in one of two kimi48 runs (H200, 2026-12-03,
    # docs/guide/gpu-serving.md) a fresh server's first rounds ran 6-15 % below its later ones
    for rep in range(args.warmup_rounds):
        for c in args.concurrency:
            for name, run in live.items():
                level = measure_level(run["server"], args, concurrency=c, num_prompts=level_requests(c),
                                      output_len=args.output_len, seed=WARMUP_SEED + 1000 * rep + c,
                                      name=f"{name}-warmup{rep + 1}-c{c}")  # fmt: skip
                print(f"[{name}] warm-up round {rep + 1} c={c}: {level['tokens_per_s']:.0f} tok/s (not recorded)", flush=True)
    for rep in range(args.repeats):
        for c in args.concurrency:
            for name, run in live.items():
                offset = _log_size(run["server"])
                level = measure_level(run["server"], args, concurrency=c, num_prompts=level_requests(c),
                                      output_len=args.output_len, seed=1000 * (rep + 1) + c,
                                      name=f"{name}-round{rep + 1}-c{c}")  # fmt: skip
                level["decode_intervals_tok_s"] = decode_intervals(_log_since(run["server"], offset), c)
                run["samples"].setdefault(str(c), []).append(level)
                found = level["decode_intervals_tok_s"]
                decode = f"{statistics.median(found):.0f} tok/s over {len(found)}" if found else "none"
                print(f"[{name}] round {rep + 1} c={c}: {level['tokens_per_s']:.0f} tok/s, "
                      f"ITL {_ms(level['median_itl_ms'])}, accept {level['accept_length']}, "
                      f"server's pure decode intervals: {decode}", flush=True)  # fmt: skip
        save()


def _median_of(samples: List[dict], key: str) -> Optional[float]:
    """The median of the rounds' ``key``, None where no round measured it (token-id-only servers:
    :func:`read_client_result`)."""
    found = [s[key] for s in samples if s.get(key) is not None]
    return statistics.median(found) if found else None


def summarize(run: dict) -> List[dict]:
    """Per concurrency: the median over rounds of tokens/s and of the median ITL, with the spread,
    and the median of the server's pure decode intervals of all rounds (:func:`decode_intervals`;
    None where the log held none, e.g. rounds too short for two log lines at the full batch)."""
    levels = []
    for c, samples in sorted(run["samples"].items(), key=lambda kv: int(kv[0])):
        tps = [s["tokens_per_s"] for s in samples]
        accepts = [s["accept_length"] for s in samples if s["accept_length"]]
        decode = [x for s in samples for x in s.get("decode_intervals_tok_s") or []]
        levels.append({
            "concurrency": int(c),
            "tokens_per_s": statistics.median(tps),
            "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            "median_itl_ms": _median_of(samples, "median_itl_ms"),
            "median_ttft_ms": _median_of(samples, "median_ttft_ms"),
            "accept_length": statistics.mean(accepts) if accepts else None,
            "decode_tok_s": statistics.median(decode) if decode else None,
            "decode_intervals": len(decode),
            "rounds": len(samples),
        })  # fmt: skip
    return levels


def render(result: dict) -> str:
    """Markdown table: tokens/s (x stock without speculation) and median ITL per concurrency."""
    levels = result["args"]["concurrency"]
    head = ["config"] + [f"c={c} tok/s" for c in levels] + [f"c={c} ITL ms" for c in levels]
    head += [f"c={c} decode tok/s (server log)" for c in levels]
    head += ["accept length", "KDA share", "KDA us / step", "GPU busy"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    stock = {lv["concurrency"]: lv["tokens_per_s"] for lv in result["runs"].get("stock", {}).get("levels", [])}
    for name, row in result["runs"].items():
        if row.get("error"):
            lines.append(f"| {name} | error: {row['error'][:100]} |")
            continue
        by_c = {lv["concurrency"]: lv for lv in row["levels"]}
        tps = [
            f"{by_c[c]['tokens_per_s']:.0f}" + (f" ({by_c[c]['tokens_per_s'] / stock[c]:.2f}x)" if stock.get(c) else "")
            for c in levels
        ]
        itl = [f"{by_c[c]['median_itl_ms']:.2f}" if by_c[c].get("median_itl_ms") is not None else "-" for c in levels]
        decode = [f"{by_c[c]['decode_tok_s']:.0f} ({by_c[c]['decode_intervals']})" if by_c[c].get("decode_tok_s")
                  else "-" for c in levels]
        accepts = [lv["accept_length"] for lv in row["levels"] if lv["accept_length"]]
        accept = f"{statistics.mean(accepts):.2f}" if accepts else "-"
        prof = row.get("profile") or {}
        share, busy, step = prof.get("kda_share"), prof.get("gpu_busy_share"), prof.get("kda_step_us")
        lines.append("| " + " | ".join([name, *tps, *itl, *decode, accept, f"{share:.0%}" if share is not None else "-",
                                        f"{step:.0f}" if step is not None else "-",
                                        f"{busy:.0%}" if busy is not None else "-"]) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError as exc:  # not a dependency of the plugin; the GPU rig's image has it
        raise SystemExit(f"--plot needs matplotlib ({exc}); serving.json and serving.md are written") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in result["runs"].items():
        if row.get("levels"):
            xs = [lv["concurrency"] for lv in row["levels"]]
            ax.plot(xs, [lv["tokens_per_s"] for lv in row["levels"]], marker="o", label=name,
                    linestyle="-" if name.startswith("dspark") else "--")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    a = result["args"]
    ax.set_title(f"{a['model']} test model, {result['device']}, gamma={a['gamma']}, {a['output_len']} output tokens")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(tiny_models.SPECS), default="kimi32",
                   help="tiny: CPU dry run; kimi48-8l / kimi48 (all 27 layers, one server per GPU): "
                   "random weights, tokens/s only")  # fmt: skip
    p.add_argument("--max-servers", type=int, default=0,
                   help="servers up at once (0: all); the configurations run in groups of this size")  # fmt: skip
    p.add_argument("--gamma", type=int, default=3)
    # SGLang's extra_buffer radix cache used 4 mamba slots per running request (H200, kimi48-8l);
    # kimi48's 20 KDA layers take ~50 MiB per slot: 8 per request at c=64 (25 GiB) leaves too
    # little beside its 97 GB of weights for CUDA graphs
    p.add_argument("--mamba-slots-per-request", type=int, default=8, help="--max-mamba-cache-size per request")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="measurement rounds (the median is reported)")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="full-length rounds before the measured ones, not recorded (other prompts)")  # fmt: skip
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallelism of every server")
    p.add_argument("--ring-len", type=int, default=None,
                   help="--linear-replayssm-cache-len of the speculative ReplaySSM configs (default: "
                   "the smallest power of two >= 2 (gamma + 1))")  # fmt: skip
    p.add_argument("--disable-radix-cache", action="store_true",
                   help="serve without SGLang's radix cache (no track slots; the lazy ring stays on)")  # fmt: skip
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS if c.default),
                   help="comma-separated configuration names, served in this order")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-concurrency", type=int, default=32)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--profile-cpu", action="store_true",
                   help="with --profile: a second trace with host-side ops and Python functions (finds host overhead)")  # fmt: skip
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--log-dir", default="/tmp/bench-serving")
    p.add_argument("--plot", default=None)
    return p


def selected_configs(names: str) -> List[Config]:
    """The configurations named in ``--configs``, in the order given (with ``--max-servers 1`` that
    is the order the servers run in: two calls in opposite orders cancel drift between them)."""
    by_name = {c.name: c for c in CONFIGS}
    wanted = [n for n in names.split(",") if n]
    unknown = [n for n in wanted if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; known: {', '.join(by_name)}")
    return [by_name[n] for n in dict.fromkeys(wanted)]


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    os.makedirs(args.log_dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    tiny_models.ensure_models(tiny_models.SPECS[args.model], log=lambda m: print(f"[models] {m}", flush=True))
    chosen = selected_configs(args.configs)
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "sglang": __import__("sglang").__version__,
        "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip() if torch.cuda.is_available() else None,
        "machine": machine(),
        "client": " ".join(CLIENT[1:]),
        "args": vars(args),
        "runs": {},
    }  # fmt: skip
    if args.profile and not torch.cuda.is_available():
        print("[profile] skipped: the KDA share is a GPU kernel-time share (CPU dry runs only start/stop it)")
        args.profile = False
    all_runs: Dict[str, dict] = {}

    def save() -> None:  # after every round: a run cut short keeps what it measured
        for name, run in all_runs.items():
            row = {k: v for k, v in run.items() if k != "server"}
            row["levels"] = summarize(run)
            result["runs"][name] = row
        with open(os.path.join(args.out, "serving.json"), "w") as f:
            json.dump(result, f, indent=1)

    # groups of --max-servers configurations (a model that fills a third of the GPU cannot have
    # all its servers up at once): each group is started, measured and stopped before the next
    size = args.max_servers or len(chosen)
    for group in [chosen[i : i + size] for i in range(0, len(chosen), size)]:
        runs = start_all(group, args)
        all_runs.update(runs)
        try:
            measure_all(runs, args, save)
            for name, run in runs.items():
                if args.profile and run.get("server"):
                    try:
                        run["profile"] = profile(run["server"], args, os.path.join(args.log_dir, f"profile-{name}"))
                        if args.profile_cpu:  # a second trace: host tracing must not skew the GPU-busy share
                            traced = profile(run["server"], args, os.path.join(args.log_dir, f"profile-host-{name}"), host=True)
                            kept = ("kda_steps", "span_us", "host_top_us", "host_kda_us", "host_waits_us", "host_gaps_us",
                                    "host_gap_phases_us")
                            run["profile"]["host"] = {k: traced[k] for k in kept}
                    except Exception as exc:  # noqa: BLE001 - the measured levels stay valid
                        run["profile"] = {"error": f"{type(exc).__name__}: {exc}"[-1000:]}
                    save()
        finally:
            with ThreadPoolExecutor(max_workers=len(runs)) as pool:
                list(pool.map(lambda run: run["server"] and run["server"].stop(), runs.values()))
    save()
    table = render(result)
    with open(os.path.join(args.out, "serving.md"), "w") as f:
        f.write(table + "\n")
    if args.plot:
        plot(result, args.plot)
    print(table)
    return 0 if not any(r.get("error") for r in all_runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
