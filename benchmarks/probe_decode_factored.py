"""Probe: where the factored buffered decode's time goes on the GPU.

Times, on bench_kernels' tensors (H=32, CUDA graphs, two ring lengths of steps so flushes are
paid, R slot sets so the state does not sit in L2):

1. the rows step, the factored step at its launch-table tiles (also with every step at write
   position 0: no ring row read, no flush, to isolate what the ring terms cost), and the
   factored step at five tiles, each over a ring (flushes paid), over the non-flushing steps only
   and over the flushing step only;
2. with ``--stream``, minimal kernels with the factored step's state access and nothing else
   (two row sums of the checkpoint tile per V-tile, one ``[V]`` store): the ceiling of that
   structure, per layout and grid (the same grid, a grid split over V-tiles, K split into chunks
   outside the rows), to tell the step's own overheads (conv, gate, ring terms, flush) from the
   stream's.

    python3 benchmarks/probe_decode_factored.py [--N 8,32,64,256] [--rep 30] [--stream] [--tag TAG]

What earlier runs of it found (and which alternatives lost): docs/design/alternatives-measured.md.

Prints one line per timing and writes ``probe_decode_factored[_TAG].json`` to ``$OUT`` (or ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kernels as BK  # noqa: E402  (sets up sys.path and the device)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _stream_two_products(ssm_ptr, slot_ptr, x_ptr, y_ptr, out_ptr, s_slot, H,
                         BV: tl.constexpr, SPLIT: tl.constexpr):
    """Per (request, head): ``o = S x + S y`` over V-tiles of BV rows (the factored step's reads)."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, 128)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    base = ssm_ptr + slot * s_slot + h.to(tl.int64) * 16384
    x = tl.load(x_ptr + h * 128 + offs_k)
    y = tl.load(y_ptr + h * 128 + offs_k)
    if SPLIT:
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        S = tl.load(base + offs_v[:, None] * 128 + offs_k[None, :])
        o = tl.sum(S * x[None, :], axis=1) + tl.sum(S * y[None, :], axis=1)
        tl.store(out_ptr + (n * H + h) * 128 + offs_v, o)
    else:
        for iv in range(128 // BV):
            offs_v = iv * BV + tl.arange(0, BV)
            S = tl.load(base + offs_v[:, None] * 128 + offs_k[None, :])
            o = tl.sum(S * x[None, :], axis=1) + tl.sum(S * y[None, :], axis=1)
            tl.store(out_ptr + (n * H + h) * 128 + offs_v, o)


@triton.jit
def _stream_two_products_kchunks(ssm_ptr, slot_ptr, x_ptr, y_ptr, out_ptr, s_slot, H,
                                 BV: tl.constexpr, C: tl.constexpr):
    """The same reads with the tile as ``[128 // C, BV, C]`` (K split into chunks of C outside
    the rows): lanes spread over rows as well as K, so the row sums need fewer shuffles."""
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs_c = tl.arange(0, 128 // C)
    offs_j = tl.arange(0, C)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    base = ssm_ptr + slot * s_slot + h.to(tl.int64) * 16384
    x = tl.load(x_ptr + h * 128 + offs_c[:, None] * C + offs_j[None, :])
    y = tl.load(y_ptr + h * 128 + offs_c[:, None] * C + offs_j[None, :])
    for iv in range(128 // BV):
        offs_v = iv * BV + tl.arange(0, BV)
        S = tl.load(base + offs_c[:, None, None] * C + offs_v[None, :, None] * 128 + offs_j[None, None, :])
        o = tl.sum(tl.sum(S * x[:, None, :], axis=2), axis=0) + tl.sum(tl.sum(S * y[:, None, :], axis=2), axis=0)
        tl.store(out_ptr + (n * H + h) * 128 + offs_v, o)


# (block_v, num_warps) of the factored step timed besides the launch table's choice
TILES = [(32, 1), (128, 4), (64, 2), (32, 2), (16, 1)]


def tile_cfg(v):
    return dict(impl="factored", block_v=v[0], num_warps=v[1])


def tile_name(v):
    return f"factored_{v[0]}x{v[1]}"


def stream_only(N, H, pool, insts, timed):
    """The minimal kernels' timings (part 2 of the module docstring)."""
    x = torch.randn(H * 128, device=BK.DEV)
    y = torch.randn(H * 128, device=BK.DEV)
    o = torch.empty(N * H * 128, device=BK.DEV)
    state = pool["state"]
    for bv, w in ((32, 1), (16, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8)):
        for split in (False, True):
            grid = (N, H, 128 // bv) if split else (N, H)
            calls = [lambda i=i, g=grid, bv=bv, w=w, sp=split: _stream_two_products[g](
                state, i["slots"], x, y, o, state.stride(0), H, BV=bv, SPLIT=sp, num_warps=w) for i in insts]
            timed("stream_only" + ("_split" if split else ""), dict(block_v=bv, num_warps=w), calls, len(insts))
    for bv, w, c in ((32, 1, 8), (32, 1, 4), (32, 1, 16), (64, 2, 8), (32, 2, 8), (128, 4, 8)):
        calls = [lambda i=i, bv=bv, w=w, c=c: _stream_two_products_kchunks[(N, H)](
            state, i["slots"], x, y, o, state.stride(0), H, BV=bv, C=c, num_warps=w) for i in insts]
        timed("stream_only_kchunks", dict(block_v=bv, num_warps=w, chunk=c), calls, len(insts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", default="8,16,32,64,128,256")
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--stream", action="store_true", help="also time the minimal streaming kernels")
    ap.add_argument("--tag", default="", help="suffix of the output file (probe_decode_factored_TAG.json), to "
                    "keep two runs apart (before / after a change)")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT") or os.path.join(BK.ROOT, "out")
    os.makedirs(out_dir, exist_ok=True)
    H = args.H
    bw = BK.copy_bandwidth(True)
    print(f"copy bandwidth {bw:.3f} TB/s", flush=True)
    rows = []
    # every variant against float64 decode over a flush (bench_kernels' buffered check)
    extra = [(tile_name(v), tile_cfg(v)) for v in TILES]
    BK.check_buffered_decode(None, H, extra=extra)
    for (name, _), v in sorted(BK.CHECKS.items()):
        print(f"check {name}: {'ok' if v['ok'] else 'FAIL'} {v}", flush=True)
    for N in [int(x) for x in args.N.split(",")]:
        R = BK.rotations(N, H)
        pool, insts = BK.make_pool(H, N, 1, R, False, decode_ring=True)
        floor_us = N * H * 65536 / (bw * 1e12) * 1e6
        steps = range(2 * BK.DECODE_RING)

        def timed(name, cfg, calls, per):
            try:
                us = BK.time_graph(calls, args.rep) * len(calls) / per
            except Exception as e:  # a tile that does not compile is a finding, not a stop
                print(f"N={N:3d} {name:28s} {cfg} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                return
            rows.append(dict(N=N, H=H, kernel=name, cfg=cfg, us=us, x_floor=us / floor_us))
            print(f"N={N:3d} {name:28s} {str(cfg):40s} {us:9.2f} us  x{us / floor_us:.2f} S/B", flush=True)

        def timed_steps(name, cfg, ring_steps):
            """``cfg``'s decode at each of ``ring_steps`` for every slot set, per call."""
            calls = [lambda i=i, s_=s_: BK.ours_buffered_decode(i, pool, s_, cfg) for s_ in ring_steps for i in insts]
            timed(name, {}, calls, len(calls))

        timed_steps("buffered_rows", {}, steps)
        timed_steps("buffered_factored", dict(impl="factored"), steps)
        # every step at write_pos 0: no ring row read, no flush (what the ring terms cost)
        timed_steps("buffered_factored_no_ring_rows", dict(impl="factored"), [0])
        last = BK.DECODE_RING - 1  # the flushing step

        def timed_ring(name, cfg):
            """``cfg`` over the ring, its non-flushing steps and its flushing step, where it passed
            the float64 check (variants not in the check list are timed as they are)."""
            if (name, 1) in BK.CHECKS and not BK.CHECKS[(name, 1)]["ok"]:
                print(f"N={N:3d} {name} not timed: check failed", flush=True)
                return
            timed_steps(name, cfg, steps)
            timed_steps(name + "_no_flush_steps", cfg, range(last))
            timed_steps(name + "_flush_step", cfg, [last])

        for v in TILES:
            timed_ring(tile_name(v), tile_cfg(v))
        if args.stream:
            stream_only(N, H, pool, insts, timed)
        del pool, insts
        torch.cuda.empty_cache()
    name = "probe_decode_factored" + (f"_{args.tag}" if args.tag else "") + ".json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(dict(env=BK.environment(sys.argv), bandwidth_tbs=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
