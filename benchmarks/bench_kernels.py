"""KDA kernel benchmark on one GPU: check, measure bandwidth, time ours and upstream, print a table.

One command (method and current numbers: docs/benchmarks.md)::

    python3 benchmarks/bench_kernels.py [--quick] [--out DIR]

1. **Checks** every kernel (ours and upstream) against the float64 torch reference of
   ``sglang_dspark_plugin.kernels.reference`` on small batches (CUDA-graph padding rows, short
   requests): outputs, rings, conv windows, snapshots, folded states. A kernel whose check failed
   is not timed (its rows say ``check failed``).
2. **Bandwidth** ``B``: a 2 GiB fp32 device-to-device copy (bytes read + written / median time).
3. **Times** ours and upstream (sglang 0.5.23 Triton kernels, fla-core decode; loaded by
   ``benchmarks/upstream_kernels.py``, skipped with a note when absent) on the same tensors
   (bf16 activations, fp32 state, K3 gate ``lower_bound=-5``), each call captured ``R`` times in
   one CUDA graph over ``R`` disjoint slot sets (``R*S >= 256 MiB``) and replayed under
   ``triton.testing.do_bench`` (median, L2 flushed before every replay); per-call time = median/R.
4. **Prints** the table (µs, x floor, x upstream) last and writes ``bench_kernels.json`` and
   ``bench_kernels.md`` to ``--out`` (default ``$OUT``). With ``--kernel-profile`` every whole
   step and decode row also gets ``kernels_us``: device µs per call of each GPU kernel in its
   graph (torch profiler, 5 replays), to show where a step's time goes.

Floors per KDA layer per step, ``S = N*H*64 KiB`` fp32 state: ReplaySSM verify ``S/B``; fold
``2S/B``; decode ``2S/B``; snapshot verify ``(1+T) S/B``; buffered decode (SGLang's decode ring,
``--enable-linear-replayssm``, ring length ``DECODE_RING``; timed over two ring lengths of steps
so the flushes are paid, ours against sglang's ``fused_recurrent_linear_replayssm_decode``) the
read-only floor ``S/B``. The JSON also carries an I/O floor that
adds every byte the kernel must move besides the state (activations, conv windows, rings, output).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))

import torch  # noqa: E402

INTERPRET = not torch.cuda.is_available()
if INTERPRET:  # CPU smoke run of the harness itself (tiny shapes, no timing of note)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kda_testutil import F64, make_problem, rel_err  # noqa: E402

from sglang_dspark_plugin.kernels import decode, mtp_verify, replayssm_fold  # noqa: E402
from sglang_dspark_plugin.kernels.record_ring import commit_records  # noqa: E402
from sglang_dspark_plugin.kernels import mtp_verify_gluon  # noqa: E402
from sglang_dspark_plugin.kernels.mtp_verify_gluon import gluon_verify_supported  # noqa: E402
from sglang_dspark_plugin.kernels import reference as R  # noqa: E402

BF16, FP32 = torch.bfloat16, torch.float32
HEAD = 128
LB = -5.0
DEV = "cuda" if torch.cuda.is_available() else "cpu"
LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    LOG.append(s)
    print(s, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------------------------

def environment(argv):
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               command="python3 " + " ".join(argv), python=platform.python_version(),
               torch=torch.__version__, triton=triton.__version__, host=platform.node())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, mem_gib=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda)
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            env["nvidia_smi"] = q.stdout.strip()
        except Exception as e:  # noqa: BLE001
            env["nvidia_smi"] = f"n/a ({e})"
    return env


def copy_bandwidth(quick):
    """Bytes read + written per second of a large device-to-device copy (TB/s)."""
    n = (2 * 1024**3 if not INTERPRET else 1024**2) // 4
    a = torch.empty(n, device=DEV, dtype=FP32).uniform_()
    b = torch.empty_like(a)
    if INTERPRET:
        return 1.0
    ms = do_bench(lambda: b.copy_(a), warmup=25, rep=100 if quick else 200, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 4 / (ms * 1e-3) / 1e12


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------

def capture_graph(calls):
    """``calls`` (zero-arg callables) run once outside (compile, autotune), then captured in one
    CUDA graph, replayed once; returns the graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:  # compile / autotune outside the capture
            c()
    torch.cuda.current_stream().wait_stream(s)
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    sync()
    return g


def time_graph(calls, rep_ms):
    """Median µs per call of ``calls`` (zero-arg callables) captured in one CUDA graph."""
    if INTERPRET:
        t0 = time.time()
        for c in calls:
            c()
        return (time.time() - t0) * 1e6 / len(calls)
    g = capture_graph(calls)
    ms = do_bench(g.replay, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median")
    del g
    return ms * 1e3 / len(calls)


def kernel_breakdown(calls, replays=5):
    """Device µs per call of each GPU kernel in ``calls`` (one CUDA graph, ``replays`` replays
    under the torch profiler, L2 not flushed), largest first: where a step's time goes. Empty
    under the interpreter (no device kernels)."""
    if INTERPRET:
        return {}
    from torch.profiler import ProfilerActivity, profile
    g = capture_graph(calls)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        sync()
    del g
    per = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0)
        if us > 0:
            per[e.key[:80]] = per.get(e.key[:80], 0.0) + us / (replays * len(calls))
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


# ----------------------------------------------------------------------------------------------
# upstream wrappers (sglang 0.5.23 call sequences, as in its KDA backend)
# ----------------------------------------------------------------------------------------------

