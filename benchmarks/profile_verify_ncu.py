"""Nsight Compute profile of single ring-verify launches on bench_kernels' tensors (issue 15).

Run under ``ncu`` (the H200 machine has it); only the launches between the profiler start and
stop below are profiled, after every kernel has compiled::

    ncu --profile-from-start off --set full --import-source yes -o $OUT/verify \\
        python3 benchmarks/profile_verify_ncu.py --N 64 --T 4
    ncu --import $OUT/verify.ncu-rep --page details

Profiled, in order (one launch each, H=32): the chunked verify (prep, finish from 5 tokens,
streaming kernel) and the fused verify (``mtp_verify_fused.py``), fold every commit; then the
fused verify of the lazy record ring (ring 4T) with 4 pending records (no flush) and with a
flushing window. Runs: docs/lazy-flush.md, twenty-sixth session.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as BK  # noqa: E402
import probe_verify_fused as P  # noqa: E402
import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=64)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--block-v", type=int, default=32)
    ap.add_argument("--warps", type=int, default=4)
    args = ap.parse_args()
    N, H, T = args.N, args.H, args.T
    pool, insts = BK.make_pool(H, N, T, 1, False)
    inst = insts[0]
    lz = pool["lazy"][1]  # ring 4T
    fused = P.fused_cfg(args.block_v, args.warps, None)

    def lazy(p):
        lz["cursor"].fill_(p)
        P.verify(inst, pool, T, fused, lz)

    launches = [
        ("chunked", lambda: P.verify(inst, pool, T, {})),
        ("fused", lambda: P.verify(inst, pool, T, fused)),
        ("fused lazy p=4", lambda: lazy(4)),
        ("fused lazy flush", lambda: lazy(lz["L"] - 1)),
    ]
    for _ in range(2):  # compile everything outside the profiled range
        for _, fn in launches:
            fn()
    cuda = torch.cuda.is_available()  # (without CUDA: the interpreter, to check the script runs)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    for name, fn in launches:
        print("profiled:", name, flush=True)
        fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
