"""Hopper (sm_90) streaming kernel of the chunked ring-mode verify, in Gluon: warp-specialised,
state streamed by TMA, state product on tensor cores (wgmma).

It replaces the Triton streaming kernel of :mod:`.mtp_verify_chunked` after the prep and finish
kernels (``impl="gluon"``), so it computes the finished form ``O^T = S0 W^T + V^T P^T`` of one
(request, head) per work item, with ``W`` / ``P`` from the finish kernel's workspace.

Structure (one persistent CTA per ``ctas_per_sm`` x SMs, looping over (request, head) items):

* a **producer** warp streams each item's state ``S0 [128 (V), 128 (K)]`` fp32 as ``[128, BK]``
  K-chunks by TMA into a ring of ``STAGES`` shared-memory buffers, with the matching
  ``[2 TP, BK]`` chunk of the window operand (``W`` hi and lo rows); it runs up to ``STAGES``
  chunks ahead of the math, across items;
* the **consumer** warpgroup (4 warps, the default partition) takes each chunk into
  ``acc [128, TP] += S0_c W_c^T`` with three tf32 wgmmas (``hi*hi + hi*lo + lo*hi``: the state's low
  part from registers, about fp32 accuracy, like the Triton kernels' ``tf32x3``), releases the
  buffer, then runs the item's epilogue: v conv + SiLU per token (rolling window, one V channel
  per thread), the intermediate conv windows, the rawv ring, ``o += yv P[:, s]`` in fp32 FMAs,
  and the output store; with the output gate, K3's gated RMS norm over the head's 128 channels,
  which this CTA holds whole (no cross-program counter). Its global loads are software-pipelined:
  an item's epilogue operands are loaded one item ahead and its indices two ahead, so that no
  load's latency lands between two items' math.

The finish kernel leaves ``W`` split for it (``SPLIT_W``): ``ws[n, h, 0]`` = tf32 truncation of
``W``, ``ws[n, h, 1]`` = the rest (the Kg rows there are unused by the finished non-lazy form).
Conv and rounding call ``common.py``'s helpers; the gate follows ``common._gated_rms_norm``'s order.

Requires: Triton with Gluon (``triton.experimental.gluon``), an sm_90 GPU, the state pool's
slots contiguous (``[slots, H, 128, 128]`` with slot stride ``H * 128 * 128``). The wrapper
(:func:`launch_verify_stream_gluon`) checks what it needs; :func:`gluon_verify_supported` says
whether a device / pool can take it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

try:  # Gluon ships with Triton >= 3.4; without it this path is simply unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
    # the elementwise helpers of the Triton kernels, called from Gluon: the same operations in the
    # same order, so conv outputs and roundings are the Triton kernels' bytes
    from .common import _conv_silu, _round_act, _tf32_part
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

KD = 128  # head dim (K and V)


@dataclasses.dataclass(frozen=True)
class GluonLaunch:
    """Launch options of the Gluon stream (:data:`LAUNCH` holds the ones in use; sweeps and tests
    replace it).

    ``block_k`` / ``stages``: ``stages`` state chunks of ``[128, block_k]`` fp32 in flight per CTA;
    ``ctas_per_sm``: persistent CTAs per SM; ``maxnreg``: registers per thread at launch (the math
    warpgroup raises itself to what the TMA warp leaves: 232 with a 24-register TMA warp);
    ``producer_regs``: registers of the TMA warp; ``max_ctas``: a cap on the grid (tests: many items
    per CTA on a small batch). The defaults are the fastest launch measured at 8-token windows
    (``benchmarks/sweep_gluon_stream.py``)."""

    block_k: int = 64
    stages: int = 2
    ctas_per_sm: int = 2
    maxnreg: int = 128
    producer_regs: int = 24
    max_ctas: Optional[int] = None


LAUNCH = GluonLaunch()


def gluon_verify_supported(device: torch.device) -> bool:
    """Gluon present, compiled CUDA (not the interpreter) and an sm_90 device."""
    from ..settings import interpreting

    if not HAVE_GLUON or interpreting() or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


if HAVE_GLUON:
    _KD = gl.constexpr(KD)
    _HAS_BARRIER = gl.constexpr(hasattr(gl, "barrier"))  # Triton 3.8 renamed thread_barrier

    @gluon.jit
    def _sync_warps():
        """Barrier of the calling partition's warps."""
        if _HAS_BARRIER:
            gl.barrier()
        else:
            gl.thread_barrier()

    @gluon.jit
    def _producer(s_desc, w_desc, s_bufs, w_bufs, ready, empty, slot_ptr, H, n_items,
                  TP: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
        """The TMA warp: every live item's state chunks and window-operand chunks, in order."""
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        it = 0
        N = n_items // H
        slot_next = gl.load(slot_ptr + pid // H)
        for item in range(pid, n_items, nprog):
            h = item % H
            # the next item's slot now, so that its TMA issue does not wait for it
            slot = slot_next
            slot_next = gl.load(slot_ptr + gl.minimum((item + nprog) // H, N - 1))
            if slot >= 0:
                for c in gl.static_range(_KD // BK):
                    s = it % STAGES
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), s_desc.block_type.nbytes + w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(s_desc, [(slot * H + h) * _KD, c * BK], ready.index(s),
                                                    s_bufs.index(s))
                    tma.async_copy_global_to_shared(w_desc, [item * (2 * TP), c * BK], ready.index(s),
                                                    w_bufs.index(s))
                    it += 1

    @gluon.jit
    def _item_index(item, slot_ptr, cu_ptr, irow_ptr, N, H, n_items, STEPS: gl.constexpr):
        """(slot, first token, tokens, conv-window row) of work item ``item``; slot -1 past the
        last item (reads stay inside the tables)."""
        n = gl.minimum(item // H, N - 1)
        slot = gl.load(slot_ptr + n).to(gl.int64)
        bos = gl.load(cu_ptr + n)
        n_tok = gl.minimum(gl.load(cu_ptr + n + 1) - bos, STEPS)
        row = gl.load(irow_ptr + n).to(gl.int64)
        return gl.where(item < n_items, slot, -1), bos, n_tok, row

    @gluon.jit
    def _item_operands(item, slot, bos, n_tok, H, v_ptr, cw_ptr, conv_ptr, pp_ptr, og_ptr,
                       s_v_t, s_v_h, s_w, s_conv_slot, s_conv_row, s_og_t, s_og_h,
                       offs_v, offs_t, offs_pr, offs_pc, TP: gl.constexpr, GATE: gl.constexpr):
        """Every global load of an item's epilogue: the v conv window ``c0..c2`` and weights
        ``w0..w3`` of its head's V channels, its tokens' v (fp32 bits) and gate rows ``[V, TP]``,
        and ``P^T``. Masked to zeros where the item has no slot (padding, past the last item).
        The offsets are the consumer's (its epilogue rows' V channels and tokens, its ``P`` tile's
        rows and columns), so the loads land in its layouts."""
        has = slot >= 0
        h = item % H
        h64 = h.to(gl.int64)
        live = (offs_t < n_tok) & has
        on_v = (offs_v < _KD) & has
        ch_v = 2 * H * _KD + h * _KD + offs_v
        cbase = conv_ptr + gl.maximum(slot, 0) * s_conv_slot + ch_v
        c0 = gl.load(cbase, mask=on_v, other=0.0).to(gl.float32)
        c1 = gl.load(cbase + s_conv_row, mask=on_v, other=0.0).to(gl.float32)
        c2 = gl.load(cbase + 2 * s_conv_row, mask=on_v, other=0.0).to(gl.float32)
        wb = cw_ptr + ch_v.to(gl.int64) * s_w
        w0 = gl.load(wb)
        w1 = gl.load(wb + 1)
        w2 = gl.load(wb + 2)
        w3 = gl.load(wb + 3)
        tok_rows = (bos + offs_t).to(gl.int64)[None, :]
        xt = gl.load(v_ptr + tok_rows * s_v_t + h64 * s_v_h + offs_v[:, None], mask=live[None, :],
                     other=0.0).to(gl.float32).to(gl.int32, bitcast=True)  # [V, t], fp32 bits
        pt = gl.load(pp_ptr + item.to(gl.int64) * (TP * TP) + offs_pc[None, :] * TP + offs_pr[:, None],
                     mask=(offs_pr[:, None] < TP) & has, other=0.0)
        if GATE:
            gate = gl.load(og_ptr + tok_rows * s_og_t + h64 * s_og_h + offs_v[:, None], mask=live[None, :],
                           other=0.0).to(gl.float32)
        else:
            gate = gl.zeros_like(xt).to(gl.float32)
        return c0, c1, c2, w0, w1, w2, w3, xt, pt, gate

    @gluon.jit
    def _consumer(s_bufs, w_bufs, p_smem, ready, empty,
                  v_ptr, out_ptr, cw_ptr, conv_ptr, slot_ptr, cu_ptr, icw_ptr, irow_ptr, rv_ptr, pp_ptr,
                  og_ptr, onw_ptr, onorm_eps,
                  N, T, H, n_items,
                  s_v_t, s_v_h, s_o_t, s_o_h, s_w, s_conv_slot, s_conv_row,
                  s_icw_row, s_icw_step, s_icw_win, s_rv_slot, s_rv_h, s_rv_t, s_og_t, s_og_h,
                  STEPS: gl.constexpr, TP: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                  ACT_BF16: gl.constexpr, GATE: gl.constexpr):
        """The math warpgroup: state product per chunk, then the item's epilogue."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, TP, 8])
        a_reg: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=1)
        # epilogue: one V channel per thread, the window's TP tokens along the row
        rows: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, TP], threads_per_warp=[32, 1],
                                              warps_per_cta=[4, 1], order=[1, 0])
        vec: gl.constexpr = gl.SliceLayout(1, rows)
        tok: gl.constexpr = gl.SliceLayout(0, rows)
        offs_v = gl.arange(0, _KD, layout=vec)
        offs_t = gl.arange(0, TP, layout=tok)
        pl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                            order=[1, 0])
        offs_pr = gl.arange(0, TP, layout=gl.SliceLayout(1, pl))
        offs_pc = gl.arange(0, TP, layout=gl.SliceLayout(0, pl))
        out_ty = out_ptr.dtype.element_ty
        icw_ty = icw_ptr.dtype.element_ty
        rv_ty = rv_ptr.dtype.element_ty
        cu_end = gl.load(cu_ptr + N)
        if GATE:
            nw = gl.load(onw_ptr + offs_v).to(gl.float32)

        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        it = 0
        # Software pipeline: an item's epilogue operands are loaded one item ahead and its indices
        # two ahead, so that no load's latency lands between two items' math.
        slot_a, bos_a, ntok_a, row_a = _item_index(pid, slot_ptr, cu_ptr, irow_ptr, N, H, n_items, STEPS)
        c0_a, c1_a, c2_a, w0_a, w1_a, w2_a, w3_a, xt_a, pt_a, gate_a = _item_operands(
            pid, slot_a, bos_a, ntok_a, H, v_ptr, cw_ptr, conv_ptr, pp_ptr, og_ptr,
            s_v_t, s_v_h, s_w, s_conv_slot, s_conv_row, s_og_t, s_og_h,
            offs_v, offs_t, offs_pr, offs_pc, TP, GATE)
        slot_b, bos_b, ntok_b, row_b = _item_index(pid + nprog, slot_ptr, cu_ptr, irow_ptr, N, H, n_items, STEPS)
        for item in range(pid, n_items, nprog):
            n = item // H
            h = item % H
            h64 = h.to(gl.int64)
            slot, bos, n_tok, row = slot_a, bos_a, ntok_a, row_a
            c0, c1, c2, w0, w1, w2, w3, xt, pt, gate = c0_a, c1_a, c2_a, w0_a, w1_a, w2_a, w3_a, xt_a, pt_a, gate_a
            c0_a, c1_a, c2_a, w0_a, w1_a, w2_a, w3_a, xt_a, pt_a, gate_a = _item_operands(
                item + nprog, slot_b, bos_b, ntok_b, H, v_ptr, cw_ptr, conv_ptr, pp_ptr, og_ptr,
                s_v_t, s_v_h, s_w, s_conv_slot, s_conv_row, s_og_t, s_og_h,
                offs_v, offs_t, offs_pr, offs_pc, TP, GATE)
            slot_a, bos_a, ntok_a, row_a = slot_b, bos_b, ntok_b, row_b
            slot_b, bos_b, ntok_b, row_b = _item_index(item + 2 * nprog, slot_ptr, cu_ptr, irow_ptr, N, H,
                                                       n_items, STEPS)
            # Output rows no request covers ([cu_seqlens[N], T)): zero the dense positions of block n
            # (head h's columns).
            p_d = n * STEPS + offs_t
            m_pad = (offs_t < STEPS) & (p_d >= cu_end) & (p_d < T)
            gl.store(out_ptr + p_d.to(gl.int64)[None, :] * s_o_t + h64 * s_o_h + offs_v[:, None],
                     gl.zeros([_KD, TP], gl.float32, rows).to(out_ty), mask=m_pad[None, :])

            live = offs_t < n_tok
            o_ptrs = out_ptr + (bos + offs_t).to(gl.int64)[None, :] * s_o_t + h64 * s_o_h + offs_v[:, None]
            if slot < 0:
                # CUDA-graph padding: nothing read from the slot, zeros to out
                gl.store(o_ptrs, gl.zeros([_KD, TP], gl.float32, rows).to(out_ty), mask=live[None, :])
            else:
                ch_v = 2 * H * _KD + h * _KD + offs_v
                _sync_warps()  # the previous item's reads of p_smem are done
                p_smem.store(pt)  # P^T: row s = P[:, s]

                acc = gl.zeros([_KD, TP], gl.float32, mma)  # S0 W^T
                for c in gl.static_range(_KD // BK):
                    s = it % STAGES
                    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                    s_smem = s_bufs.index(s)
                    w_smem = w_bufs.index(s)
                    s_reg = s_smem.load(a_reg)
                    s_lo = s_reg - _tf32_part(s_reg)
                    # chained async wgmmas, one wait: then the buffer goes back to the TMA warp
                    w_hi = w_smem.slice(0, TP).permute((1, 0))
                    acc = warpgroup_mma(s_smem, w_hi, acc, is_async=True)
                    acc = warpgroup_mma(s_smem, w_smem.slice(TP, TP).permute((1, 0)), acc, is_async=True)
                    acc = warpgroup_mma(s_lo, w_hi, acc, is_async=True)
                    acc, s_lo = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_lo))
                    mbarrier.arrive(empty.index(s), count=1)
                    it += 1

                # o [V, t] = (S0 W^T)[V, t] + sum_s yv_s[V] P[t, s]
                _sync_warps()  # p_smem written by every thread
                o = gl.convert_layout(acc, rows)
                icw_row = icw_ptr + row * s_icw_row + ch_v
                for sx in gl.static_range(STEPS):
                    on = sx < n_tok
                    m_on = (offs_v < _KD) & on
                    # token sx's column (an in-thread sum of bit patterns: exact, signed zeros kept)
                    x = gl.sum(gl.where(offs_t[None, :] == sx, xt, 0), axis=1).to(gl.float32, bitcast=True)
                    yv = _round_act(_conv_silu(c0, c1, c2, x, w0, w1, w2, w3), ACT_BF16)
                    c0 = c1
                    c1 = c2
                    c2 = x
                    ic = icw_row + sx * s_icw_step
                    gl.store(ic, c0.to(icw_ty), mask=m_on)
                    gl.store(ic + s_icw_win, c1.to(icw_ty), mask=m_on)
                    gl.store(ic + 2 * s_icw_win, c2.to(icw_ty), mask=m_on)
                    gl.store(rv_ptr + slot * s_rv_slot + h64 * s_rv_h + sx * s_rv_t + offs_v, yv.to(rv_ty),
                             mask=m_on)
                    p_col = p_smem.slice(sx, 1).load(rows)  # [1, TP]: P[:, sx]
                    o = o + gl.where(on, yv, 0.0)[:, None] * p_col
                o = _round_act(o, ACT_BF16)
                if GATE:
                    # K3's gated RMS norm per token over the head's 128 channels (common._gated_rms_norm)
                    var = gl.sum(o * o, axis=0) / 128
                    rstd = 1 / gl.sqrt(var + onorm_eps)
                    o = _round_act(o * rstd[None, :] * nw[:, None] * (1.0 / (1.0 + gl.exp(-gate))), ACT_BF16)
                gl.store(o_ptrs, o.to(out_ty), mask=live[None, :])

    @gluon.jit
    def _verify_stream_gluon_kernel(
        s_desc, w_desc,
        v_ptr, out_ptr, cw_ptr, conv_ptr, slot_ptr, cu_ptr, icw_ptr, irow_ptr, rv_ptr, pp_ptr,
        og_ptr, onw_ptr, onorm_eps,
        N, T, H, n_items,
        s_v_t, s_v_h, s_o_t, s_o_h, s_w, s_conv_slot, s_conv_row,
        s_icw_row, s_icw_step, s_icw_win, s_rv_slot, s_rv_h, s_rv_t, s_og_t, s_og_h,
        STEPS: gl.constexpr, TP: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
        ACT_BF16: gl.constexpr, GATE: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        s_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, _KD, BK], s_desc.layout)
        w_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 2 * TP, BK], w_desc.layout)
        p_smem = gl.allocate_shared_memory(gl.float32, [TP, TP],
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (s_bufs, w_bufs, p_smem, ready, empty,
                         v_ptr, out_ptr, cw_ptr, conv_ptr, slot_ptr, cu_ptr, icw_ptr, irow_ptr, rv_ptr, pp_ptr,
                         og_ptr, onw_ptr, onorm_eps,
                         N, T, H, n_items,
                         s_v_t, s_v_h, s_o_t, s_o_h, s_w, s_conv_slot, s_conv_row,
                         s_icw_row, s_icw_step, s_icw_win, s_rv_slot, s_rv_h, s_rv_t, s_og_t, s_og_h,
                         STEPS, TP, BK, STAGES, ACT_BF16, GATE)),
            (_producer, (s_desc, w_desc, s_bufs, w_bufs, ready, empty, slot_ptr, H, n_items, TP, BK, STAGES)),
        ], [1], [PRODUCER_REGS])


def launch_verify_stream_gluon(v, out, *, conv_weight, ssm_state, conv_state, slot_indices, cu_seqlens,
                               intermediate_conv, intermediate_rows, ring_rawv, ws, pp, N, T, H, steps, TP,
                               act_bf16, gate=None):
    """Launch the Gluon streaming kernel after the prep and (``SPLIT_W``) finish kernels.

    ``ws``: the chunked verify's workspace ``[N, H, 2, TP, 128]`` fp32 with ``[W_hi ; W_lo]``
    per (request, head); ``pp``: ``[N, H, TP, TP]`` fp32 window coupling ``P``. The other
    arguments are :func:`.mtp_verify.mtp_verify`'s, validated. ``gate``: ``(output_gate, weight,
    eps, counters)`` or None (the counters are not needed: one CTA holds a whole head).
    Launch options: :data:`LAUNCH`, read at each call. Launched without programmatic
    dependent launch: with it the verify + fold step measured 4-5 % slower
    (docs/design/alternatives-measured.md)."""
    cfg = LAUNCH
    block_k = cfg.block_k
    KD_ = KD
    slots = ssm_state.shape[0]
    s_layout = gl.NVMMASharedLayout.get_default_for([KD_, block_k], gl.float32)
    w_layout = gl.NVMMASharedLayout.get_default_for([2 * TP, block_k], gl.float32)
    s_desc = TensorDescriptor(ssm_state, [slots * H * KD_, KD_], [KD_, 1], [KD_, block_k], s_layout)
    w_desc = TensorDescriptor(ws, [N * H * 2 * TP, KD_], [KD_, 1], [2 * TP, block_k], w_layout)
    if gate is not None:
        og, onw, eps, _ = gate
        gate_args = (og, onw, eps)
        g_strides = (og.stride(1), og.stride(2))
    else:
        gate_args = (out, out, 0.0)  # placeholders, never touched
        g_strides = (0, 0)
    n_items = N * H
    ctas = cfg.ctas_per_sm * _sm_count(v.device.index or 0)
    grid = (max(1, min(n_items, ctas, cfg.max_ctas or ctas)),)
    icw = intermediate_conv
    rv = ring_rawv
    _verify_stream_gluon_kernel[grid](
        s_desc, w_desc,
        v, out, conv_weight, conv_state, slot_indices, cu_seqlens, icw, intermediate_rows, rv, pp,
        *gate_args,
        N, T, H, n_items,
        v.stride(1), v.stride(2), out.stride(1), out.stride(2), conv_weight.stride(0),
        conv_state.stride(0), conv_state.stride(1),
        icw.stride(0), icw.stride(1), icw.stride(2), rv.stride(0), rv.stride(1), rv.stride(2), *g_strides,
        STEPS=steps, TP=TP, BK=block_k, STAGES=cfg.stages, ACT_BF16=act_bf16, GATE=gate is not None,
        PRODUCER_REGS=cfg.producer_regs, num_warps=4, maxnreg=cfg.maxnreg,
    )
    return out