class Upstream:
    def __init__(self, mods, fla_fn):
        self.m = mods
        self.fla = fla_fn

    def has(self, *keys):
        return all(k in self.m for k in keys)

    # verify, default H200 path: causal_conv1d_update (+ per-step windows) then the recurrent kernel
    def verify_unfused(self, inst, pool, T, ring):
        conv, rec = self.m["conv"], self.m["recurrent"]
        N, H, D = inst["N"], pool["H"], pool["D"]
        seq = N * T
        x = conv.causal_conv1d_update(
            inst["mixed"].view(N, T, D).transpose(1, 2), pool["conv_t"], pool["w"], None, "silu",
            conv_state_indices=inst["slots"], intermediate_conv_window=pool["icw_u"],
            intermediate_state_indices=inst["rows"])
        x = x.transpose(1, 2).reshape(seq, D)
        qq, kk, vv = x.split([H * HEAD, H * HEAD, H * HEAD], dim=-1)
        if ring:
            kw = dict(cache_ring=True, replayssm_rawv=pool["rv"], replayssm_rawk=pool["rk"],
                      replayssm_g=pool["rg"], replayssm_beta=pool["rb"])
        else:
            kw = dict(intermediate_states_buffer=pool["issm"])
        return rec.fused_sigmoid_gating_delta_rule_update(
            A_log=pool["A_log"], a=inst["a2"], dt_bias=pool["dt_bias"], softplus_beta=1.0,
            softplus_threshold=20.0, q=qq.view(1, seq, H, HEAD), k=kk.view(1, seq, H, HEAD),
            v=vv.view(1, seq, H, HEAD), b=inst["b2"].view(1, seq, H), initial_state_source=pool["state"],
            initial_state_indices=inst["slots"], scale=HEAD**-0.5, use_qk_l2norm_in_kernel=True,
            cu_seqlens=inst["cu"], is_kda=True, lower_bound=pool["lb"], disable_state_update=True,
            intermediate_state_indices=inst["rows"], cache_steps=T, **kw)

    # verify, opt-in fused Triton path (SGLANG_OPT_FUSED_KDA_VERIFY)
    def verify_fused(self, inst, pool, T, ring):
        ver = self.m["fused_verify"]
        H = pool["H"]
        common = dict(
            mixed_qkv=inst["mixed"], conv_weight=pool["w"], conv_bias=None, conv_state=pool["conv_t"],
            conv_state_indices=inst["slots"], intermediate_conv_window=pool["icw_f"],
            intermediate_state_indices=inst["rows"], a=inst["a2"], b=inst["b2"], A_log=pool["A_log"],
            dt_bias=pool["dt_bias"], ssm_states=pool["state"], cache_indices=inst["slots"],
            scale=HEAD**-0.5, T=T, num_q_heads=H, num_v_heads=H, head_k_dim=HEAD, head_v_dim=HEAD,
            lower_bound=pool["lb"])
        if ring:
            return ver.fused_kda_conv_gating_verify(
                intermediate_states_buffer=None, cache_ring=True, replayssm_rawv=pool["rv"],
                replayssm_rawk=pool["rk"], replayssm_g=pool["rg"], replayssm_beta=pool["rb"], **common)
        return ver.fused_kda_conv_gating_verify(intermediate_states_buffer=pool["issm"], **common)

    def fold(self, inst, pool):
        return self.m["fold"].commit_kda_replayssm_spec(
            checkpoint_state=pool["state"], rawv_cache=pool["rv"], rawk_cache=pool["rk"], gk_cache=pool["rg"],
            beta_cache=pool["rb"], ssm_state_indices=inst["slots"], accept_lens=inst["acc"],
            max_cache_len=pool["L"], num_k_heads=pool["H"])

    def conv_update(self, inst, pool):
        """sglang's decode-time conv: rolls ``conv_t`` in place, returns the post-conv mixed_qkv."""
        return self.m["conv"].causal_conv1d_update(inst["mixed"], pool["conv_t"], pool["w"], None, "silu",
                                                   conv_state_indices=inst["slots"])

    # decode, sglang's Triton path: conv update then the packed KDA decode kernel
    def decode(self, inst, pool):
        pd = self.m["packed_decode"]
        N, H = inst["N"], pool["H"]
        x = self.conv_update(inst, pool)
        out = inst["out_u"]
        pd.fused_recurrent_kda_packed_decode(
            mixed_qkv=x, a=inst["a2"], b=inst["b2"], A_log=pool["A_log"], dt_bias=pool["dt_bias"],
            scale=HEAD**-0.5, initial_state=pool["state"], out=out, ssm_state_indices=inst["slots"],
            use_qk_l2norm_in_kernel=True, lower_bound=pool["lb"])
        return out.view(1, N, H, HEAD)

    # buffered decode, sglang's --enable-linear-replayssm path: conv update, then the ring decode
    # (no gate lower bound in its signature: Kimi-Linear's softplus gate only)
    def buffered_decode(self, inst, pool, step):
        rd = self.m["replayssm_decode"]
        N, H = inst["N"], pool["H"]
        x = self.conv_update(inst, pool)
        out = inst["out_u"]
        rd.fused_recurrent_linear_replayssm_decode(
            mixed_qkv=x, a=inst["a2"].view(N, H, HEAD), b=inst["b2"], A_log=pool["A_log"],
            dt_bias=pool["dt_bias"].view(H, HEAD), scale=HEAD**-0.5, initial_state=pool["state"],
            d_cache=pool["dr_d"], k_cache=pool["dr_k"], g_cache=pool["dr_g"], out=out,
            ssm_state_indices=inst["slots"], write_pos=pool["wpos"][step % DECODE_RING],
            use_qk_l2norm_in_kernel=True, is_kda=True)
        return out.view(1, N, H, HEAD)

    def fla_decode(self, inst, pool):
        """fla-core's fused_recurrent_kda on the same pool (state_v_first, slot indices); no conv:
        q/k/v are the raw (contiguous) projections."""
        N, H = inst["N"], pool["H"]
        if "fla_qkv" not in inst:
            x = inst["mixed"]
            inst["fla_qkv"] = tuple(x[:, i * H * HEAD:(i + 1) * H * HEAD].contiguous().view(1, N, H, HEAD)
                                    for i in range(3))
        q, k, v = inst["fla_qkv"]
        o, _ = self.fla(q=q, k=k, v=v, g=inst["a2"].view(1, N, H, HEAD), beta=inst["b2"].view(1, N, H),
                        A_log=pool["A_log"], dt_bias=pool["dt_bias"], initial_state=pool["state"],
                        inplace_final_state=True, state_v_first=True, cu_seqlens=inst["cu"],
                        ssm_state_indices=inst["slots"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True, lower_bound=pool["lb"])
        return o


# ----------------------------------------------------------------------------------------------
# problems for timing: one pool, R instances on disjoint slots
# ----------------------------------------------------------------------------------------------

DECODE_RING = 16  # SGLang's --linear-replayssm-cache-len of the served decode ring (gpu-serving.md)
SPEC_STEPS = 4  # whole speculative steps are timed over SPEC_STEPS * T consecutive steps per slot set


def make_pool(H, N, T, R, snapshot, seed=0, decode_ring=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    D = 3 * H * HEAD
    slots = R * N + 1
    steps = T
    L = max(2, triton.next_power_of_2(2 * steps))

    def rn(*shape, scale=1.0, dtype=FP32):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)

    pool = dict(H=H, D=D, L=L, lb=LB, slots=slots)
    pool["w"] = ((torch.rand(D, 4, generator=g) - 0.5)).to(DEV)
    pool["A_log"] = torch.log(torch.rand(H, generator=g) * 15 + 1).to(DEV)
    pool["dt_bias"] = rn(H * HEAD, scale=0.1)
    pool["state"] = torch.empty(slots, H, HEAD, HEAD, device=DEV, dtype=FP32)
    for s0 in range(0, slots, 64):  # generate on device in chunks (fast, bounded host memory)
        s1 = min(slots, s0 + 64)
        pool["state"][s0:s1].normal_(0.0, 0.05)
    pool["conv"] = rn(slots, 3, D, dtype=BF16)
    pool["conv_t"] = pool["conv"].transpose(1, 2)  # sglang's [slots, D, 3] view of the same bytes
    if T > 1:
        pool["rv"] = torch.zeros(slots, H, L, HEAD, device=DEV, dtype=BF16)
        pool["rk"] = torch.zeros(slots, H, L, HEAD, device=DEV, dtype=BF16)
        pool["rg"] = torch.zeros(slots, H, L, HEAD, device=DEV, dtype=FP32)
        pool["rb"] = torch.zeros(slots, H, L, device=DEV, dtype=FP32)
        rows = R * N
        pool["icw"] = torch.zeros(rows, steps, 3, D, device=DEV, dtype=BF16)
        pool["icw_u"] = torch.zeros(rows, steps, 3, D, device=DEV, dtype=BF16).transpose(-1, -2)
        pool["icw_f"] = torch.zeros(rows, steps, D, 3, device=DEV, dtype=BF16)
        pool["issm"] = (torch.empty(rows, steps, H, HEAD, HEAD, device=DEV, dtype=FP32) if snapshot else None)
        # the lazy record ring at two ring lengths (2 and 4 windows): records, deltas as bf16
        # halves (SGLang's replayssm_d / replayssm_k), a cursor per slot; rawv is never written
        pool["lazy"] = []
        for mult in (2, 4):
            Ll = max(2, triton.next_power_of_2(mult * steps))
            pool["lazy"].append(dict(
                L=Ll, rv=torch.zeros(1, 1, 1, HEAD, device=DEV, dtype=BF16).expand(slots, H, Ll, HEAD),
                rk=torch.zeros(slots, H, Ll, HEAD, device=DEV, dtype=BF16),
                rg=torch.zeros(slots, H, Ll, HEAD, device=DEV, dtype=FP32),
                rb=torch.zeros(slots, H, Ll, device=DEV, dtype=FP32),
                hi=torch.zeros(slots, H, Ll, HEAD, device=DEV, dtype=BF16),
                lo=torch.zeros(slots, H, Ll, HEAD, device=DEV, dtype=BF16),
                cursor=torch.zeros(slots, device=DEV, dtype=torch.int32)))
    if decode_ring:  # SGLang's decode ring (--enable-linear-replayssm): d / k / g rows, fp32
        for name in ("dr_d", "dr_k", "dr_g"):
            pool[name] = torch.zeros(slots, H, DECODE_RING, HEAD, device=DEV, dtype=FP32)
        pool["wpos"] = [torch.full((N,), w, device=DEV, dtype=torch.int32) for w in range(DECODE_RING)]
    insts = []
    for r in range(R):
        ntok = N * T
        inst = dict(N=N)
        inst["mixed"] = rn(ntok, D, dtype=BF16)
        inst["a2"] = rn(ntok, H * HEAD, dtype=BF16)
        inst["b2"] = rn(ntok, H, dtype=BF16)
        inst["slots"] = torch.arange(1 + r * N, 1 + (r + 1) * N, device=DEV, dtype=torch.int32)
        inst["rows"] = torch.arange(r * N, (r + 1) * N, device=DEV, dtype=torch.int32)
        inst["cu"] = torch.arange(0, ntok + 1, T, device=DEV, dtype=torch.int32)
        inst["acc"] = torch.randint(1, T + 1, (N,), generator=g, dtype=torch.int32).to(DEV)
        # accept lengths of SPEC_STEPS consecutive speculative steps (uniform in 1..T)
        inst["acc_steps"] = [torch.randint(1, T + 1, (N,), generator=g, dtype=torch.int32).to(DEV)
                             for _ in range(SPEC_STEPS * T)] if T > 1 else []
        inst["out"] = torch.empty(1, ntok, H, HEAD, device=DEV, dtype=BF16)
        inst["out_u"] = torch.empty(N, 1, H, HEAD, device=DEV, dtype=BF16)
        insts.append(inst)
    return pool, insts


def acts(inst, H):
    x = inst["mixed"]
    ntok = x.shape[0]
    q = x[:, :H * HEAD].view(1, ntok, H, HEAD)
    k = x[:, H * HEAD:2 * H * HEAD].view(1, ntok, H, HEAD)
    v = x[:, 2 * H * HEAD:].view(1, ntok, H, HEAD)
    return q, k, v, inst["a2"].view(1, ntok, H, HEAD), inst["b2"].view(1, ntok, H)


# The Gluon stream's launches timed beside its default (kernels/mtp_verify_gluon.py, GluonLaunch): a
# configuration's "gluon" entry names one; the check of each is "verify_ring_gluon" + its suffix.
GLUON_LAUNCHES = {"": {}, "_k32": dict(stages=4, block_k=32)}


def gluon_configs():
    """``mtp_verify`` configurations of every launch in GLUON_LAUNCHES, with their check names."""
    return [("verify_ring_gluon" + sfx, dict(impl="gluon", **({"gluon": kw} if kw else {})))
            for sfx, kw in GLUON_LAUNCHES.items()]


def check_name(cfg):
    """The check a ring-verify configuration must have passed (forced kernels only)."""
    if cfg.get("impl") == "gluon":
        return next(name for name, c in gluon_configs() if c.get("gluon") == cfg.get("gluon"))
    return "verify_ring_" + cfg["impl"]


@contextlib.contextmanager
def gluon_launch(kw):
    """``mtp_verify_gluon.LAUNCH`` with ``kw`` replaced, for the calls inside (CUDA-graph capture
    included: the launch is chosen when the kernel is launched)."""
    saved = mtp_verify_gluon.LAUNCH
    mtp_verify_gluon.LAUNCH = dataclasses.replace(saved, **(kw or {}))
    try:
        yield
    finally:
        mtp_verify_gluon.LAUNCH = saved


def verify_with(*args, **kw):
    """``mtp_verify`` with a configuration's optional ``gluon`` launch entry applied."""
    with gluon_launch(kw.pop("gluon", None)):
        return mtp_verify(*args, **kw)


def ours_verify(inst, pool, T, ring, cfg):
    H = pool["H"]
    mode = (dict(ring_rawv=pool["rv"], ring_rawk=pool["rk"], ring_g=pool["rg"], ring_beta=pool["rb"]) if ring
            else dict(intermediate_ssm=pool["issm"]))
    return verify_with(*acts(inst, H), conv_weight=pool["w"], A_log=pool["A_log"], dt_bias=pool["dt_bias"],
                       lower_bound=pool["lb"], ssm_state=pool["state"], conv_state=pool["conv"],
                       slot_indices=inst["slots"], cu_seqlens=inst["cu"], num_spec=T - 1,
                       intermediate_conv=pool["icw"], intermediate_rows=inst["rows"], out=inst["out"],
                       **mode, **cfg)


def ours_fold(inst, pool, conv, cfg):
    kw = dict(conv_state=pool["conv"], intermediate_conv=pool["icw"], intermediate_rows=inst["rows"]) if conv else {}
    return replayssm_fold(pool["state"], pool["rv"], pool["rk"], pool["rg"], pool["rb"], inst["slots"], inst["acc"],
                          **kw, **cfg)


def gluon_here() -> bool:
    """The Gluon Hopper stream (kernels/mtp_verify_gluon.py) runs on this GPU."""
    return torch.cuda.is_available() and gluon_verify_supported(torch.device("cuda"))


def profile_launches(launches):
    """For the Nsight Compute scripts (run under ``ncu --profile-from-start off``): each
    ``(name, fn)`` of ``launches`` run twice to compile, then once each inside the profiler's range,
    in order. Without CUDA (the interpreter) the same calls run unprofiled, to check a script."""
    for _ in range(2):
        for _, fn in launches:
            fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for name, fn in launches:
        print("profiled:", name, flush=True)
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def ours_step_eager(inst, pool, T, acc, cfg=None):
    """One speculative step of the fold-every-commit ring: verify, then fold + conv roll."""
    ours_verify(inst, pool, T, True, cfg or {})
    replayssm_fold(pool["state"], pool["rv"], pool["rk"], pool["rg"], pool["rb"], inst["slots"], acc,
                   conv_state=pool["conv"], intermediate_conv=pool["icw"], intermediate_rows=inst["rows"])


def ours_step_lazy(inst, pool, T, lz, acc):
    """One speculative step of the lazy record ring: verify (rebuild, maybe flush, records), then
    the commit: cursor advance + conv roll."""
    H = pool["H"]
    mtp_verify(*acts(inst, H), conv_weight=pool["w"], A_log=pool["A_log"], dt_bias=pool["dt_bias"],
               lower_bound=pool["lb"], ssm_state=pool["state"], conv_state=pool["conv"],
               slot_indices=inst["slots"], cu_seqlens=inst["cu"], num_spec=T - 1,
               intermediate_conv=pool["icw"], intermediate_rows=inst["rows"], out=inst["out"],
               ring_rawv=lz["rv"], ring_rawk=lz["rk"], ring_g=lz["rg"], ring_beta=lz["rb"],
               record_cursor=lz["cursor"], ring_delta=(lz["hi"], lz["lo"]))
    commit_records(lz["cursor"], inst["slots"], acc, pool["conv"][None], pool["icw"][None], inst["rows"],
                   steps=T, ring_len=lz["L"])


def ours_decode(inst, pool, cfg):
    return decode(*acts(inst, pool["H"]), conv_weight=pool["w"], A_log=pool["A_log"], dt_bias=pool["dt_bias"],
                  lower_bound=pool["lb"], ssm_state=pool["state"], conv_state=pool["conv"],
                  slot_indices=inst["slots"], out=inst["out"], **cfg)


def ours_buffered_decode(inst, pool, step, cfg):
    """Decode step ``step`` of the decode ring: ``write_pos = step % L``, flush at ``L - 1``."""
    return decode(*acts(inst, pool["H"]), conv_weight=pool["w"], A_log=pool["A_log"], dt_bias=pool["dt_bias"],
                  lower_bound=pool["lb"], ssm_state=pool["state"], conv_state=pool["conv"],
                  slot_indices=inst["slots"], out=inst["out"], ring_d=pool["dr_d"], ring_k=pool["dr_k"],
                  ring_g=pool["dr_g"], write_pos=pool["wpos"][step % DECODE_RING], **cfg)


def decode_steps(inst, N, steps):
    """Per-step single-token instances from an instance of ``steps`` tokens per request
    (request-major rows): step ``s`` gets rows ``i * steps + s``, contiguous."""
    out = []
    for s_ in range(steps):
        idx = torch.arange(N, device=DEV) * steps + s_
        out.append(dict(inst, mixed=inst["mixed"][idx].contiguous(), a2=inst["a2"][idx].contiguous(),
                        b2=inst["b2"][idx].contiguous(), out=torch.empty_like(inst["out"][:, :N]),
                        out_u=torch.empty_like(inst["out_u"])))
    return out


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------

CHECKS = {}  # (kernel, T) -> dict(ok, err, note)


def record(kernel, T, ok, **info):
    prev = CHECKS.get((kernel, T))
    if prev is not None:
        ok = ok and prev["ok"]
        info = {**{k: v for k, v in prev.items() if k != "ok"}, **info}
    CHECKS[(kernel, T)] = dict(ok=bool(ok), **info)
    if not ok:
        log(f"  CHECK FAILED {kernel} T={T}: {info}")


def check_ours(Ts, H, combos=((BF16, LB), (FP32, None), (FP32, LB))):
    """Ours vs float64 reference: verify (ring + snapshot), fold, decode; fp32 and bf16 inputs."""
    tol = {FP32: 2e-5, BF16: 1e-2}
    for T in Ts:
        if T == 1:
            for dt, lb in ((BF16, LB), (FP32, None)):
                p = make_problem(N=5, H=H, num_spec=0, dtype=dt, lower_bound=lb, seed=11, slot_list=[3, -1, 0, 6, 5],
                                 slots=8, dev=DEV)
                ssm_r, conv_r = p.ssm_state.to(F64), p.conv_state.to(F64)
                out_r = R.decode_ref(*p.acts64(), conv_weight=p.conv_weight.to(F64), A_log=p.A_log.to(F64),
                                     dt_bias=p.dt_bias.to(F64), lower_bound=lb, ssm_state=ssm_r, conv_state=conv_r,
                                     slot_indices=p.slot_indices, act_dtype=dt)
                before = p.ssm_state.clone()
                out = decode(*p.acts(), **p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state,
                             slot_indices=p.slot_indices)
                sync()
                e_out = rel_err(out, out_r)
                live = [3, 0, 6, 5]
                e_st = rel_err(p.ssm_state[live], ssm_r[live])
                untouched = bool(torch.equal(p.ssm_state[[1, 2, 4, 7]], before[[1, 2, 4, 7]]))
                ok = (e_out <= tol[dt] and e_st <= (2e-5 if dt == FP32 else 1e-3) and untouched
                      and torch.equal(p.conv_state[live].to(F64), conv_r[live]) and bool((out[0, 1] == 0).all()))
                record("decode", 1, ok, **{f"out_{dname(dt)}": e_out, f"state_{dname(dt)}": e_st})
            check_buffered_decode(None, H)
            continue
        num_spec = T - 1
        for dt, lb in combos:
            steps = T
            p = make_problem(N=5, H=H, num_spec=num_spec, dtype=dt, lower_bound=lb, seed=100 + T,
                             slot_list=[4, -1, 1, 6, 2], lengths=[steps, steps, max(1, steps - 1), steps, 1],
                             row_list=[2, 3, 0, 4, 1], slots=8, rows=5, dev=DEV)
            icw_r, issm_r = p.new_icw(F64, 0.0), p.new_issm(F64, 0.0)
            rings_r = p.new_rings(act_dtype=F64, fill=0.0)
            out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=icw_r, intermediate_ssm=issm_r, **rings_r,
                                     **p.ref_verify_kwargs())
            live = [(n, s, r, ln) for n, (s, r, ln) in enumerate(zip(p.extra["slot_list"], p.extra["row_list"],
                                                                   p.extra["lengths"])) if s >= 0]
            # ring mode: both kernels forced (the default picks one of them by N, H and T)
            variants = [("verify_ring_rows", dict(impl="rows")), ("verify_ring_chunked", dict(impl="chunked"))]
            if gluon_here():
                variants += gluon_configs()
            for variant, vkw in variants:
                icw_v, rings_v = p.new_icw(), p.new_rings(L=max(2, triton.next_power_of_2(2 * steps)))
                out_v = verify_with(*p.acts(), intermediate_conv=icw_v, **rings_v, **p.verify_kwargs(), **vkw)
                sync()
                e_v = rel_err(out_v, out_r)
                record(variant, T, e_v <= tol[dt] and not out_v.isnan().any(), **{f"out_{dname(dt)}_{lbname(lb)}": e_v})
            icw, rings = p.new_icw(), p.new_rings(L=max(2, triton.next_power_of_2(2 * steps)))
            out = mtp_verify(*p.acts(), intermediate_conv=icw, **rings, **p.verify_kwargs())
            sync()
            e = rel_err(out, out_r)
            ok = e <= tol[dt] and not out.isnan().any()
            e_ring = 0.0
            for n, s, r, ln in live:
                ok &= bool(torch.equal(icw[r, :ln].to(F64), icw_r[r, :ln]))
                for name in rings:
                    er = rel_err(rings[name][s][:, :ln], rings_r[name][s][:, :ln])
                    e_ring = max(e_ring, er)
                    ok &= er <= (1e-6 if name in ("ring_g", "ring_beta") else (1e-5 if dt == FP32 else 1e-3))
            record("verify_ring", T, ok, **{f"out_{dname(dt)}_{lbname(lb)}": e, f"ring_{dname(dt)}": e_ring})
            # snapshot mode
            icw_s, issm = p.new_icw(), p.new_issm()
            out_s = mtp_verify(*p.acts(), intermediate_conv=icw_s, intermediate_ssm=issm, **p.verify_kwargs())
            sync()
            e_s = rel_err(out_s, out_r)
            e_st = max(rel_err(issm[r, :ln], issm_r[r, :ln]) for n, s, r, ln in live)
            ok = e_s <= tol[dt] and e_st <= (2e-5 if dt == FP32 else 1e-3)
            ok &= all(bool(torch.equal(icw_s[r, :ln], icw[r, :ln])) for n, s, r, ln in live)
            record("verify_snapshot", T, ok, **{f"out_{dname(dt)}_{lbname(lb)}": e_s, f"state_{dname(dt)}": e_st})
            # fold every request at a different accept length, from the ring-mode rings
            acc = [(n * 3 + 1) % (steps + 1) for n in range(p.N)]
            acc = [min(a, p.extra["lengths"][n]) for n, a in enumerate(acc)]
            acc_t = torch.tensor(acc, dtype=torch.int32, device=DEV)
            ssm_f, conv_f = p.ssm_state.clone(), p.conv_state.clone()
            replayssm_fold(ssm_f, **rings, slot_indices=p.slot_indices, accept_lens=acc_t, conv_state=conv_f,
                           intermediate_conv=icw, intermediate_rows=p.intermediate_rows)
            sync()
            ssm_r64 = p.ssm_state.to(F64)
            R.replayssm_fold_ref(ssm_r64, *(x.to(F64) for x in rings.values()), p.slot_indices, acc_t)
            e_f = rel_err(ssm_f, ssm_r64)
            e_fs, exact = 0.0, True
            for n, s, r, ln in live:
                if acc[n] > 0:
                    want = issm[r, acc[n] - 1]
                    e_fs = max(e_fs, rel_err(ssm_f[s], want))
                    exact &= bool(torch.equal(ssm_f[s], want))
                    ok_conv = bool(torch.equal(conv_f[s], icw[r, acc[n] - 1]))
                    if not ok_conv:
                        e_fs = max(e_fs, 1.0)
            ok = e_f <= 2e-5 and e_fs <= 1e-5
            record("fold", T, ok, **{f"vs_f64_{dname(dt)}": e_f, f"vs_snapshot_{dname(dt)}": e_fs,
                                     f"bitexact_vs_snapshot_{dname(dt)}": exact})


