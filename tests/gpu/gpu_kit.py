"""The GPU end-to-end fleet: real ``sglang.launch_server`` processes on one GPU, every served
configuration of both test models, each compared with **stock SGLang without speculation**.

What one run does (``python -m pytest tests/gpu``, on the H200 rig: docs/guide/gpu-serving.md):

1. Writes the test models if missing (``harness.tiny_models``: ``tiny`` and the Kimi-Linear-shaped
   ``kimi32``, 32 KDA heads; ``k3-12h``, one TP8 rank of Kimi-K3, with ``DSPARK_GPU_E2E_MODELS``) and picks ``NUM_PROMPTS`` prompts per model: seeded random token ids
   whose greedy continuation under the float64 reference (``ReferenceTarget``, an independent
   forward) has a top-1/top-2 logit margin of at least ``MIN_MARGIN`` at every one of the
   ``OUTPUT_LEN`` tokens, so that bf16 rounding differences between two correct implementations
   cannot flip a token. Nothing else about the prompts is chosen.
2. Starts every configuration of ``configs()`` as its own server (``PARALLEL`` at a time, sharing
   the GPU and the Triton cache), sends each the same workload (``run_workload``) and stops it:
   all prompts at once plus repeats up to ``CONCURRENCY`` requests (batches above the largest
   captured CUDA graph run eager), then 5 at once (a padded graph), then the OpenAI completions
   API, then radix-cache prefix hits (``TRACK_INTERVAL``). Results and the server log are kept
   for the tests.

The servers use CUDA graphs (``--cuda-graph-bs-decode``), the overlap scheduler and SGLang's
default radix cache strategy (``extra_buffer``, with a track point every 64 tokens instead of
256 so that short requests reach one): what a GPU deployment runs. The Kimi-K3 models are the
exception (``Served.radix_cache``): they serve without a radix cache and skip the prefix-hit phase.

Kimi-K3 models (``k3_configs``, one wave of six servers on an 80 GB GPU): decode, DSPARK block size
3 on the lazy record ring with the output gate on and off (``SGLANG_DSPARK_OUTPUT_GATE=0``), block
size 7 with real ragged compact windows, snapshot and ReplaySSM (fold) commit. At 12 KDA heads per
rank the plugin's decode and verify kernels apply K3's gated output RMSNorm themselves
(``Served.fuses_output_gate``), which the tests read from the kernels' first-use log lines.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from sglang_dspark_plugin.harness import tiny_models
from sglang_dspark_plugin.harness.serving import PREFILL_GRAPH_ARGS, SGLangServer, tiny_model_args
from sglang_dspark_plugin.settings import LAZY_RECORDS_MAX_WINDOW, gpu_available

from served_log import OUTPUT_GATE_ENV

# Harness dry run without a GPU (the tiny model unless DSPARK_GPU_E2E_MODELS says, small
# workload): checks this kit, not the GPU.
ON_CPU = not gpu_available()

OUTPUT_LEN = 8 if ON_CPU else 32
NUM_PROMPTS = 6 if ON_CPU else 40
PROMPT_LEN = 16
MIN_MARGIN = 0.2  # logits, float64 reference, every generated token
PROMPT_SEED = 20261201
CONCURRENCY = 4 if ON_CPU else 64
CUDA_GRAPH_BS = [1, 2, 4, 8, 16, 32]  # 64 concurrent requests run eager; 5 pad to 8
# Radix-cache prefix hits on a state the commit wrote: the extra_buffer radix cache keeps the state
# at every multiple of TRACK_INTERVAL a decode crosses. Turn 1 (BRANCH_PROMPTS prompts of
# TURN1_PROMPT_LEN tokens, TURN1_LEN generated) crosses token 64; the branch (turn 1's first 64
# tokens and one more) starts from the cached copy of that state with a one-token prefill
# (tests/e2e/test_prefix_cache_e2e.py says why one token: a longer prefill hides a wrong state).
# Both continuations keep MIN_MARGIN under the float64 reference, as the other prompts do.
TRACK_INTERVAL = 64
BRANCH_PROMPTS = 2 if ON_CPU else 8
TURN1_PROMPT_LEN = 56
TURN1_LEN = 16
BRANCH_LEN = 8 if ON_CPU else 12


def _default_parallel() -> int:
    """Servers started at once: one on CPU; on a GPU one per 13 GiB of its memory, at most 10
    (ten on the H200, six on an 80 GB H100; the measurements behind it: docs/guide/gpu-serving.md)."""
    if ON_CPU:
        return 1
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    return max(1, min(10, int(total_gib // 13)))


PARALLEL = int(os.environ.get("DSPARK_GPU_E2E_PARALLEL", "0")) or _default_parallel()
LOG_DIR = Path(os.environ.get("DSPARK_GPU_E2E_LOG_DIR", "/tmp/dspark-gpu-e2e"))
MODELS = os.environ.get("DSPARK_GPU_E2E_MODELS", "tiny" if ON_CPU else "kimi32,tiny").split(",")
# Tensor parallelism of every server (TP=2: 16 KDA heads per rank on kimi32; needs 2 GPUs, and
# then PARALLEL servers share them). Above 1 the fleet also serves stock at TP=1 (``stock-tp1``):
# the plugin is then judged against stock at both.
TP_SIZE = int(os.environ.get("DSPARK_GPU_E2E_TP", "1"))
STOCK_TP1 = "stock-tp1"
# Only these configurations (comma list of Served.name; unset = all): a focused run
ONLY_CONFIGS = set(filter(None, os.environ.get("DSPARK_GPU_E2E_CONFIGS", "").split(",")))

GRAPH_CAPTURED_MARK = "CUDA graph end"  # SGLang's log line after a graph capture

# Slot reuse: the ``-reuse`` configurations serve the workload (every request of ``run_workload``)
# from a mamba pool of SLOT_REUSE_MAMBA_SLOTS slots. SGLang caps the running requests at the pool
# size over its state slots per request (5 with the extra_buffer radix cache and the overlap
# scheduler: the working slot, two track slots and headroom), so 8 run and the others queue; every
# request takes its three slots from the free list, so each slot is handed out about
# 87 requests * 3 / SLOT_REUSE_MAMBA_SLOTS = 6.5 times (the 512 slots of the other configurations
# are each handed out at most once). 40 slots still hold the 8 conversations' cached track states
# beside 8 running branches, so the branches stay prefix hits.
SLOT_REUSE_MAMBA_SLOTS = 40
SLOT_REUSE_MIN_USES = 3  # each slot handed out at least this often on average (test_slots_were_reused)


def stock_backend() -> str:
    """The stock SGLang backend of the baseline: the dspark backend's own MLA delegate (fa3 on
    Hopper unless ``SGLANG_DSPARK_FULL_ATTN_BACKEND`` says otherwise), so baseline and plugin
    differ only in the KDA layers."""
    if ON_CPU:
        return "triton"
    from sglang_dspark_plugin.plugin import full_attention_delegate

    return full_attention_delegate()


@dataclass(frozen=True)
class Served:
    """One server configuration."""

    model: str  # ModelSpec name
    name: str
    backend: str  # "dspark" or "stock"
    gamma: Optional[int] = None  # --speculative-dspark-block-size; None = no speculation
    replayssm: bool = False  # --enable-linear-replayssm-spec
    ragged: str = "static"  # SGLANG_RAGGED_VERIFY_MODE
    sps_table: bool = False  # compact scheduler picks windows shorter than gamma + 1
    decode_ring: bool = False  # --enable-linear-replayssm: plain decode through SGLang's decode ring
    # SGLANG_DSPARK_LAZY_RECORDS: None = the default (as "1"), "1" = the lazy record ring (windows
    # up to LAZY_RECORDS_MAX_WINDOW), "0" = fold every commit, "all" = the lazy record ring at any window
    lazy_records: Optional[str] = None
    prefill_graph: bool = False  # SGLang's breakable prefill CUDA graph (off for KDA models by default)
    buffered_decode: Optional[str] = None  # SGLANG_DSPARK_BUFFERED_DECODE; None = the default (factored)
    tp: Optional[int] = None  # --tp-size; None = TP_SIZE
    output_gate: bool = True  # False: SGLANG_DSPARK_OUTPUT_GATE=0 (a K3 model applies its o_norm itself)
    # --max-mamba-cache-size (None: 512): SLOT_REUSE_MAMBA_SLOTS for the slot-reuse configurations
    mamba_slots: Optional[int] = None
    verify_impl: Optional[str] = None  # SGLANG_DSPARK_VERIFY_IMPL; None = the default (triton)

    @property
    def tp_size(self) -> int:
        return self.tp or TP_SIZE

    @property
    def id(self) -> str:
        return f"{self.model}-{self.name}"

    @property
    def spec(self) -> tiny_models.ModelSpec:
        return tiny_models.SPECS[self.model]

    @property
    def radix_cache(self) -> bool:
        """Whether the server keeps SGLang's Mamba radix cache. SGLang 0.5.23 resolves its
        strategy (extra_buffer) by architecture name, and its list has Kimi-K3's multimodal wrapper
        but not the K3 text stack the K3 test models are (it refuses an explicit
        ``--mamba-radix-cache-strategy extra_buffer`` for them): they serve without one."""
        return not self.spec.k3

    @property
    def fuses_output_gate(self) -> bool:
        """The plugin's decode / verify kernels apply the K3 gated output norm: a K3 model at 12
        KDA heads per rank (SGLang offers the gate only there), gate not turned off."""
        per_rank = self.spec.kda_heads // self.tp_size
        return (self.backend == "dspark" and self.spec.k3 and per_rank == tiny_models.K3_HEADS_PER_RANK
                and self.output_gate)

    def skip_reason(self) -> Optional[str]:
        if self.sps_table and stock_backend() == "triton":
            return "ragged verify windows need an MLA delegate that reads them (fa3/flashinfer); DSPARK-E004"
        return None

    @property
    def baseline(self) -> str:
        """The stock configuration this one's tokens are judged against: stock without speculation,
        but for the prefill-graph configurations stock on the same prefill graph (SGLang 0.5.23's
        graph is not lossless against its own eager prefill on these models: docs/gpu-serving.md),
        with DSPARK + ReplaySSM where this one speculates."""
        if not self.prefill_graph or self.backend == "stock":
            return "stock"
        return "stock-g3-replayssm-prefill-graph" if self.gamma else "stock-prefill-graph"

    @property
    def control(self) -> Optional[str]:
        """The stock SGLang + DSPARK configuration (same draft, target, block size and verify
        scheduling) whose acceptance this speculative configuration must match; None for the
        stock ones and without speculation."""
        if self.backend == "stock" or not self.gamma:
            return None
        if self.prefill_graph:
            return "stock-g3-replayssm-prefill-graph"
        return f"stock-g{self.gamma}-{'compact' if self.sps_table else 'static'}"

    def args(self) -> List[str]:
        extra: List[str] = []
        if self.sps_table:
            table = tiny_models.default_out_dir() / self.spec.draft_dir / tiny_models.SPS_TABLE_FILE
            extra += ["--speculative-dspark-sps-table-path", str(table)]
        if not self.radix_cache:
            extra += ["--disable-radix-cache"]
        elif self.decode_ring:  # SGLang requires the no_buffer radix strategy (no overlap) for it
            extra += ["--enable-linear-replayssm", "--linear-replayssm-cache-len", "16"]
            if not ON_CPU:
                extra += ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]
        elif ON_CPU:  # the GPU's default radix strategy (CPU device gates 7 and 8)
            extra += ["--mamba-radix-cache-strategy", "extra_buffer"]
        if self.radix_cache:
            extra += ["--mamba-track-interval", str(TRACK_INTERVAL)]
        if not ON_CPU:
            extra += [
                "--cuda-graph-bs-decode", *map(str, CUDA_GRAPH_BS),
                "--max-running-requests", str(CONCURRENCY),
                "--max-mamba-cache-size", str(self.mamba_slots or 512),
                "--max-total-tokens", "65536",
                "--sampling-backend", "pytorch",  # flashinfer's sampler JIT-compiles for minutes
            ]  # fmt: skip
            if self.tp_size > 1:
                extra += ["--tp-size", str(self.tp_size)]
            if self.prefill_graph:
                extra += list(PREFILL_GRAPH_ARGS)
        backend = stock_backend() if self.backend == "stock" else "dspark"
        return tiny_model_args(
            self.gamma, spec=self.spec, attention_backend=backend, replayssm=self.replayssm, extra=extra
        )

    def env(self) -> Dict[str, str]:
        env = {"SGLANG_RAGGED_VERIFY_MODE": self.ragged} if self.gamma else {}
        if self.lazy_records is not None:
            env["SGLANG_DSPARK_LAZY_RECORDS"] = self.lazy_records
        if self.buffered_decode is not None:
            env["SGLANG_DSPARK_BUFFERED_DECODE"] = self.buffered_decode
        if not self.output_gate:
            env[OUTPUT_GATE_ENV] = "0"
        if self.verify_impl is not None:
            env["SGLANG_DSPARK_VERIFY_IMPL"] = self.verify_impl
        if self.tp_size > 1:  # the fleet's servers share the GPUs: SGLang would refuse a rank
            env["SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"] = "0"  # whose GPU has less free memory
        return env

    @property
    def lazy(self) -> bool:
        """The lazy record ring runs: turned on, ReplaySSM with the default extra_buffer radix cache
        or none (the CPU dry run's no_buffer radix cache keeps it off) and windows up to
        LAZY_RECORDS_MAX_WINDOW (any window with ``lazy_records="all"``)."""
        return (self.replayssm and self.lazy_records in (None, "1", "all") and (not ON_CPU or not self.radix_cache)
                and (self.lazy_records == "all" or self.gamma + 1 <= LAZY_RECORDS_MAX_WINDOW))

    def expected_kernels(self) -> List[str]:
        if self.backend != "dspark":
            return []
        if self.gamma is None:
            return [f"decode (buffered, {self.buffered_decode or 'factored'})"] if self.decode_ring else ["decode"]
        if self.lazy:
            return ["mtp_verify (ring, lazy records)", "lazy records commit"]
        if self.replayssm:
            return ["mtp_verify (ring, gluon stream)" if self.verify_impl == "gluon" else "mtp_verify (ring)",
                    "replayssm_fold"]
        return ["mtp_verify (snapshot)"]

    def gated_kernels(self) -> List[str]:
        """Of ``expected_kernels``, the decode / verify kernel (the one that may apply the output
        gate); the commit kernels never do."""
        return [k for k in self.expected_kernels() if k.startswith(("decode", "mtp_verify"))]


def k3_configs(model: str) -> List[Served]:
    """A Kimi-K3 model's servers (one wave of six on an 80 GB GPU): stock; decode; gamma 3 on the
    lazy record ring (the default), output gate on and off; gamma 7 with ragged compact windows
    (SPS table), snapshot and ReplaySSM commit (the fold: the lazy ring is off at 8-token windows)."""
    out = [
        Served(model, "stock", "stock"),
        *([Served(model, STOCK_TP1, "stock", tp=1)] if TP_SIZE > 1 else []),
        Served(model, "dspark-decode", "dspark"),
        Served(model, "dspark-g3-replayssm-static", "dspark", 3, True),
        Served(model, "dspark-g3-replayssm-static-gate-off", "dspark", 3, True, output_gate=False),
        Served(model, "dspark-g7-snapshot-compact", "dspark", 7, False, ragged="compact", sps_table=True),
        Served(model, "dspark-g7-replayssm-compact", "dspark", 7, True, ragged="compact", sps_table=True),
    ]
    return _only_named(out) if ONLY_CONFIGS else out


def configs(model: str) -> List[Served]:
    if tiny_models.SPECS[model].k3:
        return k3_configs(model)
    out = [
        Served(model, "stock", "stock"),
        *([Served(model, STOCK_TP1, "stock", tp=1)] if TP_SIZE > 1 else []),
        Served(model, "dspark-decode", "dspark"),
        Served(model, "dspark-decode-ring", "dspark", decode_ring=True),
    ]
    if not ON_CPU:  # the buffered decode that forms the state every step (kernels/decode.py), opt-in
        out.append(Served(model, "dspark-decode-ring-rows", "dspark", decode_ring=True, buffered_decode="rows"))
    for gamma in (3, 7):
        for replayssm in (False, True):
            commit = "replayssm" if replayssm else "snapshot"
            # ReplaySSM with the default commit: the lazy record ring at gamma 3; gamma 7 folds
            out.append(Served(model, f"dspark-g{gamma}-{commit}-static", "dspark", gamma, replayssm))
            if not ON_CPU:
                out.append(
                    Served(model, f"dspark-g{gamma}-{commit}-compact", "dspark", gamma, replayssm,
                           ragged="compact", sps_table=True)
                )  # fmt: skip
    if not ON_CPU:  # stock SGLang + DSPARK: the controls of the plugin's acceptance (test_speculation_accepted_drafts)
        for gamma in (3, 7):
            out.append(Served(model, f"stock-g{gamma}-static", "stock", gamma, True))
            out.append(Served(model, f"stock-g{gamma}-compact", "stock", gamma, True, ragged="compact", sps_table=True))
        # slot reuse: one configuration per commit path (lazy ring, fold, snapshot) on a small mamba pool
        out += [
            Served(model, "dspark-g3-replayssm-reuse", "dspark", 3, True, mamba_slots=SLOT_REUSE_MAMBA_SLOTS),
            Served(model, "dspark-g3-replayssm-eager-reuse", "dspark", 3, True, lazy_records="0",
                   mamba_slots=SLOT_REUSE_MAMBA_SLOTS),
            Served(model, "dspark-g3-snapshot-reuse", "dspark", 3, False, mamba_slots=SLOT_REUSE_MAMBA_SLOTS),
        ]
    else:  # dry run: the control of its one speculative configuration
        out.append(Served(model, "stock-g3-static", "stock", 3, True))
    if not ON_CPU:  # fold every commit (SGLANG_DSPARK_LAZY_RECORDS=0), next to the lazy ring of the others
        out.append(Served(model, "dspark-g3-replayssm-eager-static", "dspark", 3, True, lazy_records="0"))
        # 8-token windows on the lazy ring (off by default until they are shown faster)
        out.append(Served(model, "dspark-g7-replayssm-lazy-all-static", "dspark", 7, True, lazy_records="all"))
        # Prefills through SGLang's breakable prefill graph, served only when DSPARK_GPU_E2E_CONFIGS
        # names them: SGLang 0.5.23's graph gives wrong greedy tokens on these models without the
        # plugin too, also with RIG_BCG_STRONG_REFS=1 (docs/guide/gpu-serving.md, 2026-12-04). So each is
        # judged against stock SGLang on the same graph (Served.baseline), with and without DSPARK +
        # ReplaySSM (SGLang's KDA kernels), which are served with it; ours: decode, fold every
        # commit, the lazy ring (its cursor reset runs in the graph's refresh hook).
        out += [
            Served(model, "stock-prefill-graph", "stock", prefill_graph=True),
            Served(model, "stock-g3-replayssm-prefill-graph", "stock", 3, True, prefill_graph=True),
            Served(model, "dspark-decode-prefill-graph", "dspark", prefill_graph=True),
            Served(model, "dspark-g3-replayssm-eager-prefill-graph", "dspark", 3, True, lazy_records="0",
                   prefill_graph=True),
            Served(model, "dspark-g3-replayssm-prefill-graph", "dspark", 3, True, lazy_records="1",
                   prefill_graph=True),
        ]  # fmt: skip
        # The Gluon Hopper verify stream (SGLANG_DSPARK_VERIFY_IMPL=gluon, sm_90 only: by name, as the
        # prefill graph), through the fold: gamma 7 and gamma 3 with ragged compact windows.
        out += [
            Served(model, "dspark-g7-replayssm-gluon-compact", "dspark", 7, True, ragged="compact", sps_table=True,
                   verify_impl="gluon"),
            Served(model, "dspark-g3-replayssm-eager-gluon-compact", "dspark", 3, True, lazy_records="0",
                   ragged="compact", sps_table=True, verify_impl="gluon"),
        ]
    if ON_CPU:  # dry run: one speculative configuration is enough
        out = [s for s in out if s.name in ("stock", "dspark-decode", "dspark-g3-snapshot-static", "stock-g3-static")]
    if ONLY_CONFIGS:
        return _only_named(out)
    return [s for s in out if not s.prefill_graph and not s.verify_impl]  # those only by name, above


def _only_named(out: List[Served]) -> List[Served]:
    """The subset ``DSPARK_GPU_E2E_CONFIGS`` names: the stock baselines always run, and the controls
    and same-graph baselines of the configurations named."""
    wanted = {s.name for s in out if s.name in ONLY_CONFIGS}
    wanted |= {x for s in out if s.name in wanted for x in (s.baseline, s.control) if x}
    return [s for s in out if s.name in ("stock", STOCK_TP1) or s.name in wanted]


# ----------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------


@dataclass
class Prompts:
    ids: List[List[int]]  # NUM_PROMPTS prompts of PROMPT_LEN token ids
    reference: List[List[int]]  # float64 greedy continuation of each
    min_margin: List[float]  # smallest top-1/top-2 margin along it
    candidates: int  # how many random prompts were drawn to find them
    turn1: List[List[int]] = field(default_factory=list)  # BRANCH_PROMPTS prompts of TURN1_PROMPT_LEN ids


def branch_prompt(prompt: List[int], turn1: List[int]) -> List[int]:
    """Turn 1's first TRACK_INTERVAL tokens (prompt and output) and one more (the prompt's first)."""
    return (prompt + turn1)[:TRACK_INTERVAL] + prompt[:1]


def robust_prompts(spec: tiny_models.ModelSpec, n: int = NUM_PROMPTS, batch: int = 256,
                   branches: bool = True) -> Prompts:
    """The first ``n`` seeded random prompts (emittable tokens) whose float64 greedy continuation
    keeps a margin of ``MIN_MARGIN`` at every token (module docstring); with ``branches`` also the
    prefix-hit phase's conversations."""
    from safetensors.torch import load_file

    model_dir = tiny_models.default_out_dir() / spec.target_dir
    device = "cuda" if torch.cuda.is_available() else None
    ref = tiny_models.ReferenceTarget(load_file(str(model_dir / tiny_models.WEIGHTS_FILE)), spec, device=device)
    emittable = tiny_models.emittable_tokens().nonzero().flatten()
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    out = Prompts([], [], [], 0)
    while len(out.ids) < n:
        if out.candidates >= 64 * n:
            raise RuntimeError(f"only {len(out.ids)} of {n} prompts without near-ties in {out.candidates}")
        ids = emittable[torch.randint(len(emittable), (batch, PROMPT_LEN), generator=gen)]
        with torch.no_grad():
            tokens, margins = ref.greedy(ids, OUTPUT_LEN)
        out.candidates += batch
        for row in (margins.min(1).values >= MIN_MARGIN).nonzero().flatten().tolist()[: n - len(out.ids)]:
            out.ids.append(ids[row].tolist())
            out.reference.append(tokens[row].tolist())
            out.min_margin.append(float(margins[row].min()))
    tried = 0
    while branches and len(out.turn1) < min(BRANCH_PROMPTS, n):  # both requests of a conversation robust
        if tried >= 64 * n:
            raise RuntimeError(f"only {len(out.turn1)} conversations without near-ties in {tried}")
        ids = emittable[torch.randint(len(emittable), (batch, TURN1_PROMPT_LEN), generator=gen)]
        with torch.no_grad():
            turn1, m1 = ref.greedy(ids, TURN1_LEN)
            branch_ids = torch.tensor([branch_prompt(p, t) for p, t in zip(ids.tolist(), turn1.tolist())])
            _, m2 = ref.greedy(branch_ids, BRANCH_LEN)
        tried += batch
        robust = torch.minimum(m1.min(1).values, m2.min(1).values) >= MIN_MARGIN
        out.turn1 += [ids[row].tolist() for row in robust.nonzero().flatten().tolist()]
        out.turn1 = out.turn1[:BRANCH_PROMPTS]
    return out


