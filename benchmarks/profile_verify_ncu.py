"""Nsight Compute profile of one ring-mode verify (and its fold) on bench_kernels' tensors.

Run under ``ncu``; only the launches between the profiler start and stop are profiled, after
every kernel has compiled::

    ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum,\\
dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_issued.avg.pct_of_peak_sustained_active,\\
sm__warps_active.avg.pct_of_peak_sustained_active --csv python3 benchmarks/profile_verify_ncu.py --N 64 --T 8

Profiled, in order (H=32 by default, bf16 activations, the K3 gate): the Triton chunked verify
(prep, finish, streaming kernel), the same with the Gluon Hopper stream where the GPU takes it,
once per launch of ``bench_kernels.GLUON_LAUNCHES`` (prep, finish, Gluon stream), and the fold
of the window. Each launch is one
kernel in the report, in that order.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as BK  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--T", type=int, default=8, help="window length 1 + num_spec")
    args = ap.parse_args()
    pool, insts = BK.make_pool(args.H, args.N, args.T, 1, False)
    inst = insts[0]
    launches = [("verify (triton chunked)", lambda: BK.ours_verify(inst, pool, args.T, True, dict(impl="chunked")))]
    for name, cfg in (BK.gluon_configs() if BK.gluon_here() else []):
        launches.append((f"verify ({name})", lambda c=cfg: BK.ours_verify(inst, pool, args.T, True, c)))
    launches.append(("fold", lambda: BK.ours_fold(inst, pool, True, {})))
    BK.profile_launches(launches)


if __name__ == "__main__":
    main()
