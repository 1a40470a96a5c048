"""Kimi-K3's output gate on one GPU: our KDA step with the gate fused, ours without it plus SGLang's
``o_norm`` kernel, and SGLang's own path, timed side by side in one run.

    python3 benchmarks/bench_output_gate.py [--H 12,32] [--N 64,256] [--T 1,4,8] [--out DIR]

Rows per (H, N, T), bf16 activations, fp32 state, K3's gate ``lower_bound = -5``; the ``o_norm``
of the unfused rows is SGLang's ``FusedRMSNormGated`` (sigmoid, bf16 weight) on the model's
strided gate view, as ``kimi_k3.py`` calls it:

* T = 1 (decode): ``ours+gate`` (decode, gate fused), ``ours, o_norm`` (decode, then o_norm),
  ``sglang, o_norm`` (conv update + packed decode, then o_norm: SGLang's chain when its fused
  decode does not apply) and ``sglang fused`` (its K3 CUDA-JIT ``kda_fused_decode``: conv,
  recurrence and o_norm in one kernel; H in {3, 6, 12} only, and only where its JIT builds).
* T > 1 (a speculative step of ``T``-token windows): ``ours+gate`` (verify with the gate fused,
  then the commit the backend runs: the lazy record ring up to 4-token windows, else the fold),
  ``ours, o_norm`` (the same, o_norm after the verify), ``sglang, o_norm`` (its unfused Triton
  verify with the rings, o_norm, its fold). ``verify+gate`` / ``verify`` time the verify alone,
  with and without the fused gate (its cost).

Every call is captured ``R`` times in one CUDA graph over disjoint slot sets and timed with
``benchmarks/bench_kernels.py``'s ``time_graph`` (median, L2 flushed). Before timing, the fused
result is checked against o_norm of the unfused one (one bf16 ulp). Writes
``bench_output_gate.json`` to ``--out`` (default ``$OUT``) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_kernels as BK  # noqa: E402  (sets up sys.path and the interpreter on CPU)
import torch  # noqa: E402

from sglang_dspark_plugin.kernels import decode, mtp_verify, replayssm_fold  # noqa: E402
from sglang_dspark_plugin.kernels.record_ring import commit_records  # noqa: E402

BF16, FP32, HEAD = torch.bfloat16, torch.float32, 128
EPS = 1e-5
LAZY_MAX_WINDOW = 4  # the backend's default: the lazy record ring up to 4-token windows


def add_gates(pool, insts, seed=1):
    """Per instance: the gate as the model hands it over (the last quarter of a fused [q|k|v|g]
    projection row, ``[ntok, H*128]``), and o_norm's weight (bf16 values; fp32 for our kernels)."""
    H = pool["H"]
    g = torch.Generator(device=BK.DEV).manual_seed(seed)
    for inst in insts:
        ntok = inst["mixed"].shape[0]
        fused = torch.randn(ntok, 4 * H * HEAD, generator=g, device=BK.DEV).to(BF16)
        inst["gate2"] = fused[:, 3 * H * HEAD:]
    pool["onorm_w_bf16"] = (1 + 0.2 * torch.randn(HEAD, generator=g, device=BK.DEV)).to(BF16)
    pool["onorm_w"] = pool["onorm_w_bf16"].float().contiguous()
    pool["gate_ws"] = torch.zeros(max(inst["N"] for inst in insts) * H, dtype=torch.int32, device=BK.DEV)


def gate_kwargs(inst, pool, workspace=True):
    ntok, H = inst["gate2"].shape[0], pool["H"]
    kw = dict(output_gate=inst["gate2"].view(1, ntok, H, HEAD), output_norm_weight=pool["onorm_w"],
              output_norm_eps=EPS)
    if workspace:
        kw["output_gate_workspace"] = pool["gate_ws"]
    return kw


class ONorm:
    """SGLang's ``o_norm`` of a K3 KDA layer: ``FusedRMSNormGated(128, eps, activation="sigmoid")``."""

    def __init__(self, weight_bf16):
        FusedRMSNormGated = UP.m["norm_gate"].FusedRMSNormGated  # installed or staged (upstream_kernels)
        self.mod = FusedRMSNormGated(HEAD, eps=EPS, activation="sigmoid").to(BK.DEV)
        self.mod.weight.data = weight_bf16.clone()

    def __call__(self, out, gate2):
        return self.mod(out, gate2.unflatten(-1, (-1, HEAD)))


def verify(inst, pool, T, lazy_ring=None, gate=False):
    H = pool["H"]
    if lazy_ring is not None:
        lz = lazy_ring
        mode = dict(ring_rawv=lz["rv"], ring_rawk=lz["rk"], ring_g=lz["rg"], ring_beta=lz["rb"],
                    record_cursor=lz["cursor"], ring_delta=(lz["hi"], lz["lo"]))
    else:
        mode = dict(ring_rawv=pool["rv"], ring_rawk=pool["rk"], ring_g=pool["rg"], ring_beta=pool["rb"])
    return mtp_verify(*BK.acts(inst, H), conv_weight=pool["w"], A_log=pool["A_log"], dt_bias=pool["dt_bias"],
                      lower_bound=pool["lb"], ssm_state=pool["state"], conv_state=pool["conv"],
                      slot_indices=inst["slots"], cu_seqlens=inst["cu"], num_spec=T - 1,
                      intermediate_conv=pool["icw"], intermediate_rows=inst["rows"], out=inst["out"],
                      **mode, **(gate_kwargs(inst, pool) if gate else {}))