# ----------------------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------------------


def _generate(server: SGLangServer, ids: List[int], logprobs: bool, max_new_tokens: int = OUTPUT_LEN) -> dict:
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
    }
    if logprobs:  # the baseline's top-2 log-probabilities: their gap is the logit margin
        payload.update(return_logprob=True, top_logprobs_num=2)
    out = server.post_json("/generate", payload)
    meta = out["meta_info"]
    row = {
        "output_ids": out["output_ids"],
        "text": out["text"],
        "spec_verify_ct": meta.get("spec_verify_ct", 0),
        "spec_num_correct_drafts": meta.get("spec_num_correct_drafts"),
        "spec_correct_drafts_histogram": meta.get("spec_correct_drafts_histogram"),
        "spec_cap_length": meta.get("spec_cap_length"),
        "cached_tokens": meta.get("cached_tokens"),
    }
    if logprobs:
        tops = meta["output_top_logprobs"]
        row["top2"] = [[(float(lp), int(tok)) for lp, tok, *_ in pos[:2]] for pos in tops]
    return row


def _completion(server: SGLangServer, ids: List[int]) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", timeout=600, max_retries=0)
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt=ids, max_tokens=OUTPUT_LEN, temperature=0)
    return {"text": resp.choices[0].text, "completion_tokens": resp.usage.completion_tokens}


