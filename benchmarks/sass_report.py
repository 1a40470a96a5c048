"""Static report of a bundled kernel compiled for the H200 (sm_90) on a machine without a GPU.

Triton lowers the kernel to a cubin with the ``ptxas`` it ships; ``cuobjdump`` / ``nvdisasm``
(also shipped with Triton) give its registers, stack (spills) and SASS. Registers decide the
occupancy and spills the local-memory traffic, so most tile and code-shape questions can be
answered here before spending GPU time::

    python3 benchmarks/sass_report.py verify-prep --T 16 --block-k 32 --warps 1
    python3 benchmarks/sass_report.py verify-stream --T 8 --finish --block-v 64 --warps 2 --lines 15
    python3 benchmarks/sass_report.py fold --block-v 16 --warps 1 --lines 15
    python3 benchmarks/sass_report.py decode --buffered --block-v 32 --warps 1
    python3 benchmarks/sass_report.py commit --T 4
    python3 benchmarks/sass_report.py verify-stream-gluon --T 8

Counts are static (instructions in the binary, loop bodies once): compare variants of one kernel,
not kernels with each other.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sglang_dspark_plugin.kernels import mtp_verify_chunked, record_ring

# the package exports the wrapper functions under the modules' names
replayssm_fold = importlib.import_module("sglang_dspark_plugin.kernels.replayssm_fold")
decode_kernels = importlib.import_module("sglang_dspark_plugin.kernels.decode")

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
H200 = GPUTarget("cuda", 90, 32)

# Argument types of the presets (bf16 activations, int32 index tensors); every other ``*_ptr`` is
# fp32 and every other non-constexpr argument an int32.
ACT = ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "out_ptr", "conv_ptr", "icw_ptr", "rk_ptr", "rv_ptr")
TYPES = {**{n: "*bf16" for n in ACT}, **{n: "*i32" for n in ("slot_ptr", "cu_ptr", "irow_ptr", "acc_ptr", "tslot_ptr",
                                                               "tstep_ptr", "cur_ptr", "src_ptr",
                                                               "cnt_ptr", "dst_ptr", "wp_ptr", "ff_ptr",
                                                               "cursor_ptr", "row_ptr", "tcount_ptr", "tdst_ptr")},
         "rd_hi_ptr": "*i16", "rd_lo_ptr": "*i16",
         "wss_ptr": "*fp64", "lower_bound": "fp32", "scale": "fp32"}


def compile_sm90(fn, constexprs: dict, num_warps: int, num_stages: int):
    """``triton.compile`` of a ``@triton.jit`` function for sm_90, argument types from TYPES.
    Constexpr parameters not in ``constexprs`` take their defaults, as at a launch (left out, they
    would compile as runtime integers, with every branch they select)."""
    import inspect

    names = fn.arg_names
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.default is not inspect.Parameter.empty},
                  **constexprs}
    sig = {n: "constexpr" if n in constexprs else TYPES.get(n, "*fp32" if n.endswith("_ptr") else "i32")
           for n in names}
    # A real launch specialises pointers and integer arguments that are multiples of 16 (the pool
    # tensors' strides); without the same hints loads would not vectorise here. Arguments listed in
    # do_not_specialize get none, nor does s_w (4: the row stride of the [D, 4] conv weight).
    fixed = set(getattr(fn, "do_not_specialize", ())) | {"s_w"}
    aligned = [i for i, n in enumerate(names) if sig[n] != "constexpr" and n not in fixed
               and (sig[n].startswith("*") or n.startswith("s_"))]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=H200, options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_gluon_stream_sm90(steps: int, gate: bool, block_k: int, stages: int):
    """The Gluon verify stream (kernels/mtp_verify_gluon.py) compiled for sm_90 through its own
    launch path (``warmup``: no launch), with this machine's driver swapped for one that only names
    the target. Its tensor-descriptor arguments need real (CPU) tensors of the serving layout; the
    other launch options are ``mtp_verify_gluon.LAUNCH``'s."""
    import torch
    from triton.backends.nvidia.driver import CudaDriver
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    from sglang_dspark_plugin.kernels import mtp_verify_gluon as G

    class TargetOnly(CudaDriver):
        def __init__(self):  # no CUDA
            pass

        def get_current_target(self):
            return H200

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    launch = G.LAUNCH
    TP = max(8, triton.next_power_of_2(steps))
    H, N, slots = 4, 2, 3
    T, D = N * steps, 3 * H * 128
    act = torch.bfloat16
    rows = 2 * TP  # window operand rows per item
    ssm, ws = torch.zeros(slots, H, 128, 128), torch.zeros(N, H, 2, TP, 128)
    s_desc = TensorDescriptor(ssm, [slots * H * 128, 128], [128, 1], [128, block_k],
                              gl.NVMMASharedLayout.get_default_for([128, block_k], gl.float32))
    w_desc = TensorDescriptor(ws, [N * H * rows, 128], [128, 1], [rows, block_k],
                              gl.NVMMASharedLayout.get_default_for([rows, block_k], gl.float32))
    v = torch.zeros(1, T, H, 128, dtype=act)
    conv, icw = torch.zeros(slots, 3, D, dtype=act), torch.zeros(N, steps, 3, D, dtype=act)
    rv, og = torch.zeros(slots, H, 2 * steps, 128, dtype=act), torch.zeros(1, T, H, 128, dtype=act)
    i32 = torch.zeros(N + 1, dtype=torch.int32)
    saved = driver._active  # None on a machine without a GPU (reading .active would look for one)
    driver.set_active(TargetOnly())
    try:
        return G._verify_stream_gluon_kernel.warmup(
            s_desc, w_desc, v, v, torch.zeros(D, 4), conv, i32, i32, icw, i32, rv, torch.zeros(N, H, TP, TP),
            og, torch.zeros(128), 1e-6, N, T, H, N * H,
            v.stride(1), v.stride(2), v.stride(1), v.stride(2), 4, conv.stride(0), conv.stride(1),
            icw.stride(0), icw.stride(1), icw.stride(2), rv.stride(0), rv.stride(1), rv.stride(2),
            og.stride(1), og.stride(2),
            STEPS=steps, TP=TP, BK=block_k, STAGES=stages, ACT_BF16=True, GATE=gate,
            PRODUCER_REGS=launch.producer_regs, num_warps=4, maxnreg=launch.maxnreg, grid=(1,))
    finally:
        driver._active = saved