def dname(dt):
    return "fp32" if dt == FP32 else "bf16"


def lbname(lb):
    return "lb" if lb is not None else "softplus"


def check_buffered_decode(up, H, ours=True, extra=()):
    """Buffered decode, ours and sglang's, against plain float64 decode over ``L + 2`` steps from
    the same state: every step's output, the checkpoint after the flush step (``L - 1``) and,
    at the end, the checkpoint carried over the rows buffered since (``buffered_decode_state_ref``).
    ``extra``: more (name, launch kwargs) of ours to check."""
    N, steps = 3, DECODE_RING + 2
    kernels = [("decode_buffered", LB, lambda inst, pool, s_: ours_buffered_decode(inst, pool, s_, {})),
               ("decode_buffered_factored", LB,
                lambda inst, pool, s_: ours_buffered_decode(inst, pool, s_, {"impl": "factored"}))] if ours else []
    kernels += [(name, LB, lambda inst, pool, s_, c=cfg: ours_buffered_decode(inst, pool, s_, c)) for name, cfg in extra]
    if up is not None and up.has("conv", "replayssm_decode"):
        kernels.append(("up_decode_buffered", None, up.buffered_decode))
    for name, lb, fn in kernels:
        try:
            pool, insts = make_pool(H, N, steps, 1, False, seed=21, decode_ring=True)
            pool["lb"] = lb
            ssm_r, conv_r = pool["state"].to(F64), pool["conv"].to(F64)
            slots = insts[0]["slots"]
            err, flushed_err = 0.0, None
            for s_, inst in enumerate(decode_steps(insts[0], N, steps)):
                q, k, v, a, b = (x.to(F64) for x in acts(inst, H))
                out_r = R.decode_ref(q, k, v, a, b, conv_weight=pool["w"].to(F64), A_log=pool["A_log"].to(F64),
                                     dt_bias=pool["dt_bias"].to(F64), lower_bound=lb, ssm_state=ssm_r,
                                     conv_state=conv_r, slot_indices=slots, act_dtype=BF16)
                out = fn(inst, pool, s_)
                sync()
                err = max(err, rel_err(out, out_r))
                if s_ == DECODE_RING - 1:
                    flushed_err = rel_err(pool["state"][slots.long()], ssm_r[slots.long()])
            rows = steps - DECODE_RING
            carried = torch.stack([R.buffered_decode_state_ref(pool["state"], pool["dr_d"], pool["dr_k"],
                                                               pool["dr_g"], int(sl), rows) for sl in slots])
            end_err = rel_err(carried, ssm_r[slots.long()])
            # sglang's kernel rounds the ring rows to the activation dtype for its reconstruction
            # tl.dot (bf16 tensor cores; "~1e-3 bf16 ... benign" in its source), by design: its state
            # bound is the bf16 unit roundoff 2^-8; ours keeps fp32 rows and tf32x3 dots: 1e-3
            state_tol = 2.0**-8 if name.startswith("up_") else 1e-3
            record(name, 1, err <= 2e-2 and flushed_err <= state_tol and end_err <= state_tol,
                   out=err, flushed_state=flushed_err, carried_state=end_err)
        except Exception as ex:  # noqa: BLE001
            record(name, 1, False, error=repr(ex)[:300])