def _all_at_once(server: SGLangServer, ids: List[List[int]], logprobs: bool, max_new_tokens: int) -> List[dict]:
    with ThreadPoolExecutor(max_workers=len(ids)) as pool:
        futures = [pool.submit(_generate, server, p, logprobs, max_new_tokens) for p in ids]
        return [f.result(timeout=900) for f in futures]


def run_workload(server: SGLangServer, prompts: Prompts, logprobs: bool, branches: bool = True) -> dict:
    """Requests of one server: ``wave64`` (every prompt once, then repeats, all at once),
    ``wave5`` (prompts 0..4 at once), ``openai`` (two /v1/completions, one at a time), then
    ``turn1`` (the BRANCH_PROMPTS conversations' first requests, TURN1_LEN tokens, at once) and
    ``branch`` (their branches at the track point, at once). Each /generate row is keyed by its
    prompt index (of ``prompts.ids``; of ``prompts.turn1`` in the last two). ``branches=False``:
    no prefix-hit phase (a server without a radix cache)."""
    n = len(prompts.ids)
    wave = [i % n for i in range(max(CONCURRENCY, n))]
    result: dict = {}
    for name, order in (("wave64", wave), ("wave5", list(range(5)))):
        rows = _all_at_once(server, [prompts.ids[i] for i in order], logprobs, OUTPUT_LEN)
        result[name] = [dict(prompt=i, **row) for i, row in zip(order, rows)]
    result["openai"] = [dict(prompt=i, **_completion(server, prompts.ids[i])) for i in (0, 1)]
    if not branches:
        return result
    first = list(range(len(prompts.turn1)))
    turn1 = _all_at_once(server, prompts.turn1, logprobs, TURN1_LEN)
    result["turn1"] = [dict(prompt=i, **row) for i, row in zip(first, turn1)]
    branches = [branch_prompt(prompts.turn1[i], row["output_ids"]) for i, row in zip(first, turn1)]
    rows = _all_at_once(server, branches, logprobs, BRANCH_LEN)
    result["branch"] = [dict(prompt=i, input_ids=b, **row) for i, b, row in zip(first, branches, rows)]
    return result