def gluon_spills_by_partition(r) -> dict:
    """The Gluon stream's spill instructions (STL / LDL) by the partition whose source lines they
    carry: ``math`` (the consumer and the helpers only it calls), ``tma`` (the producer) and
    ``other`` (shared library lines, e.g. reductions, that more than one partition inlines).
    ``r``: :func:`report` with every line."""
    import inspect

    from sglang_dspark_plugin.kernels import mtp_verify_gluon as G

    owner = {}
    for part, fns in (("math", (G._consumer, G._item_operands, G._item_index)), ("tma", (G._producer,))):
        for fn in fns:
            src, first = inspect.getsourcelines(fn.fn)
            owner.update({f"mtp_verify_gluon.py:{first + i}": part for i in range(len(src))})
    out = dict(math=0, tma=0, other=0)
    for where, _, spill in r["lines"]:
        if spill:
            part = owner.get(where, "math" if where.startswith("common.py:") else "other")
            out[part] += spill
    return out


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(BIN, name), *args], capture_output=True, text=True, check=True).stdout


def report(compiled, lines: int = 0) -> dict:
    """Registers, stack bytes, shared memory, SASS size and opcode counts (and, with ``lines``,
    the source lines with the most instructions) of a compiled kernel."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = _tool("cuobjdump", "-res-usage", path)
        sass = _tool("nvdisasm", "-c", "-g", path)
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    ops, per_line, spills = collections.Counter(), collections.Counter(), collections.Counter()
    order = []
    where = "?"
    for ln in sass.splitlines():
        loc = re.search(r'//## File "([^"]+)", line (\d+)', ln)
        if loc:
            where = f"{os.path.basename(loc.group(1))}:{loc.group(2)}"
            continue
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", ln)
        if ins:
            ops[ins.group(1)] += 1
            per_line[where] += 1
            spills[where] += ins.group(1) in ("STL", "LDL")
            order += {"LDG": "L", "LDGSTS": "L", "STG": "S", "BRA": "|"}.get(ins.group(1), "")
    return dict(registers=int(m.group(1)), stack=int(m.group(2)), shared=compiled.metadata.shared,
                sass=sum(ops.values()), ops=ops, lines=[(k, v, spills[k]) for k, v in per_line.most_common(lines)],
                order="".join(order))


def loads_after_first_store(order: str) -> int:
    """Global loads that follow the first global store inside its branch-free stretch of code.

    ``order`` is the report's sequence of global loads (L), stores (S) and branches (|). A store
    waits for the load its value comes from, and the compiler may not move a load above a store
    that could alias it, so each such load is one more serial memory round trip per program
    (the fold's conv roll had eight of them before its loads moved first)."""
    first = order.find("S")
    if first < 0:
        return 0
    end = order.find("|", first)
    return order[first:end if end >= 0 else len(order)].count("L")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel", choices=("verify-prep", "verify-finish", "verify-stream", "verify-stream-gluon", "fold",
                                       "materialize", "commit", "decode"))
    ap.add_argument("--T", type=int, default=4, help="window length 1 + num_spec")
    ap.add_argument("--block-k", type=int, default=None, help="prep: channels per program; stream: K-chunk")
    ap.add_argument("--block-v", type=int, default=None, help="stream (128) / fold (16): V rows per program")
    ap.add_argument("--prep-block-k", type=int, default=64, help="stream: the prep's chunk (number of partials)")
    ap.add_argument("--finish", action="store_true", help="stream: the variant after the finish kernel")
    ap.add_argument("--lazy", action="store_true", help="verify kernels: the lazy record ring's variant "
                    "(16-row record tiles, deltas as 16-bit halves)")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--no-conv", action="store_true", help="fold: without the conv-state roll")
    ap.add_argument("--buffered", action="store_true", help="decode: through SGLang's decode ring (16 rows)")
    ap.add_argument("--factored", action="store_true", help="buffered decode: impl='factored' (no state formed "
                    "between flushes)")
    ap.add_argument("--stages", type=int, default=None, help="default 3 (the Gluon stream: its launch's)")
    ap.add_argument("--gate", action="store_true", help="gluon stream: with K3's output gate")
    ap.add_argument("--lines", type=int, default=0, help="also list the N source lines with the most SASS")
    a = ap.parse_args(argv)
    if a.kernel == "verify-stream-gluon":
        from sglang_dspark_plugin.kernels import mtp_verify_gluon as G

        launch = G.LAUNCH
        block_k, stages = a.block_k or launch.block_k, a.stages or launch.stages
        r = report(compile_gluon_stream_sm90(a.T, a.gate, block_k, stages), 100000)
        print(f"verify-stream-gluon T={a.T} gate={a.gate} block_k={block_k} stages={stages}: "
              f"{r['registers']} registers, {r['stack']} B stack, {r['shared']} B shared, {r['sass']} SASS "
              f"instructions (registers at launch: the math warpgroup raises itself to "
              f"{2 * launch.maxnreg - launch.producer_regs}, the TMA warp drops to {launch.producer_regs})")
        print("  " + ", ".join(f"{k} {v}" for k, v in r["ops"].most_common(12)))
        print("  spill instructions by partition: " + ", ".join(f"{k} {v}" for k, v in
                                                              gluon_spills_by_partition(r).items()))
        for where, n, spill in r["lines"][:a.lines]:
            print(f"  {n:6d}  {where}" + (f"  ({spill} spill)" if spill else ""))
        return r
    TP = max(2, triton.next_power_of_2(a.T))
    common = dict(STEPS=a.T, TP=TP, ACT_BF16=True, USE_PDL=False)
    lazy = dict(LAZY=a.lazy, LP=16)
    if a.kernel == "decode":
        fn = decode_kernels._decode_kernel
        warps, common = a.warps or 1, dict(USE_PDL=False)
        const = dict(common, BV=a.block_v or 32, ACT_BF16=True, USE_LB=True, BUFFERED=a.buffered, LP=16,
                     HAS_FORCE_FLUSH=False, DOT_PREC="tf32x3", FACTORED=a.factored)
    elif a.kernel == "materialize":
        fn, warps, common = record_ring._materialize_records_kernel, a.warps or 4, dict(USE_PDL=False)
        const = dict(common, BV=a.block_v or 32, LP=16, SPLIT_D=True, DOT_PREC="tf32x3")
    elif a.kernel == "commit":  # the lazy ring's commit: cursor, conv roll, track conv window
        fn, warps, common = record_ring._commit_records_kernel, a.warps or 4, {}
        const = dict(STEPS=a.T, RING_LEN=2 * a.T, HAS_TRACK=True, BLOCK=512)
    elif a.kernel == "fold":  # the window length is a runtime value there
        fn, warps, common = replayssm_fold._replayssm_fold_kernel, a.warps or 1, dict(USE_PDL=False)
        const = dict(common, BV=a.block_v or 16, CONV=not a.no_conv, TRACK=False)
    elif a.kernel == "verify-prep":
        fn, warps = mtp_verify_chunked._verify_prep_kernel, a.warps or 1
        const = dict(common, BK=a.block_k or 64, USE_LB=True, **lazy)
    elif a.kernel == "verify-finish":
        fn, warps = mtp_verify_chunked._verify_finish_kernel, a.warps or 4
        const = dict(STEPS=a.T, TP=TP, NC=128 // a.prep_block_k, USE_PDL=False, LAZY=a.lazy)
    else:
        fn, warps = mtp_verify_chunked._verify_stream_kernel, a.warps or 4
        const = dict(common, BV=a.block_v or 128, BK=a.block_k or 32, NC=128 // a.prep_block_k, FINISHED=a.finish,
                     DOT_PREC="tf32x3", SPLIT_D=a.lazy, **lazy)
    stages = 3 if a.stages is None else a.stages
    r = report(compile_sm90(fn, const, warps, stages), a.lines)
    print(f"{a.kernel}{'' if a.kernel in ('fold', 'decode') else f' T={a.T}'} {', '.join(f'{k}={v}' for k, v in const.items() if k not in common)} warps={warps} "
          f"stages={stages}: {r['registers']} registers, {r['stack']} B stack, {r['shared']} B shared, "
          f"{r['sass']} SASS instructions")
    print("  " + ", ".join(f"{k} {v}" for k, v in r["ops"].most_common(12)))
    print(f"  global loads (L) / stores (S) / branches (|) in code order: {r['order']}; "
          f"loads after the first store before a branch: {loads_after_first_store(r['order'])}")
    for where, n, spill in r["lines"]:
        print(f"  {n:6d}  {where}" + (f"  ({spill} spill)" if spill else ""))
    return r


if __name__ == "__main__":
    main()
