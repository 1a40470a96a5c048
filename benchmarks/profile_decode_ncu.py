"""Nsight Compute profile of single decode steps on bench_kernels' tensors.

Run under ``ncu``; only the launches between the profiler start and
stop below are profiled, after every kernel has compiled::

    ncu --profile-from-start off --set full -o $OUT/decode python3 benchmarks/profile_decode_ncu.py --N 64
    ncu --import $OUT/decode.ncu-rep --page details

Profiled, in order (one launch each, H=32, the served ring of 16 rows): the factored buffered
step at write position 7 (no flush) and 15 (the flush), the rows step at 7, plain decode, and the
probe's bare stream of the factored step's state reads (same grid, 32 x 1). What the profiles
showed: docs/benchmarks.md ("Targets and where they stand").
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as BK  # noqa: E402
import probe_decode_factored as P  # noqa: E402
import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    args = ap.parse_args()
    N, H = args.N, args.H
    pool, insts = BK.make_pool(H, N, 1, 1, False, decode_ring=True)
    inst = insts[0]
    x = torch.randn(H * 128, device=BK.DEV)
    o = torch.empty(N * H * 128, device=BK.DEV)
    state = pool["state"]
    launches = [
        ("factored w=7", lambda: BK.ours_buffered_decode(inst, pool, 7, dict(impl="factored"))),
        ("factored w=15 (flush)", lambda: BK.ours_buffered_decode(inst, pool, 15, dict(impl="factored"))),
        ("rows w=7", lambda: BK.ours_buffered_decode(inst, pool, 7, {})),
        ("plain decode", lambda: BK.ours_decode(inst, pool, {})),
        ("bare stream 32x1", lambda: P._stream_two_products[(N, H)](
            state, inst["slots"], x, x, o, state.stride(0), H, BV=32, SPLIT=False, num_warps=1)),
    ]
    BK.profile_launches(launches)


if __name__ == "__main__":
    main()