# ----------------------------------------------------------------------------------------------
# The fleet
# ----------------------------------------------------------------------------------------------


@dataclass
class Run:
    served: Served
    results: dict = field(default_factory=dict)
    log: str = ""
    error: str = ""
    startup_s: Optional[float] = None
    workload_s: Optional[float] = None


def _serve(served: Served, prompts: Prompts, gate: threading.Semaphore) -> Run:
    run = Run(served)
    with gate:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        log_path = LOG_DIR / f"{served.id}.log"
        log_path.unlink(missing_ok=True)
        server = SGLangServer(served.args(), env=served.env(), log_path=log_path, name=served.id,
                              startup_timeout=1200, progress_every=60)  # fmt: skip
        try:
            server.start()
            run.startup_s = server.startup_seconds
            t0 = time.monotonic()
            run.results = run_workload(server, prompts, logprobs=served.backend == "stock",
                                       branches=served.radix_cache)
            run.workload_s = time.monotonic() - t0
        except BaseException as exc:  # noqa: BLE001 - reported by the tests
            run.error = f"{type(exc).__name__}: {exc}"[-4000:]
        finally:
            server.stop()
            run.log = server.log_text()
        # One file per run as it ends: a run cut short by a time limit keeps what finished.
        (LOG_DIR / f"{served.id}.json").write_text(json.dumps(_run_summary(run), indent=1))
    return run


