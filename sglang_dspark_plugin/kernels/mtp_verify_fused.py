"""Fused ring-mode verify: one program per (request, head), the window's algebra once, then the
state tiles streamed through one ``tl.dot`` each.

The chunked verify (``mtp_verify_chunked.py``) runs three launches: a prep kernel per channel
chunk (conv, gates, pair sums), a finish kernel per head (the ``T x T`` coupling) and a streaming
kernel per V-tile. The prep moves only a few KiB per head but took 29-49 us of a 107 us verify at
H=32, N=64 on the H200 (docs/lazy-flush.md); here that work is the prologue of the program that
then streams the head's state, as in the factored decode (``decode.py``), and other programs'
state loads hide it.

Math (the chunked module's docstring has the derivation), per (request, head), window of ``n``
tokens, ``Qg = yq o e^G``, ``Kg = yk o e^G`` (conv outputs before the norm, ``G`` the window's
inclusive prefix sums of the log-decays), ``rq`` / ``rk`` the norms' reciprocals (``rq`` times the
scale), ``P = M Tm``, ``Tm = (I + diag(beta) A)^-1 diag(beta)``::

    W  = diag(rq) Qg - P diag(rk) Kg            [T, 128]  (prologue)
    Wk = Tm diag(rk) Kg                          [T, 128]  (prologue, lazy record ring only)
    O^T = S W^T + V^T P^T                        (per V-tile: one state product)
    U^T = V^T Tm^T - S Wk^T                      (the window's corrected deltas: lazy records)

``S`` is the state the window starts from: the pool state (fold every commit), or under the lazy
record ring the checkpoint carried over the slot's ``p`` pending records,
``S = S0 o e^{G_p} + D^T Kc``, taken as ``S X^T = S0 (e^{G_p} o X)^T + D^T (Kc X^T)`` with
``Kc X^T`` formed once per head; a window that does not fit behind the records forms ``S`` per
tile, writes it to the checkpoint (the flush) and starts its records at row 0. The state product's
operand ``X`` is ``W`` (padded to 16 rows: ``tl.dot``'s minimum) or ``[W ; Wk]`` (each padded to
``max(T, 8)`` rows).

Writes (the same bytes as the chunked kernels, whose helpers it uses): the conv windows after
every token, the rawk / g / beta rings (fold every commit: rawv too; lazy: the records' keys,
gates, key-norm reciprocals and deltas at rows ``base + t``) and the outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _carried_keys, _kda_gate, _lazy_cursor, _load_delta, _pdl_enter, _sigmoid, _store_delta, _round_act
from .mtp_verify_chunked import (_conv_inputs, _conv_outputs, _mm_small, _pair_sums, _prefix_sum_pair,
                                 _unit_lower_inverse_rows)


@triton.jit
def _stack_rows(a, b, ROWS: tl.constexpr, C: tl.constexpr):
    """``[a ; b]``: two ``[ROWS, C]`` tiles stacked to ``[2 ROWS, C]``."""
    return tl.reshape(tl.permute(tl.join(a, b), [2, 0, 1]), [2 * ROWS, C])


@triton.jit
def _pad_rows(x, ROWS: tl.constexpr, OUT: tl.constexpr, C: tl.constexpr):
    """``x [ROWS, C]`` with zero rows appended up to ``OUT`` rows (powers of two, ``OUT <= 8 ROWS``)."""
    if OUT >= 2 * ROWS:
        x = _stack_rows(x, tl.zeros([ROWS, C], dtype=tl.float32), ROWS, C)
    if OUT >= 4 * ROWS:
        x = _stack_rows(x, tl.zeros([2 * ROWS, C], dtype=tl.float32), 2 * ROWS, C)
    if OUT >= 8 * ROWS:
        x = _stack_rows(x, tl.zeros([4 * ROWS, C], dtype=tl.float32), 4 * ROWS, C)
    return x


@triton.jit
def _halves(x, BV: tl.constexpr, COLS: tl.constexpr):
    """The left and right ``COLS / 2`` columns of ``x [BV, COLS]``."""
    return tl.split(tl.permute(tl.reshape(x, [BV, 2, COLS // 2]), [0, 2, 1]))


@triton.jit
def _first_cols(x, BV: tl.constexpr, COLS: tl.constexpr, OUT: tl.constexpr):
    """The first ``OUT`` columns of ``x [BV, COLS]`` (powers of two, ``COLS <= 8 OUT``)."""
    if COLS >= 2 * OUT:
        x, _ = _halves(x, BV, COLS)
    if COLS >= 4 * OUT:
        x, _ = _halves(x, BV, COLS // 2)
    if COLS >= 8 * OUT:
        x, _ = _halves(x, BV, COLS // 4)
    return x


@triton.jit(do_not_specialize=["N", "T", "H", "s_b_t", "s_b_h", "s_rv_slot", "s_rv_h", "s_rv_t",
                               "s_rb_slot", "s_rb_h", "s_rb_t"])
def _verify_fused_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr, w_ptr, A_log_ptr, dt_bias_ptr,
    ssm_ptr, conv_ptr, slot_ptr, cu_ptr, icw_ptr, irow_ptr,
    rv_ptr, rk_ptr, rg_ptr, rb_ptr,
    cur_ptr, rd_hi_ptr, rd_lo_ptr, ring_len,
    N, T, H, lower_bound, scale,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_a_t, s_a_h, s_b_t, s_b_h, s_o_t, s_o_h,
    s_w, s_ssm_slot, s_conv_slot, s_conv_row,
    s_icw_row, s_icw_step, s_icw_win,
    s_rv_slot, s_rv_h, s_rv_t, s_rk_slot, s_rk_h, s_rk_t, s_rg_slot, s_rg_h, s_rg_t, s_rb_slot, s_rb_h, s_rb_t,
    s_rd_slot, s_rd_h, s_rd_t,
    STEPS: tl.constexpr, TP: tl.constexpr, BV: tl.constexpr, ACT_BF16: tl.constexpr, USE_LB: tl.constexpr,
    DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr = False,
    LAZY: tl.constexpr = False, LP: tl.constexpr = 16, SPLIT_D: tl.constexpr = False,
):
    """Program (n, h): the window's prologue for the head, then its ``128 / BV`` state tiles."""
    _pdl_enter(USE_PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    KD: tl.constexpr = 128
    NV: tl.constexpr = KD // BV
    TW: tl.constexpr = max(TP, 8)  # rows of each half of the lazy operand [W ; Wk]
    R: tl.constexpr = 2 * TW if LAZY else max(TP, 16)  # rows of the state product's operand
    offs_t = tl.arange(0, TP)
    offs_k = tl.arange(0, KD)
    out_ty = out_ptr.dtype.element_ty
    h64 = h.to(tl.int64)

    # Output rows no request covers ([cu_seqlens[N], T)): zero the dense positions of block n.
    cu_end = tl.load(cu_ptr + N)
    p_d = n * STEPS + offs_t
    tl.store(out_ptr + p_d.to(tl.int64)[:, None] * s_o_t + h64 * s_o_h + offs_k[None, :],
             tl.zeros([TP, KD], dtype=tl.float32).to(out_ty),
             mask=((offs_t < STEPS) & (p_d >= cu_end) & (p_d < T))[:, None])

    slot = tl.load(slot_ptr + n).to(tl.int64)
    bos = tl.load(cu_ptr + n)
    n_tok = tl.minimum(tl.load(cu_ptr + n + 1) - bos, STEPS)
    live = offs_t < n_tok
    m_live = live[:, None]
    if slot < 0:
        # CUDA-graph padding: read nothing from the slot, write nothing but zeros to out.
        tl.store(out_ptr + (bos + offs_t).to(tl.int64)[:, None] * s_o_t + h64 * s_o_h + offs_k[None, :],
                 tl.zeros([TP, KD], dtype=tl.float32).to(out_ty), mask=m_live)
    else:
        row = tl.load(irow_ptr + n).to(tl.int64)
        cbase = conv_ptr + slot * s_conv_slot
        icw_base = icw_ptr + row * s_icw_row + offs_t.to(tl.int64)[:, None] * s_icw_step
        ch_q = h * KD + offs_k
        ch_k = H * KD + h * KD + offs_k
        # ---- prologue: every load first (see _conv_inputs) ----
        q3, q2, q1, q0, wq0, wq1, wq2, wq3 = _conv_inputs(q_ptr + h64 * s_q_h, s_q_t, offs_k, ch_q, cbase,
                                                          s_conv_row, offs_t, bos, n_tok, w_ptr, s_w)
        k3, k2, k1, k0, wk0, wk1, wk2, wk3 = _conv_inputs(k_ptr + h64 * s_k_h, s_k_t, offs_k, ch_k, cbase,
                                                          s_conv_row, offs_t, bos, n_tok, w_ptr, s_w)
        at = tl.load(a_ptr + h64 * s_a_h + (bos + offs_t).to(tl.int64)[:, None] * s_a_t + offs_k[None, :],
                     mask=m_live, other=0.0).to(tl.float32)
        dtb = tl.load(dt_bias_ptr + h * KD + offs_k)
        A_h = tl.exp(tl.load(A_log_ptr + h))
        b_raw = tl.load(b_ptr + (bos + offs_t).to(tl.int64) * s_b_t + h64 * s_b_h, mask=live, other=0.0)
        rk_base = rk_ptr + slot * s_rk_slot + h64 * s_rk_h
        rg_base = rg_ptr + slot * s_rg_slot + h64 * s_rg_h
        rb_base = rb_ptr + slot * s_rb_slot + h64 * s_rb_h
        if LAZY:
            p, flush, base = _lazy_cursor(cur_ptr, slot, ring_len, STEPS)
            Kc, ckpt_decay = _carried_keys(rk_base, rg_base, rb_base, s_rk_t, s_rg_t, s_rb_t, offs_k, p, LP)
            offs_l = tl.arange(0, LP)
            pend = offs_l < p
            rd_base = slot * s_rd_slot + h64 * s_rd_h
            # the pending records are read; a flushing window's records overwrite rows from 0
            tl.debug_barrier()
        else:
            base = 0
        rows_t = (base + offs_t).to(tl.int64)

        yq = _conv_outputs(q3, q2, q1, q0, wq0, wq1, wq2, wq3, ch_q, icw_base, s_icw_win, m_live, ACT_BF16)
        yk = _conv_outputs(k3, k2, k1, k0, wk0, wk1, wk2, wk3, ch_k, icw_base, s_icw_win, m_live, ACT_BF16)
        g = tl.where(m_live, _kda_gate(at, dtb[None, :], A_h, lower_bound, USE_LB), 0.0)
        beta = tl.where(live, _sigmoid(b_raw.to(tl.float32)), 0.0)
        tl.store(rk_base + rows_t[:, None] * s_rk_t + offs_k[None, :], yk.to(rk_ptr.dtype.element_ty), mask=m_live)
        tl.store(rg_base + rows_t[:, None] * s_rg_t + offs_k[None, :], g, mask=m_live)

        # ---- the window's coupling (as mtp_verify_chunked._window_coupling, over all 128 channels) ----
        hi, lo = _prefix_sum_pair(g)
        A_raw, M_raw = _pair_sums(yq, yk, hi, lo, m_live, TP)
        yqd = yq.to(tl.float64)
        ykd = yk.to(tl.float64)
        rq = tl.rsqrt((tl.sum(yqd * yqd, axis=1) + 1e-6).to(tl.float32)) * scale
        rk = tl.rsqrt((tl.sum(ykd * ykd, axis=1) + 1e-6).to(tl.float32))
        lower = offs_t[:, None] > offs_t[None, :]
        diag = offs_t[:, None] == offs_t[None, :]
        Nm = tl.where(lower, A_raw * rk[:, None] * rk[None, :] * beta[:, None], 0.0)
        Mm = tl.where(lower | diag, M_raw * rq[:, None] * rk[None, :], 0.0)
        inv = _unit_lower_inverse_rows(Nm, TP)
        P = _mm_small(Mm, inv, TP) * beta[None, :]
        eG = tl.exp(hi + lo)
        Kg = yk * eG
        W = yq * eG * rq[:, None] - _mm_small(P * rk[None, :], Kg, TP)
        if LAZY:
            Tm = inv * beta[None, :]
            Wk = _mm_small(Tm * rk[None, :], Kg, TP)
            tl.store(rb_base + rows_t * s_rb_t, rk, mask=live)
            X = _stack_rows(_pad_rows(W, TP, TW, KD), _pad_rows(Wk, TP, TW, KD), TW, KD)  # [R, 128]
            Xc = X * ckpt_decay[None, :]  # the checkpoint's product: S0 (e^{G_p} o X)^T
            KX = tl.dot(Kc, tl.trans(X), input_precision=DOT_PREC)  # [LP, R]: the records' Kc X^T
        else:
            tl.store(rb_base + rows_t * s_rb_t, beta, mask=live)
            X = _pad_rows(W, TP, R, KD)

        # ---- the state tiles ----
        s_base = ssm_ptr + slot * s_ssm_slot + h64 * (KD * KD)
        o_rows = out_ptr + (bos + offs_t).to(tl.int64)[None, :] * s_o_t + h64 * s_o_h
        ch_v0 = 2 * H * KD + h * KD
        for iv in range(NV):
            offs_v = iv * BV + tl.arange(0, BV)
            s_ptrs = s_base + offs_v[:, None] * KD + offs_k[None, :]
            S0 = tl.load(s_ptrs)
            if LAZY:
                D = _load_delta(rd_hi_ptr, rd_lo_ptr, rd_base + offs_l[:, None] * s_rd_t + offs_v[None, :],
                                pend[:, None], SPLIT_D)  # [LP, BV]
                if flush:  # the state after the records, formed and written back: the only state write
                    S = tl.dot(tl.trans(D), Kc, S0 * ckpt_decay[None, :], input_precision=DOT_PREC)
                    tl.store(s_ptrs, S)
                    acc = tl.dot(S, tl.trans(X), input_precision=DOT_PREC)
                else:
                    acc = tl.dot(S0, tl.trans(Xc), input_precision=DOT_PREC)
                    acc = tl.dot(tl.trans(D), KX, acc, input_precision=DOT_PREC)
            else:
                acc = tl.dot(S0, tl.trans(X), input_precision=DOT_PREC)
            # the v conv of this tile's channels (conv windows; fold every commit: the rawv ring)
            ch_v = ch_v0 + offs_v
            v3, v2, v1, v0, wv0, wv1, wv2, wv3 = _conv_inputs(v_ptr + h64 * s_v_h, s_v_t, offs_v, ch_v, cbase,
                                                              s_conv_row, offs_t, bos, n_tok, w_ptr, s_w)
            yv = _conv_outputs(v3, v2, v1, v0, wv0, wv1, wv2, wv3, ch_v, icw_base, s_icw_win, m_live, ACT_BF16)
            yvT = tl.trans(yv)  # [BV, TP]
            if LAZY:
                acc_o, acc_u = _halves(acc, BV, R)
                o = _first_cols(acc_o, BV, TW, TP) + _mm_small(yvT, tl.trans(P), TP)
                U = _mm_small(yvT, tl.trans(Tm), TP) - _first_cols(acc_u, BV, TW, TP)
                tl.debug_barrier()  # every thread has read this tile's pending deltas (a flush overwrites them)
                _store_delta(rd_hi_ptr, rd_lo_ptr, rd_base + rows_t[None, :] * s_rd_t + offs_v[:, None], U,
                             live[None, :], SPLIT_D)
            else:
                o = _first_cols(acc, BV, R, TP) + _mm_small(yvT, tl.trans(P), TP)
                tl.store(rv_ptr + slot * s_rv_slot + h64 * s_rv_h + offs_t.to(tl.int64)[:, None] * s_rv_t
                         + offs_v[None, :], yv.to(rv_ptr.dtype.element_ty), mask=m_live)
            tl.store(o_rows + offs_v[:, None], _round_act(o, ACT_BF16).to(out_ty), mask=live[None, :])


def launch_verify_ring_fused(q, k, v, a, b, out, *, conv_weight, A_flat, dt_flat, lower_bound, scale, ssm_state,
                             conv_state, slot_indices, cu_seqlens, intermediate_conv, intermediate_rows,
                             ring_rawv, ring_rawk, ring_g, ring_beta, N, T, H, steps, act_bf16,
                             block_v=32, num_warps=4, num_stages=None, dot_precision="tf32x3", pdl_kwargs=None,
                             record_cursor=None, ring_delta=None):
    """Launch the fused kernel, grid ``(N, H)``, on arguments ``mtp_verify`` has validated (the
    same as the chunked kernels'; no workspace). ``block_v``: state rows per loop step (16..128);
    ``num_stages``: Triton's software pipelining of the state tiles' loads (None: its default).
    Lazy record ring: ``record_cursor`` and ``ring_delta`` = ``(hi, lo)`` as in
    :func:`.mtp_verify_chunked.launch_verify_ring_chunked`."""
    rv, rk, rg, rb = ring_rawv, ring_rawk, ring_g, ring_beta
    TP = max(2, triton.next_power_of_2(steps))
    lazy = record_cursor is not None
    L = rk.shape[-2]
    if lazy:
        rd_hi, rd_lo = ring_delta
        split_d = rd_lo is not None
        rd_lo = rd_hi if rd_lo is None else rd_lo
        cursor, rd_strides = record_cursor, rd_hi.stride()[:3]
    else:
        rd_hi = rd_lo = ssm_state  # placeholders, never touched
        cursor, split_d, rd_strides = slot_indices, False, (0, 0, 0)
    icw = intermediate_conv
    _verify_fused_kernel[(N, H)](
        q, k, v, a, b, out, conv_weight, A_flat, dt_flat,
        ssm_state, conv_state, slot_indices, cu_seqlens, icw, intermediate_rows,
        rv, rk, rg, rb,
        cursor, rd_hi, rd_lo, L,
        N, T, H, 0.0 if lower_bound is None else lower_bound, scale,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        a.stride(1), a.stride(2), b.stride(1), b.stride(2), out.stride(1), out.stride(2),
        conv_weight.stride(0), ssm_state.stride(0), conv_state.stride(0), conv_state.stride(1),
        icw.stride(0), icw.stride(1), icw.stride(2),
        rv.stride(0), rv.stride(1), rv.stride(2), rk.stride(0), rk.stride(1), rk.stride(2),
        rg.stride(0), rg.stride(1), rg.stride(2), rb.stride(0), rb.stride(1), rb.stride(2),
        *rd_strides,
        STEPS=steps, TP=TP, BV=block_v, ACT_BF16=act_bf16, USE_LB=lower_bound is not None,
        DOT_PREC=dot_precision, LAZY=lazy, LP=max(16, triton.next_power_of_2(L)), SPLIT_D=split_d,
        num_warps=num_warps, **({} if num_stages is None else dict(num_stages=num_stages)), **(pdl_kwargs or {}),
    )
    return out