def check_upstream(up, Ts, H):
    """Upstream kernels vs the same float64 reference (bf16 activations, lower_bound -5)."""
    for T in Ts:
        if T == 1:
            if up.has("conv", "packed_decode"):
                try:
                    pool, insts = make_pool(H, 6, 1, 1, False, seed=5)
                    inst = insts[0]
                    ssm_r = pool["state"].to(F64)
                    conv_r = pool["conv"].to(F64)
                    q, k, v, a, b = (x.to(F64) for x in acts(inst, H))
                    out_r = R.decode_ref(q, k, v, a, b, conv_weight=pool["w"].to(F64), A_log=pool["A_log"].to(F64),
                                         dt_bias=pool["dt_bias"].to(F64), lower_bound=LB, ssm_state=ssm_r,
                                         conv_state=conv_r, slot_indices=inst["slots"], act_dtype=BF16)
                    out = up.decode(inst, pool)
                    sync()
                    e = rel_err(out, out_r)
                    e_st = rel_err(pool["state"][1:], ssm_r[1:])
                    record("up_decode", 1, e <= 2e-2 and e_st <= 1e-3, out=e, state=e_st)
                except Exception as ex:  # noqa: BLE001
                    record("up_decode", 1, False, error=repr(ex)[:300])
            check_buffered_decode(up, H, ours=False)
            if up.fla is not None:
                try:
                    check_fla(up, H)
                except Exception as ex:  # noqa: BLE001
                    record("up_fla_decode", 1, False, error=repr(ex)[:300])
            continue
        pool, insts = make_pool(H, 5, T, 1, True, seed=7)
        inst = insts[0]
        q, k, v, a, b = (x.to(F64) for x in acts(inst, H))
        icw_r = torch.zeros(5, T, 3, pool["D"], dtype=F64, device=DEV)
        rings_r = dict(ring_rawv=torch.zeros(pool["slots"], H, T, HEAD, dtype=F64, device=DEV),
                       ring_rawk=torch.zeros(pool["slots"], H, T, HEAD, dtype=F64, device=DEV),
                       ring_g=torch.zeros(pool["slots"], H, T, HEAD, dtype=F64, device=DEV),
                       ring_beta=torch.zeros(pool["slots"], H, T, dtype=F64, device=DEV))
        out_r = R.mtp_verify_ref(q, k, v, a, b, conv_weight=pool["w"].to(F64), A_log=pool["A_log"].to(F64),
                                 dt_bias=pool["dt_bias"].to(F64), lower_bound=LB, ssm_state=pool["state"].to(F64),
                                 conv_state=pool["conv"].to(F64), slot_indices=inst["slots"], cu_seqlens=inst["cu"],
                                 num_spec=T - 1, intermediate_conv=icw_r, intermediate_rows=inst["rows"],
                                 act_dtype=BF16, **rings_r)
        for name, fn, keys in (("up_verify_unfused", up.verify_unfused, ("conv", "recurrent")),
                               ("up_verify_fused", up.verify_fused, ("fused_verify",))):
            if not up.has(*keys):
                continue
            for ring in (True, False):
                if name == "up_verify_fused" and not ring:
                    continue
                try:
                    conv0 = pool["conv"].clone()
                    o = fn(inst, pool, T, ring)
                    sync()
                    pool["conv"].copy_(conv0)
                    e = rel_err(o.reshape(out_r.shape), out_r)
                    ok = e <= 2e-2
                    if ring:
                        sl = inst["slots"].long()
                        e_k = rel_err(pool["rk"][sl][:, :, :T], rings_r["ring_rawk"][sl])
                        e_g = rel_err(pool["rg"][sl][:, :, :T], rings_r["ring_g"][sl])
                        ok &= e_k <= 1e-2 and e_g <= 1e-5
                        record(name + "_ring", T, ok, out=e, rawk=e_k, g=e_g)
                    else:
                        record(name + "_snapshot", T, ok, out=e)
                except Exception as ex:  # noqa: BLE001
                    record(name + ("_ring" if ring else "_snapshot"), T, False, error=repr(ex)[:300])
        if up.has("fold"):
            try:
                # fold the rings the reference wrote (bf16-rounded) with both folds' inputs identical
                for nm in ("rv", "rk", "rg", "rb"):
                    pool[nm].zero_()
                pool["rv"][:, :, :T] = rings_r["ring_rawv"].to(BF16)
                pool["rk"][:, :, :T] = rings_r["ring_rawk"].to(BF16)
                pool["rg"][:, :, :T] = rings_r["ring_g"].to(FP32)
                pool["rb"][:, :, :T] = rings_r["ring_beta"].to(FP32)
                ref = pool["state"].to(F64)
                R.replayssm_fold_ref(ref, pool["rv"].to(F64), pool["rk"].to(F64), pool["rg"].to(F64),
                                     pool["rb"].to(F64), inst["slots"], inst["acc"])
                up.fold(inst, pool)
                sync()
                e = rel_err(pool["state"], ref)
                record("up_fold", T, e <= 1e-5, state=e)
            except Exception as ex:  # noqa: BLE001
                record("up_fold", T, False, error=repr(ex)[:300])
        del pool, insts
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def check_fla(up, H):
    """fla's decode has no conv: check the recurrence alone on the pool's slots."""
    pool, insts = make_pool(H, 6, 1, 1, False, seed=9)
    inst = insts[0]
    S0 = pool["state"].to(F64)
    o = up.fla_decode(inst, pool)
    sync()
    q, k, v, a, b = (x.to(F64) for x in acts(inst, H))
    qn = R.l2norm(q[0]) * HEAD**-0.5
    kn = R.l2norm(k[0])
    g = R.kda_gate(a[0], pool["dt_bias"].to(F64).view(H, HEAD), pool["A_log"].to(F64), LB)
    sl = inst["slots"].long()
    S = R.delta_step(S0[sl], kn, g, torch.sigmoid(b[0]), v[0])
    o_r = R.readout(S, qn)
    e = rel_err(o.reshape(o_r.shape), o_r)
    e_s = rel_err(pool["state"][sl], S)
    record("up_fla_decode", 1, e <= 2e-2 and e_s <= 1e-3, out=e, state=e_s)