def _run_summary(run: Run) -> dict:
    return dict(config=run.served.__dict__, error=run.error, startup_s=run.startup_s,
                workload_s=run.workload_s, results=run.results)  # fmt: skip


def run_fleet(models: List[str]) -> tuple:
    """Prompts per model, then every configuration served and measured; returns
    ``(prompts by model, runs by Served.id)``. Also writes ``LOG_DIR/fleet.json``."""
    prompts: Dict[str, Prompts] = {}
    todo: List[Served] = []
    for model in models:
        spec = tiny_models.SPECS[model]
        tiny_models.ensure_models(spec, log=lambda m: print(f"[models] {m}", flush=True))
        t0 = time.monotonic()
        prompts[model] = robust_prompts(spec, branches=not spec.k3)  # K3: no radix cache (Served)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        (LOG_DIR / f"prompts-{model}.json").write_text(json.dumps(prompts[model].__dict__))
        print(f"[prompts] {model}: {len(prompts[model].ids)} of {prompts[model].candidates} candidates "
              f"in {time.monotonic() - t0:.0f} s", flush=True)  # fmt: skip
        todo += [s for s in configs(model) if not s.skip_reason()]
    gate = threading.Semaphore(PARALLEL)
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        futures = {s.id: pool.submit(_serve, s, prompts[s.model], gate) for s in todo}
        runs = {sid: f.result() for sid, f in futures.items()}
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    summary = {
        "prompts": {m: p.__dict__ for m, p in prompts.items()},
        "runs": {sid: _run_summary(r) for sid, r in runs.items()},
    }
    (LOG_DIR / "fleet.json").write_text(json.dumps(summary, indent=1))
    return prompts, runs


