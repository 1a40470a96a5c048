"""Tuning sweep of the Gluon Hopper stream (kernels/mtp_verify_gluon.py) on bench_kernels' tensors.

Times the whole ring-mode verify (prep + finish + Gluon stream; CUDA graph) for one launch of the
stream (``GluonLaunch``: ``--stages``, ``--block-k``, ``--ctas-per-sm``, ``--maxnreg``,
``--producer-regs``; the defaults are ``mtp_verify_gluon.LAUNCH``'s) and checks its output against
the Triton chunked verify on the same inputs. One configuration per process, so that a configuration that fails to compile or hangs
costs only its own run::

    for c in 2,64,2 4,32,2 3,64,1; do IFS=, read s k m <<<"$c"; timeout 90 python3 \\
        benchmarks/sweep_gluon_stream.py --stages $s --block-k $k --ctas-per-sm $m; done

Prints one line (configuration, verify µs, Triton chunked verify µs, ratio, max |difference|),
then each verify's kernels with their device µs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_kernels as BK  # noqa: E402
from sglang_dspark_plugin.kernels import mtp_verify_gluon as G  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--T", type=int, default=8)
    launch = G.LAUNCH
    ap.add_argument("--stages", type=int, default=launch.stages)
    ap.add_argument("--block-k", type=int, default=launch.block_k)
    ap.add_argument("--ctas-per-sm", type=int, default=launch.ctas_per_sm)
    ap.add_argument("--maxnreg", type=int, default=launch.maxnreg)
    ap.add_argument("--producer-regs", type=int, default=launch.producer_regs)
    ap.add_argument("--rep", type=int, default=50, help="do_bench rep (ms)")
    args = ap.parse_args()
    pool, insts = BK.make_pool(args.H, args.N, args.T, 1, False)
    inst = insts[0]
    cfg = dict(stages=args.stages, block_k=args.block_k, ctas_per_sm=args.ctas_per_sm, maxnreg=args.maxnreg,
               producer_regs=args.producer_regs)
    G.LAUNCH = dataclasses.replace(G.LAUNCH, **cfg)

    BK.ours_verify(inst, pool, args.T, True, dict(impl="chunked"))
    ref = inst["out"].clone()
    BK.ours_verify(inst, pool, args.T, True, dict(impl="gluon"))
    diff = (inst["out"].float() - ref.float()).abs().max().item()
    t_gluon = BK.time_graph([lambda: BK.ours_verify(inst, pool, args.T, True, dict(impl="gluon"))], args.rep)
    t_chunked = BK.time_graph([lambda: BK.ours_verify(inst, pool, args.T, True, dict(impl="chunked"))], args.rep)
    name = ",".join(f"{k}={v}" for k, v in cfg.items())
    print(f"gluon-sweep H={args.H} N={args.N} T={args.T} {name}: gluon {t_gluon:.2f} us, "
          f"chunked {t_chunked:.2f} us, x{t_gluon / t_chunked:.3f}, max|diff| {diff:.3g} "
          f"({torch.cuda.get_device_name()})", flush=True)
    # where each verify's time goes, kernel by kernel (the streaming kernels are what differs)
    for impl in ("gluon", "chunked"):
        per = BK.kernel_breakdown([lambda: BK.ours_verify(inst, pool, args.T, True, dict(impl=impl))])
        print(f"  {impl}: " + ", ".join(f"{k.split('(')[0]} {us:.1f} us" for k, us in per.items()), flush=True)


if __name__ == "__main__":
    main()