# ----------------------------------------------------------------------------------------------
# main timing loop
# ----------------------------------------------------------------------------------------------

def io_bytes(kind, N, H, T):
    """Every byte a kernel must move (state + activations + windows + rings + output), bf16 acts."""
    S = N * H * 65536
    per_tok = H * (4 * 256 + 2 + 256)  # q, k, v, a in + b + out
    icw = H * 3 * 3 * 128 * 2  # 3 window rows of the q, k, v channels, per step
    ring = H * (256 + 256 + 512 + 4)
    conv_in = N * H * 3 * 3 * 128 * 2
    if kind == "verify_ring":
        return S + conv_in + N * T * (per_tok + icw + ring)
    if kind == "verify_snapshot":
        return (1 + T) * S + conv_in + N * T * (per_tok + icw)
    if kind == "fold":
        return 2 * S + N * H * (T + 1) / 2 * (256 + 256 + 512 + 4)  # mean accept (T+1)/2
    if kind == "decode":
        return 2 * S + 2 * conv_in + N * per_tok
    if kind == "decode_buffered":  # amortised over the ring: S read, S written per L steps,
        row = H * 3 * 512  # one d / k / g row per head (fp32)
        return S + S / DECODE_RING + N * row * ((DECODE_RING - 1) / 2 + 1) + 2 * conv_in + N * per_tok
    return S


def floor_bytes(kind, N, H, T):
    S = N * H * 65536
    # S for the bookkeeping rows ("budget", "pool") that record a point that was not timed
    # buffered decode: the read-only floor S/B
    return {"verify_ring": S, "verify_snapshot": (1 + T) * S, "fold": 2 * S, "decode": 2 * S,
            "decode_buffered": S}.get(kind, S)


def rotations(N, H):
    S = N * H * 65536
    return int(min(16, max(1, math.ceil(256 * 2**20 / S))))


# rows that --kernel-profile breaks down by GPU kernel (whole steps and decodes, ours and upstream)
PROFILED_KERNELS = ("step_", "up_step", "decode", "up_decode")