# ----------------------------------------------------------------------------------------------
# Comparison with the baseline
# ----------------------------------------------------------------------------------------------

NEAR_TIE = 0.05  # logits: a baseline margin this small may flip under any rounding difference


def divergence(got: List[int], baseline: dict) -> Optional[dict]:
    """None when ``got`` equals the baseline's tokens; else where and how they first differ, with
    ``near_tie`` True when the baseline's own top-2 gap there is below ``NEAR_TIE`` and ``got``
    took the baseline's runner-up (a rounding flip, not a wrong state)."""
    want = baseline["output_ids"]
    if got == want:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    info = {"position": pos, "got": got, "want": want, "near_tie": False}
    top2 = baseline.get("top2") or []
    if pos < len(top2) and pos < len(got) and len(top2[pos]) == 2:
        (lp1, _), (lp2, runner_up) = top2[pos]
        info["baseline_gap"] = lp1 - lp2
        info["near_tie"] = lp1 - lp2 < NEAR_TIE and got[pos] == runner_up
    return info


# ----------------------------------------------------------------------------------------------
# Speculation: acceptance against stock SGLang + DSPARK
# ----------------------------------------------------------------------------------------------

ACCEPT_SIGMAS = 3.0  # how many standard errors the mean accepted drafts per verify step may differ by