def commit(inst, pool, T, lazy_ring, acc):
    if lazy_ring is not None:
        commit_records(lazy_ring["cursor"], inst["slots"], acc, pool["conv"][None], pool["icw"][None], inst["rows"],
                       steps=T, ring_len=lazy_ring["L"])
    else:
        replayssm_fold(pool["state"], pool["rv"], pool["rk"], pool["rg"], pool["rb"], inst["slots"], acc,
                       conv_state=pool["conv"], intermediate_conv=pool["icw"], intermediate_rows=inst["rows"])


def ours_decode(inst, pool, gate):
    return decode(*BK.acts(inst, pool["H"]), conv_weight=pool["w"], A_log=pool["A_log"], dt_bias=pool["dt_bias"],
                  lower_bound=pool["lb"], ssm_state=pool["state"], conv_state=pool["conv"],
                  slot_indices=inst["slots"], out=inst["out"],
                  **(gate_kwargs(inst, pool, workspace=False) if gate else {}))


class SGLangFusedDecode:
    """SGLang's K3 fused decode (``kda_fused_decode``), with the static arguments its K3 layer
    prepares (``_prepare_fused_decode``)."""

    def __init__(self, pool):
        from sglang.kernels.ops.attention import kda_fused_decode as kfd

        self.kfd = kfd
        H = pool["H"]
        seg = H * HEAD
        wt = pool["w"].t().contiguous()
        self.w = (wt[:, :seg].contiguous(), wt[:, seg:2 * seg].contiguous(), wt[:, 2 * seg:].contiguous())
        self.bias = torch.zeros(3 * seg, dtype=FP32, device=BK.DEV)

    def covered(self, inst, pool):
        return self.kfd.covered(inst["mixed"], inst["a2"], inst["b2"], pool["conv"], pool["state"], inst["slots"],
                                inst["gate2"])

    def __call__(self, inst, pool):
        return self.kfd.kda_fused_decode(inst["mixed"], inst["a2"], inst["b2"], pool["conv"], *self.w, self.bias,
                                         pool["A_log"], pool["dt_bias"], inst["gate2"], pool["onorm_w"],
                                         pool["state"], inst["slots"], scale=HEAD ** -0.5, onorm_eps=EPS,
                                         lower_bound=pool["lb"])


def check(pool, inst, T, onorm, lazy_ring):
    """The fused gate equals o_norm of the unfused output within one bf16 ulp (state restored
    between the two calls). Returns the largest relative difference."""
    state, conv = pool["state"].clone(), pool["conv"].clone()
    cursor = None if lazy_ring is None else lazy_ring["cursor"].clone()
    if T == 1:
        plain = onorm(ours_decode(inst, pool, gate=False).clone(), inst["gate2"])
    else:
        plain = onorm(verify(inst, pool, T, lazy_ring).clone(), inst["gate2"])
    pool["state"].copy_(state)
    pool["conv"].copy_(conv)
    if cursor is not None:
        lazy_ring["cursor"].copy_(cursor)
    fused = ours_decode(inst, pool, gate=True) if T == 1 else verify(inst, pool, T, lazy_ring, gate=True)
    pool["state"].copy_(state)
    pool["conv"].copy_(conv)
    diff = (fused.float() - plain.float()).abs()
    bound = plain.float().abs() * 2.0 ** -7 + 1e-6
    if not bool((diff <= bound).all()):
        raise AssertionError(f"fused gate differs from o_norm by more than one bf16 ulp: max {float(diff.max())}")
    return float((diff / plain.float().abs().clamp_min(1e-3)).max())