def point_tasks(H, N, T, pool, insts, up, configs, ok, snapshot):
    """(kernel, who, cfg, calls, skip_reason) for every timing at one (H, N, T) point."""
    out = []
    if T == 1:
        for cfg in configs.get("decode", [{}]):
            out.append(("decode", "ours", cfg, [lambda i=i, c=cfg: ours_decode(i, pool, c) for i in insts],
                        None if ok("decode", 1) else "check failed"))
        if up.has("conv", "packed_decode"):
            out.append(("up_decode", "sglang", None, [lambda i=i: up.decode(i, pool) for i in insts],
                        None if ok("up_decode", 1) else "check failed"))
        if up.fla is not None:
            out.append(("up_fla_decode", "fla", None, [lambda i=i: up.fla_decode(i, pool) for i in insts],
                        None if ok("up_fla_decode", 1) else "check failed"))
        if "dr_d" in pool:  # two ring lengths of steps per instance, so the flushes are paid
            ring_steps = range(2 * DECODE_RING)
            # the default launch, and the factored step (no state formed between flushes; 2026-12-04)
            # at its default launch and the other spill-free tiles of benchmarks/sass_report.py
            for cfg in ({}, {"impl": "factored"}, {"impl": "factored", "block_v": 16, "num_warps": 1},
                        {"impl": "factored", "block_v": 32, "num_warps": 2},
                        {"impl": "factored", "block_v": 16, "num_warps": 4}):
                name = "decode_buffered_factored" if cfg.get("impl") == "factored" else "decode_buffered"
                out.append(("decode_buffered", "ours", cfg or None,
                            [lambda i=i, s_=s_, c=cfg: ours_buffered_decode(i, pool, s_, c)
                             for s_ in ring_steps for i in insts],
                            None if ok(name, 1) else "check failed"))
            if up.has("conv", "replayssm_decode"):
                out.append(("up_decode_buffered", "sglang", None,
                            [lambda i=i, s_=s_: up.buffered_decode(i, pool, s_) for s_ in ring_steps for i in insts],
                            None if ok("up_decode_buffered", 1) else "check failed"))
        return out
    for ring in (True, False):
        kname = "verify_ring" if ring else "verify_snapshot"
        if not ring and not snapshot:
            continue
        for cfg in configs.get(kname, [{}]):
            cks = [kname]
            if ring and cfg.get("impl") in ("rows", "chunked", "gluon"):
                cks = [check_name(cfg)]
            elif ring:  # the default picks either kernel by (N, H, T): both must have passed
                cks = [kname, "verify_ring_rows", "verify_ring_chunked"]
            out.append((kname, "ours", cfg, [lambda i=i, c=cfg, r=ring: ours_verify(i, pool, T, r, c) for i in insts],
                        None if all(ok(c, T) for c in cks) else "check failed"))
        for upn, fn, keys in (("up_verify_unfused", up.verify_unfused, ("conv", "recurrent")),
                              ("up_verify_fused", up.verify_fused, ("fused_verify",))):
            if not up.has(*keys) or (upn == "up_verify_fused" and not ring):
                continue  # the opt-in fused verify is timed in ring mode only
            name = upn + ("_ring" if ring else "_snapshot")
            out.append((name, "sglang", None, [lambda i=i, f=fn, r=ring: f(i, pool, T, r) for i in insts],
                        None if ok(name, T) else "check failed"))
    # whole speculative steps (verify + commit) over SPEC_STEPS * T consecutive steps with accept
    # lengths uniform in 1..T (>= 2 ring lengths of tokens at both lazy ring lengths: flushes paid)
    steps_of = [(i, a_) for a_i in range(SPEC_STEPS * T) for i in insts for a_ in [i["acc_steps"][a_i]]]
    ver_ok = ok("verify_ring", T) and ok("verify_ring_chunked", T) and ok("fold", T)
    out.append(("step_eager", "ours", None, [lambda i=i, a_=a_: ours_step_eager(i, pool, T, a_) for i, a_ in steps_of],
                None if ver_ok else "check failed"))
    # the step with other verify launches: those of --configs, then the Gluon stream's
    for cfg in configs.get("step_eager", []) + ([c for _, c in gluon_configs()] if gluon_here() else []):
        out.append(("step_eager", "ours", cfg,
                     [lambda i=i, a_=a_, c=cfg: ours_step_eager(i, pool, T, a_, c) for i, a_ in steps_of],
                     None if ok(check_name(cfg) if cfg.get("impl") else "verify_ring", T) and ok("fold", T)
                     else "check failed"))
    for lz in pool["lazy"]:
        out.append((f"step_lazy_L{lz['L']}", "ours", None,
                    [lambda i=i, a_=a_, lz=lz: ours_step_lazy(i, pool, T, lz, a_) for i, a_ in steps_of],
                    None if ver_ok else "check failed"))
    if up.has("fold") and up.has("conv", "recurrent"):
        # SGLang's default verify on the H200 (the fused Triton verify is opt-in, and 6x slower there:
        # 768 against 130 us at H=32, N=64, T=4, docs/design/lazy-record-ring.md)
        upv, name = up.verify_unfused, "up_verify_unfused_ring"

        def up_step(i, a_):
            upv(i, pool, T, True)
            up.fold(dict(i, acc=a_), pool)
        out.append(("up_step", "sglang", None, [lambda i=i, a_=a_: up_step(i, a_) for i, a_ in steps_of],
                    None if ok(name, T) and ok("up_fold", T) else "check failed"))
    fold_ok = ok("fold", T)
    for cfg in configs.get("fold", [{}]):
        out.append(("fold", "ours", cfg, [lambda i=i, c=cfg: ours_fold(i, pool, False, c) for i in insts],
                    None if fold_ok else "check failed"))
    out.append(("fold_conv", "ours", None, [lambda i=i: ours_fold(i, pool, True, {}) for i in insts],
                None if fold_ok else "check failed"))
    if up.has("fold"):
        out.append(("up_fold", "sglang", None, [lambda i=i: up.fold(i, pool) for i in insts],
                    None if ok("up_fold", T) else "check failed"))
    return out


def _precompile_worker(job):
    """Run every call of some points once (R = 1) so Triton's on-disk cache holds the binaries."""
    points, argd, configs, checks = job
    import upstream_kernels as U
    up = Upstream({}, None)
    if not argd["no_upstream"]:
        mods, _src, _errs = U.load_sglang(argd["upstream_root"])
        fla_fn, _ = U.load_fla()
        up = Upstream(mods, fla_fn)
    n_ok = 0
    for H, N, T in points:
        pool, insts = make_pool(H, N, T, 1, (not argd["no_snapshot"]) and T > 1)
        for kernel, who, cfg, calls, why in point_tasks(H, N, T, pool, insts, up, configs,
                                                       lambda k, t: checks.get(f"{k}@{t}", False),
                                                       not argd["no_snapshot"]):
            if why:
                continue
            try:
                calls[0]()
                n_ok += 1
            except Exception:  # noqa: BLE001
                pass
        torch.cuda.synchronize()
        del pool, insts
        torch.cuda.empty_cache()
    return n_ok


def configs_for(args):
    cfgs = sweep_configs() if args.sweep else candidate_configs() if args.candidates else {}
    if args.configs:
        # ring-verify launches given on the command line, timed alone and in the whole step
        extra = json.loads(args.configs)
        cfgs = dict(cfgs, verify_ring=cfgs.get("verify_ring", [{}]) + extra, step_eager=extra)
    return cfgs


def _job(job):
    """One unit of the parallel phase: a check (returns its CHECKS entries) or warming points."""
    kind, argd = job[0], job[-1]
    up = Upstream({}, None)
    if not argd["no_upstream"] and kind in ("check_up", "warm"):
        import upstream_kernels as U
        mods, _src, _errs = U.load_sglang(argd["upstream_root"])
        fla_fn, _ = U.load_fla()
        up = Upstream(mods, fla_fn)
    if kind == "check_ours":
        _, H, T, combos, _a = job
        check_ours([T], H, combos)
    elif kind == "check_up":
        _, H, T, _a = job
        check_upstream(up, [T], H)
    else:
        _, points, configs, _a = job
        for H, N, T in points:
            pool, insts = make_pool(H, N, T, 1, (not argd["no_snapshot"]) and T > 1, decode_ring=T == 1)
            for kernel, who, cfg, calls, why in point_tasks(H, N, T, pool, insts, up, configs, lambda k, t: True,
                                                           not argd["no_snapshot"]):
                try:
                    calls[0]()
                except Exception:  # noqa: BLE001
                    pass
            sync()
            del pool, insts
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    sync()
    return {f"{k}\t{t}": v for (k, t), v in CHECKS.items()}, list(LOG)


def parallel_checks_and_warm(points, args, Ts, Hs, configs):
    import multiprocessing as mp
    argd = dict(no_upstream=args.no_upstream, upstream_root=args.upstream_root, no_snapshot=args.no_snapshot)
    Hc = max(Hs)
    jobs = []
    for T in sorted(Ts, reverse=True):  # longest windows (slowest compiles) first
        for combo in ((BF16, LB), (FP32, None)):
            jobs.append(("check_ours", Hc, T, (combo,), argd))
    if not args.no_upstream:
        for H in Hs:
            for T in Ts:
                jobs.append(("check_up", H, T, argd))
    for T in sorted({p[2] for p in points}, reverse=True):  # one job per window: compiles are per T
        jobs.append(("warm", [p for p in points if p[2] == T], configs, argd))
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.jobs) as pool:
        results = pool.map(_job, jobs, chunksize=1)
    for checks, logs in results:
        for key, v in checks.items():
            k, t = key.split("\t")
            t = int(t)
            prev = CHECKS.get((k, t))
            if prev is None:
                CHECKS[(k, t)] = v
            else:
                ok = prev["ok"] and v["ok"]
                CHECKS[(k, t)] = {**prev, **v, "ok": ok}
        for line in logs:
            if "CHECK FAILED" in line:
                log(line)


def precompile(points, args, configs, checks):
    import multiprocessing as mp
    order = sorted(points, key=lambda p: -p[0] * p[1] * p[2])  # big first, dealt round-robin
    jobs = [order[i::args.jobs] for i in range(args.jobs)]
    argd = dict(no_upstream=args.no_upstream, upstream_root=args.upstream_root, no_snapshot=args.no_snapshot)
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.jobs) as pool:
        done = pool.map(_precompile_worker, [(j, argd, configs, checks) for j in jobs if j])
    log(f"precompiled {sum(done)} calls")