def accepted_histogram(rows: List[dict]) -> List[int]:
    """Verify steps by the number of drafts they accepted, summed over ``rows`` (``/generate``
    results with ``spec_correct_drafts_histogram``)."""
    total: List[int] = []
    for row in rows:
        for k, n in enumerate(row.get("spec_correct_drafts_histogram") or []):
            total += [0] * (k + 1 - len(total))
            total[k] += n
    return total


def compare_acceptance(ours: List[int], stock: List[int]) -> dict:
    """Our accepted-draft histogram against stock SGLang's on the same draft, target and prompts:
    the mean drafts accepted per verify step of each, and ``same`` when they differ by at most
    ``ACCEPT_SIGMAS`` standard errors of the difference (two independent samples of verify steps;
    the same outputs make the two runs' steps nearly the same, so this lets noise through and
    little else: at 800 steps a per-draft acceptance of 0.6 where stock has 0.7 fails)."""

    def moments(hist):
        n = sum(hist)
        mean = sum(k * c for k, c in enumerate(hist)) / n if n else 0.0
        var = sum(c * (k - mean) ** 2 for k, c in enumerate(hist)) / max(n - 1, 1)
        return n, mean, var

    (n1, m1, v1), (n2, m2, v2) = moments(ours), moments(stock)
    se = (v1 / max(n1, 1) + v2 / max(n2, 1)) ** 0.5
    return dict(ours_steps=n1, ours_mean=m1, stock_steps=n2, stock_mean=m2, se=se,
                same=n1 > 0 and n2 > 0 and abs(m1 - m2) <= ACCEPT_SIGMAS * max(se, 1e-3))


