"""Probe: the pipelined chunked verify (prep and streaming programs in one launch,
``mtp_verify(..., impl="pipelined")``) against the chunked kernels, on bench_kernels' tensors,
H=32, CUDA graphs (issue 15).

Timed per point (N, T) and launch: the verify alone (fold-every-commit ring), the whole eager step
(verify + fold with conv roll) and the whole lazy step (verify + ``commit_records``) at ring
lengths 2T and 4T, each over ``SPEC_STEPS * T`` consecutive steps with accept lengths uniform in
1..T, as ``bench_kernels.py`` times them. Outputs are first checked byte-equal to the chunked
kernels' (one verify, every launch)::

    python3 benchmarks/probe_verify_pipelined.py --N 64,256 --T 4 --json $OUT/probe_pipelined.json

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
from sglang_dspark_plugin.kernels.record_ring import commit_records  # noqa: E402


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


# (name, mtp_verify knobs): the chunked kernels, then the pipelined launch at prep chunks x leads
CONFIGS = [("chunked", {})] + [
    (f"pipelined bk{bk} lead{lead}", dict(impl="pipelined", prep_block_k=bk, pipeline_lead=lead))
    for bk in (32, 64) for lead in (64, 256, 1024)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", default="64,256")
    ap.add_argument("--T", default="4")
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    H = args.H
    rows = []
    for T in [int(x) for x in args.T.split(",")]:
        for N in [int(x) for x in args.N.split(",")]:
            R = BK.rotations(N, H)
            pool, insts = BK.make_pool(H, N, T, R, False)
            inst = insts[0]
            print(f"N={N} T={T} H={H} (R={R})", flush=True)
            ref = None
            steps_of = [(i, a_) for a_i in range(BK.SPEC_STEPS * T) for i in insts for a_ in [i["acc_steps"][a_i]]]
            for name, cfg in CONFIGS:
                got = []
                for k_ in ("rv", "rk", "rg", "rb"):
                    pool[k_].zero_()
                verify(inst, pool, T, cfg)
                got = [inst["out"].clone()] + [pool[k_].clone() for k_ in ("rv", "rk", "rg", "rb")]
                ref = ref or got
                same = all(torch.equal(a_, b_) for a_, b_ in zip(got, ref))
                row = dict(N=N, T=T, H=H, config=name, cfg=cfg, bytes_equal_to_chunked=same)
                row["verify_us"] = BK.time_graph([lambda i=i: verify(i, pool, T, cfg) for i in insts], args.rep)
                row["step_eager_us"] = BK.time_graph(
                    [lambda i=i, a_=a_: step_eager(i, pool, T, a_, cfg) for i, a_ in steps_of], args.rep)
                for lz in pool["lazy"]:
                    for k in ("rk", "rg", "rb", "hi", "lo", "cursor"):
                        lz[k].zero_()
                    row[f"step_lazy_L{lz['L']}_us"] = BK.time_graph(
                        [lambda i=i, a_=a_, lz=lz: step_lazy(i, pool, T, lz, a_, cfg) for i, a_ in steps_of], args.rep)
                rows.append(row)
                print(f"  {name:24s} equal {same!s:5s} " + " | ".join(f"{k[:-3]} {v:7.1f}" for k, v in row.items()
                                                                   if k.endswith("_us")), flush=True)
            del pool, insts
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=BK.environment(sys.argv), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
