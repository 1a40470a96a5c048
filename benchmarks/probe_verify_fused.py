"""The fused verify (one program per request and head, ``mtp_verify_fused.py``) against the chunked
kernels (prep + finish + streaming), on bench_kernels' tensors, H=32, CUDA graphs (issue 15).

Timed per point (N, T): the verify alone (fold-every-commit ring), the whole eager step (verify +
fold with conv roll) and the whole lazy step (verify + ``commit_records``) at ring lengths 2T and 4T,
each over ``SPEC_STEPS * T`` consecutive steps with accept lengths uniform in 1..T, as
``bench_kernels.py`` times them; the fused kernel at several launches. Before timing, the fused
kernel's outputs and rings are compared with the chunked kernels' on the same inputs (one eager
verify; a lazy trajectory of a ring length of steps: outputs and the materialised state)::

    python3 benchmarks/probe_verify_fused.py --N 64,256 --T 4,8 --rep 30 --json $OUT/probe.json

Runs: docs/lazy-flush.md, twenty-sixth session.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as BK  # noqa: E402
import torch  # noqa: E402

from sglang_dspark_plugin.kernels import mtp_verify, replayssm_fold  # noqa: E402
from sglang_dspark_plugin.kernels.record_ring import commit_records, materialize_records  # noqa: E402

# (block_v, num_warps, num_stages) of the fused kernel; None: Triton's default stages
FUSED = [(32, 4, None), (32, 4, 1), (32, 8, 1), (64, 8, 1)]


def verify(inst, pool, T, cfg, lz=None):
    H = pool["H"]
    rings = (dict(ring_rawv=lz["rv"], ring_rawk=lz["rk"], ring_g=lz["rg"], ring_beta=lz["rb"],
                  record_cursor=lz["cursor"], ring_delta=(lz["hi"], lz["lo"])) if lz is not None else
             dict(ring_rawv=pool["rv"], ring_rawk=pool["rk"], ring_g=pool["rg"], ring_beta=pool["rb"]))
    return mtp_verify(*BK.acts(inst, H), conv_weight=pool["w"], A_log=pool["A_log"], dt_bias=pool["dt_bias"],
                      lower_bound=pool["lb"], ssm_state=pool["state"], conv_state=pool["conv"],
                      slot_indices=inst["slots"], cu_seqlens=inst["cu"], num_spec=T - 1,
                      intermediate_conv=pool["icw"], intermediate_rows=inst["rows"], out=inst["out"],
                      **rings, **cfg)


def step_eager(inst, pool, T, acc, cfg):
    verify(inst, pool, T, cfg)
    replayssm_fold(pool["state"], pool["rv"], pool["rk"], pool["rg"], pool["rb"], inst["slots"], acc,
                   conv_state=pool["conv"], intermediate_conv=pool["icw"], intermediate_rows=inst["rows"])


def step_lazy(inst, pool, T, lz, acc, cfg):
    verify(inst, pool, T, cfg, lz)
    commit_records(lz["cursor"], inst["slots"], acc, pool["conv"][None], pool["icw"][None], inst["rows"],
                   steps=T, ring_len=lz["L"])


def fused_cfg(bv, warps, stages):
    cfg = dict(impl="fused", block_v=bv, num_warps=warps)
    if stages is not None:
        cfg["num_stages"] = stages
    return cfg


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def check(pool, inst, T, log):
    """Fused against chunked on the same inputs; returns the worst relative difference seen."""
    snap = {k: pool[k].clone() for k in ("state", "conv")}
    worst = 0.0
    outs = {}
    for name, cfg in (("chunked", {}), ("fused", fused_cfg(*FUSED[0]))):
        for k in ("rv", "rk", "rg", "rb"):
            pool[k].zero_()
        verify(inst, pool, T, cfg)
        outs[name] = (inst["out"].clone(), *(pool[k].clone() for k in ("rv", "rk", "rg", "rb")))
    for i, what in enumerate(("out", "rv", "rk", "rg", "rb")):
        d = rel(outs["fused"][i], outs["chunked"][i])
        worst = max(worst, d)
        log(f"  eager {what}: rel diff {d:.2e}")
    # a lazy trajectory of 2 ring lengths of steps from the same pool, both implementations
    lz = pool["lazy"][0]
    res = {}
    for name, cfg in (("chunked", {}), ("fused", fused_cfg(*FUSED[0]))):
        pool["state"].copy_(snap["state"])
        pool["conv"].copy_(snap["conv"])
        for k in ("rk", "rg", "rb", "hi", "lo", "cursor"):
            lz[k].zero_()
        seq = []
        for a_i in range(2 * lz["L"]):
            step_lazy(inst, pool, T, lz, inst["acc_steps"][a_i % len(inst["acc_steps"])], cfg)
            seq.append(inst["out"].clone())
        now = pool["state"].clone()
        materialize_records(now[None], lz["rk"][None], lz["rg"][None], lz["rb"][None], (lz["hi"][None], lz["lo"][None]),
                            src_slots=inst["slots"], counts=lz["cursor"][inst["slots"].long()], dst_slots=inst["slots"])
        res[name] = (torch.stack(seq), now[inst["slots"].long()])
    for i, what in enumerate(("lazy outputs", "lazy materialised state")):
        d = rel(res["fused"][i], res["chunked"][i])
        worst = max(worst, d)
        log(f"  {what} ({2 * lz['L']} steps, L={lz['L']}): rel diff {d:.2e}")
    pool["state"].copy_(snap["state"])
    pool["conv"].copy_(snap["conv"])
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", default="64,256")
    ap.add_argument("--T", default="4,8")
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    H = args.H
    rows = []

    def log(*a):
        print(*a, flush=True)

    for T in [int(x) for x in args.T.split(",")]:
        for N in [int(x) for x in args.N.split(",")]:
            R = BK.rotations(N, H)
            pool, insts = BK.make_pool(H, N, T, R, False)
            log(f"N={N} T={T} H={H} (R={R})")
            worst = check(pool, insts[0], T, log)
            ok = worst < 2e-2  # bf16 outputs; a wrong kernel is O(1) off
            log(f"  check: {'ok' if ok else 'FAILED'} (worst {worst:.2e})")
            steps_of = [(i, a_) for a_i in range(BK.SPEC_STEPS * T) for i in insts for a_ in [i["acc_steps"][a_i]]]
            cfgs = [("chunked", {})] + [(f"fused {bv}x{w} s{st}", fused_cfg(bv, w, st)) for bv, w, st in FUSED]
            for name, cfg in cfgs:
                us = BK.time_graph([lambda i=i, c=cfg: verify(i, pool, T, c) for i in insts], args.rep)
                row = dict(N=N, T=T, H=H, kernel="verify", impl=name, us=us, check=ok)
                step = BK.time_graph([lambda i=i, a_=a_, c=cfg: step_eager(i, pool, T, a_, c) for i, a_ in steps_of],
                                     args.rep)
                row["step_eager_us"] = step
                for lz in pool["lazy"]:
                    for k in ("rk", "rg", "rb", "hi", "lo", "cursor"):
                        lz[k].zero_()
                    row[f"step_lazy_L{lz['L']}_us"] = BK.time_graph(
                        [lambda i=i, a_=a_, lz=lz, c=cfg: step_lazy(i, pool, T, lz, a_, c) for i, a_ in steps_of],
                        args.rep)
                rows.append(row)
                log(f"  {name:18s} verify {us:7.1f} us | eager step {step:7.1f} | "
                    + " | ".join(f"{k[5:-3]} {v:7.1f}" for k, v in row.items() if k.startswith("step_lazy")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=BK.environment(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