# ----------------------------------------------------------------------------------------------
# Slot reuse, from the server log
# ----------------------------------------------------------------------------------------------

MAMBA_CAP_LOG = re.compile(r"max_running_requests is capped to (\d+) by the mamba state cache "
                           r"\(max_mamba_cache_size=(\d+), (\d+) state slots per request\)")
QUEUE_LOG = re.compile(r"#queue-req: (\d+)")
SLOTS_PER_REQUEST = 3  # the working slot and, with the extra_buffer radix cache, two track slots


def slot_reuse(log: str, requests: int) -> Optional[dict]:
    """How a server's mamba pool was used, from its log (SGLang's sizing line and its batch lines):
    the running-request cap the pool set, the pool size, the most requests queued, and the mean
    number of times a slot was handed out (``requests`` each take SLOTS_PER_REQUEST slots). None
    when the pool set no cap (it was not the limit)."""
    cap = MAMBA_CAP_LOG.search(log)
    if cap is None:
        return None
    running, slots, per_request = (int(x) for x in cap.groups())
    queued = max((int(q) for q in QUEUE_LOG.findall(log)), default=0)
    return dict(running_cap=running, slots=slots, ratio=per_request, max_queued=queued,
                uses_per_slot=requests * SLOTS_PER_REQUEST / slots)