def run(args):
    argv = sys.argv
    env = environment(argv)
    log("env", json.dumps(env))
    out_dir = args.out or os.environ.get("OUT") or os.path.join(ROOT, "out")
    os.makedirs(out_dir, exist_ok=True)

    Ns = [int(x) for x in args.N.split(",")] if args.N else ([8, 64, 256] if args.quick else [1, 8, 32, 64, 128, 256])
    Hs = [int(x) for x in args.H.split(",")] if args.H else ([32] if args.quick else [32, 12])
    Ts = [int(x) for x in args.T.split(",")] if args.T else ([1, 4, 8] if args.quick else [1, 4, 8, 16])
    if INTERPRET:
        Ns, Hs, Ts = [1, 2], [2], [t for t in Ts if t <= 4][:2]
    rep = args.rep
    snapshot = not args.no_snapshot

    # upstream
    up = Upstream({}, None)
    notes = []
    if not args.no_upstream:
        import upstream_kernels as U
        mods, src, errs = U.load_sglang(args.upstream_root)
        fla_fn, fla_note = U.load_fla()
        up = Upstream(mods, fla_fn)
        notes.append(f"upstream sglang: {src}; loaded {sorted(mods)}" + (f"; errors {errs}" if errs else ""))
        notes.append(f"upstream fla: {fla_note}")
        notes.append("sglang's CUDA-JIT packed decode (tvm_ffi, B >= 8) cannot run without the sglang runtime: "
                     "the Triton packed decode it falls back to is timed instead")
    else:
        notes.append("upstream: not requested (--no-upstream)")
    for n_ in notes:
        log("note:", n_)

    t0 = time.time()
    log("== checks ==")
    points = [(H, N, T) for H in Hs for T in Ts for N in Ns if not (INTERPRET and N * T > 8)]
    if args.jobs > 1 and (not INTERPRET or os.environ.get("BENCH_FORCE_PARALLEL") == "1"):
        # checks and a first call of every timed kernel (compiles into Triton's disk cache) in
        # parallel processes; the timing below then finds every binary compiled
        parallel_checks_and_warm(points, args, Ts, Hs, configs_for(args))
    else:
        for H in sorted(set(Hs)):
            check_ours(Ts, min(H, 4) if args.quick else H)
            if not args.no_upstream:
                check_upstream(up, Ts, min(H, 4) if args.quick else H)
    sync()
    log(f"checks done in {time.time() - t0:.1f}s: " + ", ".join(
        f"{k}@T{t}={'ok' if v['ok'] else 'FAIL'}" for (k, t), v in sorted(CHECKS.items())))

    def ok(kernel, T):
        c = CHECKS.get((kernel, T))
        return c is not None and c["ok"]

    bw = copy_bandwidth(args.quick)
    log(f"copy bandwidth {bw:.3f} TB/s")

    rows = []
    configs = configs_for(args)

    def add(kernel, who, H, N, T, us, cfg=None, note=None):
        kind = kernel.replace("up_", "").replace("_unfused", "").replace("_fused", "")
        kind = {"verify_ring": "verify_ring", "verify_snapshot": "verify_snapshot", "fold": "fold",
                "fold_conv": "fold", "decode": "decode", "fla_decode": "decode",
                "decode_buffered": "decode_buffered"}.get(kind, kind)
        fb = floor_bytes(kind, N, H, T)
        r = dict(kernel=kernel, who=who, H=H, N=N, T=T, us=us, floor_us=fb / (bw * 1e12) * 1e6,
                 io_floor_us=io_bytes(kind, N, H, T) / (bw * 1e12) * 1e6, cfg=cfg, note=note)
        rows.append(r)
        if us is not None:
            log(f"  {kernel:28s} H={H:2d} N={N:3d} T={T:2d} {us:9.2f} us  x{us / r['floor_us']:.2f} floor"
                + (f"  cfg={cfg}" if cfg else ""))
        else:
            log(f"  {kernel:28s} H={H:2d} N={N:3d} T={T:2d} skipped: {note}")

    def timed(kernel, who, H, N, T, calls, cfg=None):
        try:
            us = time_graph(calls, rep)
            add(kernel, who, H, N, T, us, cfg)
            if args.kernel_profile and not cfg and kernel.startswith(PROFILED_KERNELS):
                try:  # a profiler failure must not cost the timing above
                    rows[-1]["kernels_us"] = per = kernel_breakdown(calls)
                    log("    per kernel (us per call): " + "; ".join(f"{k} {v:.1f}" for k, v in per.items()))
                except Exception as ex:  # noqa: BLE001
                    log(f"    per kernel: profiler failed: {type(ex).__name__}: {str(ex)[:200]}")
            return us
        except Exception as ex:  # noqa: BLE001
            add(kernel, who, H, N, T, None, cfg, note=f"error {type(ex).__name__}: {str(ex)[:200]}")
            log(traceback.format_exc(limit=2))
            return None

    log("== timing ==")
    if args.wait_file:  # e.g. a test run sharing the GPU: start timing only once it is done
        tw = time.time()
        while not os.path.exists(args.wait_file) and time.time() - tw < 240:
            time.sleep(2)
        log(f"waited {time.time() - tw:.0f}s for {args.wait_file}")
    partial = os.path.join(out_dir, f"bench_kernels{args.tag}.partial.json")
    for H, N, T in points:
        if args.budget and time.time() - t0 > args.budget:
            add("budget", "-", H, N, T, None, note=f"time budget {args.budget}s spent: not timed")
            continue
        Rn = 1 if INTERPRET else rotations(N, H)
        try:
            pool, insts = make_pool(H, N, T, Rn, snapshot and T > 1, decode_ring=T == 1)
        except torch.cuda.OutOfMemoryError:
            add("pool", "-", H, N, T, None, note="OOM building the pool")
            continue
        for kernel, who, cfg, calls, why in point_tasks(H, N, T, pool, insts, up, configs, ok, snapshot):
            if why:
                add(kernel, who, H, N, T, None, cfg, note=why)
            else:
                timed(kernel, who, H, N, T, calls, cfg)
        del pool, insts
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with open(partial, "w") as f:
            json.dump(dict(env=env, bandwidth_TBps=bw, rows=rows), f, default=str)
    # noise: time two entries a second time
    noise = []
    if not INTERPRET and not args.sweep:
        for kernel in ("verify_ring", "fold"):
            cand = [r for r in rows if r["kernel"] == kernel and r["us"] is not None and r["N"] == 64 and r["H"] == 32]
            if cand:
                r0 = cand[-1]
                pool, insts = make_pool(r0["H"], r0["N"], r0["T"], rotations(r0["N"], r0["H"]), False)
                c0 = r0["cfg"] or {}
                if kernel == "verify_ring":
                    calls = [lambda i=i: ours_verify(i, pool, r0["T"], True, c0) for i in insts]
                else:
                    calls = [lambda i=i: ours_fold(i, pool, False, c0) for i in insts]
                us2 = time_graph(calls, rep)
                noise.append(dict(kernel=kernel, H=r0["H"], N=r0["N"], T=r0["T"], first=r0["us"], second=us2))
                del pool, insts
    result = dict(env=env, bandwidth_TBps=bw, notes=notes, checks={f"{k}@T{t}": v for (k, t), v in CHECKS.items()},
                  rows=rows, noise=noise, elapsed_s=time.time() - t0)
    table = make_table(rows, bw, Hs, Ns, Ts)
    with open(os.path.join(out_dir, f"bench_kernels{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out_dir, f"bench_kernels{args.tag}.md"), "w") as f:
        f.write(table["md"])
    with open(os.path.join(out_dir, f"bench_kernels{args.tag}.log"), "w") as f:
        f.write("\n".join(LOG))
    if os.path.exists(os.path.join(out_dir, f"bench_kernels{args.tag}.partial.json")):
        os.remove(os.path.join(out_dir, f"bench_kernels{args.tag}.partial.json"))
    print()
    for n_ in noise:
        print(f"noise: {n_['kernel']} H={n_['H']} N={n_['N']} T={n_['T']}: {n_['first']:.2f} vs {n_['second']:.2f} us")
    print(f"copy bandwidth {bw:.3f} TB/s; {env.get('gpu', 'cpu')}; torch {env['torch']} triton {env['triton']}; "
          f"{time.time() - t0:.0f}s")
    if args.sweep or args.candidates:
        summ = sweep_summary(rows)
        with open(os.path.join(out_dir, f"bench_kernels{args.tag}.log"), "a") as f:
            f.write("\n== best configuration per point ==\n" + summ + "\n")
        if args.sweep:
            print(summ)
    print(table["text"])
    failed = [f"{k}@T{t}" for (k, t), v in CHECKS.items() if not v["ok"]]
    if failed:
        print("CHECKS FAILED (not timed):", ", ".join(failed))
    return 1 if any(k in ("verify_ring", "verify_snapshot", "fold", "decode") for (k, _t) in
                    [(k, t) for (k, t), v in CHECKS.items() if not v["ok"]]) else 0


def best(rows, H, N, T, kernels):
    """Ours: the wrappers' default launch (cfg {} / None) when it was timed, else the fastest
    configuration; upstream: the fastest of the given kernels."""
    c = [r for r in rows if r["H"] == H and r["N"] == N and r["T"] == T and r["kernel"] in kernels
         and r["us"] is not None]
    d = [r for r in c if r["who"] == "ours" and not r["cfg"]]
    if d:
        return d[0]
    return min(c, key=lambda r: r["us"]) if c else None


def make_table(rows, bw, Hs, Ns, Ts):
    """Text + markdown table: one line per (H, N, T)."""
    hdr = ["H", "N", "T", "verify ring µs (×floor, ×up)", "fold µs (×floor, ×up)", "verify+fold ×up",
           "snapshot µs (×floor, ×up)", "decode µs (×floor, ×up)", "up ring best µs", "up fold µs", "up snap best µs",
           "up decode µs"]
    lines = []

    def fmt(r, up):
        if r is None:
            return "-"
        s = f"{r['us']:.1f} ({r['us'] / r['floor_us']:.2f}"
        if up is not None:
            s += f", {up['us'] / r['us']:.2f}x"
        return s + ")"

    for H in Hs:
        for T in Ts:
            for N in Ns:
                if T == 1:
                    d = best(rows, H, N, 1, ["decode"])
                    ud = best(rows, H, N, 1, ["up_decode", "up_fla_decode"])
                    if d is None and ud is None:
                        continue
                    lines.append([H, N, T, "-", "-", "-", "-", fmt(d, ud), "-", "-", "-",
                                  f"{ud['us']:.1f} ({ud['kernel'].replace('up_', '')})" if ud else "-"])
                    continue
                v = best(rows, H, N, T, ["verify_ring"])
                f = best(rows, H, N, T, ["fold"])
                s = best(rows, H, N, T, ["verify_snapshot"])
                uv = best(rows, H, N, T, ["up_verify_unfused_ring", "up_verify_fused_ring"])
                uf = best(rows, H, N, T, ["up_fold"])
                us_ = best(rows, H, N, T, ["up_verify_unfused_snapshot", "up_verify_fused_snapshot"])
                if v is None and f is None and s is None and uv is None:
                    continue
                step = f"{(uv['us'] + uf['us']) / (v['us'] + f['us']):.2f}x" if (v and f and uv and uf) else "-"
                lines.append([H, N, T, fmt(v, uv), fmt(f, uf), step, fmt(s, us_), "-",
                              f"{uv['us']:.1f}" + (" (fused)" if uv and "_fused_" in uv["kernel"] else "") if uv else "-",
                              f"{uf['us']:.1f}" if uf else "-",
                              f"{us_['us']:.1f}" + (" (fused)" if us_ and "_fused_" in us_["kernel"] else "") if us_ else "-",
                              "-"])
    text, md = _render(hdr, lines)
    # whole speculative steps: verify + commit, ours fold-every-commit vs the lazy record ring
    # (two ring lengths) vs upstream (its verify + fold; its conv roll is a separate launch not timed)
    shdr = ["H", "N", "T", "eager step µs", "lazy L=2T µs (×eager, ×up)", "lazy L=4T µs (×eager, ×up)", "up step µs"]
    slines = []
    for H in Hs:
        for T in Ts:
            for N in Ns:
                e = best(rows, H, N, T, ["step_eager"])
                lz = [r for r in rows if (r["H"], r["N"], r["T"]) == (H, N, T) and r["kernel"].startswith("step_lazy")
                      and r["us"] is not None]
                u = best(rows, H, N, T, ["up_step"])
                if e is None and not lz:
                    continue
                cells = []
                for r in sorted(lz, key=lambda r: int(r["kernel"].split("_L")[1]))[:2]:
                    c = f"{r['us']:.1f} (L={r['kernel'].split('_L')[1]}"
                    c += f", {e['us'] / r['us']:.2f}x" if e else ""
                    c += f", {u['us'] / r['us']:.2f}x" if u else ""
                    cells.append(c + ")")
                cells += ["-"] * (2 - len(cells))
                slines.append([H, N, T, f"{e['us']:.1f}" if e else "-", *cells, f"{u['us']:.1f}" if u else "-"])
    if slines:
        t2, m2 = _render(shdr, slines)
        text += "\n\nspeculative step (verify + commit)\n" + t2
        md += "\n**Speculative step (verify + commit)**\n\n" + m2
    return dict(text=text, md=md)


def _render(hdr, lines):
    widths = [max(len(str(x)) for x in col) for col in zip(hdr, *lines)] if lines else [len(h) for h in hdr]
    text = "  ".join(h.ljust(w) for h, w in zip(hdr, widths)) + "\n"
    text += "\n".join("  ".join(str(x).ljust(w) for x, w in zip(ln, widths)) for ln in lines)
    md = "| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr) + "\n"
    md += "\n".join("| " + " | ".join(str(x) for x in ln) + " |" for ln in lines) + "\n"
    return text, md


def sweep_configs():
    """Launch configurations timed by --sweep (passed through the wrappers' tuning kwargs) around
    today's defaults ({}): the chunked ring verify's prep tiles (channels per chunk, warps), the
    recurrent verify's row tiles in both modes, the chunked streaming kernel's tiles (V rows,
    warps, K chunk, pipeline stages) and the fold's."""
    tiles = ((8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 2), (64, 4))
    v = [{}] + [dict(impl="rows", block_v=bv, num_warps=w) for bv, w in tiles]
    v += [dict(impl="chunked", prep_block_k=bk, prep_num_warps=w)
          for bk, w in ((16, 1), (32, 1), (64, 1), (32, 2), (64, 2), (128, 2))]
    v += [dict(impl="chunked", block_v=bv, num_warps=w)
          for bv, w in ((32, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8))]
    v += [dict(impl="chunked", block_k=64), dict(impl="chunked", num_stages=2), dict(impl="chunked", num_stages=4)]
    s = [{}] + [dict(block_v=bv, num_warps=w) for bv, w in tiles]
    f = [{}] + [dict(block_v=bv, num_warps=w) for bv, w in ((4, 1), (8, 1), (16, 1))]
    return dict(verify_ring=v, verify_snapshot=s, fold=f, decode=[{}])


def candidate_configs():
    """Launch configurations timed at every point of the final table besides the wrappers'
    defaults (sglang_dspark_plugin/kernels/launch_config.py): each ring-verify kernel forced (with the
    table's tiles for it), which shows the table's kernel choice at every point."""
    return dict(
        verify_ring=[{}, dict(impl="rows"), dict(impl="chunked")] + ([c for _, c in gluon_configs()] if gluon_here()
                                                                      else []),
        verify_snapshot=[{}],
        fold=[{}],
        decode=[{}],
    )


def sweep_summary(rows):
    """Best configuration per (kernel, H, N, T) and the spread over configurations."""
    lines = []
    keys = sorted({(r["kernel"], r["H"], r["N"], r["T"]) for r in rows if r["who"] == "ours" and r["cfg"]})
    for k in keys:
        c = [r for r in rows if (r["kernel"], r["H"], r["N"], r["T"]) == k and r["us"] is not None]
        if not c:
            continue
        c.sort(key=lambda r: r["us"])
        b = c[0]
        rows_impl = [r for r in c if (r["cfg"] or {}).get("impl") == "rows"]
        lines.append(f"{k[0]:16s} H={k[1]:2d} N={k[2]:3d} T={k[3]:2d} best {b['us']:8.2f} us x{b['us'] / b['floor_us']:.2f} "
                     f"{b['cfg']}; 2nd {c[1]['us'] if len(c) > 1 else float('nan'):.2f}; worst {c[-1]['us']:.2f}"
                     + (f"; rows-impl {rows_impl[0]['us']:.2f}" if rows_impl else ""))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in {8,64,256}, H=32, T in {1,4,8}: one short run")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else ./out)")
    ap.add_argument("--N", default=None, help="comma list of batch sizes")
    ap.add_argument("--H", default=None, help="comma list of head counts")
    ap.add_argument("--T", default=None, help="comma list of window lengths (1 = decode)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--sweep", action="store_true", help="time many launch configs of our kernels (tuning)")
    ap.add_argument("--candidates", action="store_true",
                    help="time the few candidate launch configs of the launch table at every point")
    ap.add_argument("--no-upstream", action="store_true")
    ap.add_argument("--no-snapshot", action="store_true", help="skip snapshot-mode verify (saves memory/time)")
    ap.add_argument("--upstream-root", default=None, help="staged sglang kernels (default .whl/upstream)")
    ap.add_argument("--jobs", type=int, default=8, help="processes that compile every kernel first (1 = none)")
    ap.add_argument("--budget", type=float, default=0, help="stop timing new points after this many seconds")
    ap.add_argument("--tag", default="", help="suffix of the output file names")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="also break whole steps and decodes down by GPU kernel (torch profiler over the graph)")
    ap.add_argument("--wait-file", default=None, help="wait for this file to exist before timing")
    ap.add_argument("--configs", default=None,
                    help='JSON list of ring-verify launches (mtp_verify kwargs) to time alone and in the step, '
                         'e.g. \'[{"impl": "chunked", "prep_block_k": 128}]\'')
    args = ap.parse_args()
    sys.exit(run(args))


if __name__ == "__main__":
    main()