def run_point(H, N, T, rep, rows, notes):
    R = BK.rotations(N, H)
    pool, insts = BK.make_pool(H, N, T, R, snapshot=False)
    add_gates(pool, insts)
    onorm = ONorm(pool["onorm_w_bf16"])
    lazy = pool["lazy"][0] if (T > 1 and T <= LAZY_MAX_WINDOW) else None
    S = N * H * HEAD * HEAD * 4
    base = dict(H=H, N=N, T=T, state_bytes=S)
    err = check(pool, insts[0], T, onorm, lazy)

    def timed(name, fn):
        try:
            us = BK.time_graph([(lambda inst=inst: fn(inst)) for inst in insts], rep)
            rows.append(dict(base, kernel=name, us=us))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(base, kernel=name, us=None, error=f"{type(e).__name__}: {str(e)[:300]}"))
            notes.append(f"H={H} N={N} T={T} {name}: {type(e).__name__}: {str(e)[:300]}")

    if T == 1:
        timed("ours+gate", lambda inst: ours_decode(inst, pool, True))
        timed("ours, o_norm", lambda inst: onorm(ours_decode(inst, pool, False), inst["gate2"]))
        if UP.has("conv", "packed_decode"):
            timed("sglang, o_norm", lambda inst: onorm(UP.decode(inst, pool), inst["gate2"]))
        try:
            fused = SGLangFusedDecode(pool)
            if fused.covered(insts[0], pool):
                timed("sglang fused", lambda inst: fused(inst, pool))
            else:
                notes.append(f"H={H}: SGLang's kda_fused_decode does not cover these shapes (heads 3, 6, 12 only)")
        except Exception as e:  # noqa: BLE001 (e.g. the staged kernels alone: no SGLang JIT runtime)
            notes.append(f"H={H}: SGLang's kda_fused_decode unavailable: {type(e).__name__}: {str(e)[:300]}")
    else:
        accs = insts[0]["acc_steps"][:1] or [insts[0]["acc"]]
        acc = accs[0]
        timed("verify+gate", lambda inst: verify(inst, pool, T, lazy, gate=True))
        timed("verify", lambda inst: verify(inst, pool, T, lazy))
        timed("ours+gate", lambda inst: (verify(inst, pool, T, lazy, gate=True), commit(inst, pool, T, lazy, acc)))
        timed("ours, o_norm", lambda inst: (onorm(verify(inst, pool, T, lazy), inst["gate2"]),
                                             commit(inst, pool, T, lazy, acc)))
        if UP.has("conv", "recurrent", "fold"):
            timed("sglang, o_norm", lambda inst: (onorm(UP.verify_unfused(inst, pool, T, True), inst["gate2"]),
                                                   UP.fold(inst, pool)))
    for r in rows:
        if (r["H"], r["N"], r["T"]) == (H, N, T):
            r["check_max_rel_diff"] = err
    del pool, insts
    torch.cuda.empty_cache()


def table(rows, bw):
    lines = [f"{'H':>3} {'N':>4} {'T':>2}  {'kernel':<15} {'us':>9} {'x S/B':>7} {'x ours+gate':>11}"]
    for key in sorted({(r["H"], r["N"], r["T"]) for r in rows}):
        group = [r for r in rows if (r["H"], r["N"], r["T"]) == key]
        ref = next((r["us"] for r in group if r["kernel"] == "ours+gate"), None)
        for r in group:
            us = r["us"]
            floor = r["state_bytes"] / (bw * 1e12) * 1e6
            if us is None:
                lines.append(f"{key[0]:>3} {key[1]:>4} {key[2]:>2}  {r['kernel']:<15} {'error':>9}")
                continue
            rel = f"{us / ref:.2f}" if ref else "-"
            lines.append(f"{key[0]:>3} {key[1]:>4} {key[2]:>2}  {r['kernel']:<15} {us:9.1f} {us / floor:7.2f} {rel:>11}")
    return "\n".join(lines)


def main():
    global UP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--H", default="12,32")
    parser.add_argument("--N", default="64,256")
    parser.add_argument("--T", default="1,4,8")
    parser.add_argument("--rep", type=int, default=30, help="do_bench milliseconds per timing")
    parser.add_argument("--out", default=None)
    parser.add_argument("--upstream-root", default=None,
                        help="staged SGLang kernels (benchmarks/prepare_upstream.sh; default .whl/upstream, "
                             "else the installed sglang)")
    args = parser.parse_args()
    if BK.INTERPRET:
        raise SystemExit("bench_output_gate.py needs a CUDA GPU")
    out_dir = args.out or os.environ.get("OUT") or os.path.join(ROOT, "out")
    os.makedirs(out_dir, exist_ok=True)
    import upstream_kernels as U

    mods, source, errors = U.load_sglang(args.upstream_root)
    UP = BK.Upstream(mods, None)
    notes = [f"upstream: {source}; loaded {sorted(mods)}" + (f"; errors {errors}" if errors else "")]
    env = BK.environment(sys.argv)
    bw = BK.copy_bandwidth(False)
    BK.log(f"copy bandwidth {bw:.2f} TB/s")
    rows = []
    for H in [int(x) for x in args.H.split(",")]:
        for N in [int(x) for x in args.N.split(",")]:
            for T in [int(x) for x in args.T.split(",")]:
                try:
                    run_point(H, N, T, args.rep, rows, notes)
                    BK.log(f"H={H} N={N} T={T}: " + ", ".join(
                        f"{r['kernel']} {r['us']:.1f}" for r in rows
                        if (r["H"], r["N"], r["T"]) == (H, N, T) and r["us"] is not None))
                except Exception:  # noqa: BLE001
                    notes.append(f"H={H} N={N} T={T}: {traceback.format_exc(limit=3)}")
                    BK.log(notes[-1])
    text = table(rows, bw)
    with open(os.path.join(out_dir, "bench_output_gate.json"), "w") as f:
        json.dump(dict(env=env, copy_bandwidth_tbs=bw, rows=rows, notes=notes, argv=sys.argv), f, indent=1)
    for n in notes:
        print("note:", n)
    print(text)


UP = None

if __name__ == "__main__":
    main()
