"""Ring-mode (ReplaySSM) verify in chunked / WY (UT-transform) form: the state is read once and
contracted with the whole window by one matrix product (``tl.dot``) instead of per-token passes.

Ring mode only needs the window's outputs (never a state), so per (request, head) with window
``T``, state ``S0 [V, K]``, normalised ``q_t``/``k_t``, per-K decays ``alpha_t = exp(g_t)`` and
``beta_t``::

    E[t, s, :] = prod_{s < j <= t} alpha_j              (t >= s; running products advanced token by
                                                        token, never an exp of a cumsum difference:
                                                        no overflow, no cancellation in long windows)
    A[s, r]   = sum_K k_s k_r E[s, r]      (r < s)       M[t, s] = sum_K q_t k_s E[t, s] (s <= t)
    Tinv      = (I + diag(beta) A)^-1                    (unit lower triangular, by doubling)
    P         = M Tinv diag(beta)
    O^T       = S0 (q o e^G)^T + (V^T - S0 (k o e^G)^T) P^T,   e^G_t = prod_{j <= t} alpha_j

which equals the recurrence ``S <- S diag(alpha_t) + beta_t (v_t - S diag(alpha_t) k_t) k_t^T``,
``o_t = S q_t`` exactly in exact arithmetic. The two state products share one ``tl.dot``
(``[BV, BK] x [BK, 2T]`` per K-chunk); everything else is ``T x T`` or ``T x 128`` work.

Conv, gates, ring writes and intermediate conv windows are identical to the recurrent kernel of
``mtp_verify.py`` (same helpers, same roundings), so the rings the fold replays are the same bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mtp_verify import _conv_silu, _kda_gate, _round_act, _sigmoid


@triton.jit
def _shift_load(tok_ptr, s_tok, tch, conv_base, s_row, ch, offs_t, bos, n_tok, D: tl.constexpr):
    """x_{t-D} for every window row t (rows) and channel (cols), fp32; zero for t >= n_tok.

    ``tch``: the channels' offsets inside the head (activations), ``ch``: their conv-state channels.

    Token ``t - D >= 0`` comes from the activations, ``t - D in [-3, -1]`` from conv-state row
    ``3 + t - D`` (the previous inputs)."""
    i = offs_t - D
    live = offs_t < n_tok
    m_tok = live & (i >= 0)
    m_cv = live & (i < 0)
    xt = tl.load(tok_ptr + (bos + i).to(tl.int64)[:, None] * s_tok + tch[None, :], mask=m_tok[:, None], other=0.0)
    xc = tl.load(conv_base + (3 + i)[:, None] * s_row + ch[None, :], mask=m_cv[:, None], other=0.0)
    return tl.where(m_tok[:, None], xt.to(tl.float32), xc.to(tl.float32))


@triton.jit
def _mm(a, b):
    """[m, k] @ [k, n] in exact fp32 for small operands.

    From 16 x 16 on, the compiler rewrites a broadcast-multiply-reduce into ``tt.dot`` with its
    default (tf32) precision -- on the H200 that cost the 16-token window 1e-4 of relative output
    error -- so those sizes go through an explicit IEEE ``tl.dot`` (FMA) instead.
    """
    if (a.shape[0] >= 16) and (a.shape[1] >= 16) and (b.shape[1] >= 16):
        return tl.dot(a, b, input_precision="ieee")
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _pad16_cols(x, W: tl.constexpr):
    """[R, W] -> [R, max(W, 16)]: column c moves to c * (16 // W), zeros between (for tl.dot N >= 16)."""
    if W < 16:
        x = tl.reshape(tl.join(x, tl.zeros_like(x)), [x.shape[0], 2 * W])
        if W < 8:
            x = tl.reshape(tl.join(x, tl.zeros_like(x)), [x.shape[0], 4 * W])
            if W < 4:
                x = tl.reshape(tl.join(x, tl.zeros_like(x)), [x.shape[0], 8 * W])
    return x


@triton.jit
def _unpad16_cols(x, W: tl.constexpr):
    """Inverse of :func:`_pad16_cols` on a [R, max(W, 16)] result."""
    if W < 16:
        if W < 8:
            if W < 4:
                x, _ = tl.split(tl.reshape(x, [x.shape[0], 4 * W, 2]))
            x, _ = tl.split(tl.reshape(x, [x.shape[0], 2 * W, 2]))
        x, _ = tl.split(tl.reshape(x, [x.shape[0], W, 2]))
    return x


@triton.jit(do_not_specialize=["N", "T", "H", "s_b_t", "s_b_h", "s_rb_slot", "s_rb_h", "s_rb_t"])
def _mtp_verify_wy_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr,
    w_ptr, A_log_ptr, dt_bias_ptr,
    ssm_ptr, conv_ptr, slot_ptr, cu_ptr,
    icw_ptr, irow_ptr,
    rv_ptr, rk_ptr, rg_ptr, rb_ptr,
    N, T, H, lower_bound, scale,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_a_t, s_a_h, s_b_t, s_b_h, s_o_t, s_o_h,
    s_w,
    s_ssm_slot, s_conv_slot, s_conv_row,
    s_icw_row, s_icw_step, s_icw_win,
    s_rv_slot, s_rv_h, s_rv_t, s_rk_slot, s_rk_h, s_rk_t,
    s_rg_slot, s_rg_h, s_rg_t, s_rb_slot, s_rb_h, s_rb_t,
    STEPS: tl.constexpr, TP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    ACT_BF16: tl.constexpr, USE_LB: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        # programmatic dependent launch: this grid is scheduled while the producer finishes;
        # every read waits here for it (and our dependents may launch at once, they wait too)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    KD: tl.constexpr = 128
    NC: tl.constexpr = 2 * TP if 2 * TP >= 16 else 16
    offs_v = iv * BV + tl.arange(0, BV)
    offs_t = tl.arange(0, TP)
    out_ty = out_ptr.dtype.element_ty
    h64 = h.to(tl.int64)

    # Output rows no request covers ([cu_seqlens[N], T)): zero the dense positions of block n.
    cu_end = tl.load(cu_ptr + N)
    p_d = n * STEPS + offs_t
    tl.store(out_ptr + p_d.to(tl.int64)[None, :] * s_o_t + h64 * s_o_h + offs_v[:, None],
             tl.zeros([BV, TP], dtype=tl.float32).to(out_ty),
             mask=((offs_t < STEPS) & (p_d >= cu_end) & (p_d < T))[None, :])

    slot = tl.load(slot_ptr + n).to(tl.int64)
    bos = tl.load(cu_ptr + n)
    n_tok = tl.minimum(tl.load(cu_ptr + n + 1) - bos, STEPS)
    live = offs_t < n_tok
    o_ptrs = out_ptr + (bos + offs_t).to(tl.int64)[None, :] * s_o_t + h64 * s_o_h + offs_v[:, None]

    if slot < 0:
        # CUDA-graph padding: read nothing from the slot, write nothing but zeros to out.
        tl.store(o_ptrs, tl.zeros([BV, TP], dtype=tl.float32).to(out_ty), mask=live[None, :])
    else:
        row = tl.load(irow_ptr + n).to(tl.int64)
        is_v0 = iv == 0
        cbase = conv_ptr + slot * s_conv_slot
        icw_base = icw_ptr + row * s_icw_row + offs_t.to(tl.int64)[:, None] * s_icw_step
        icw_ty = icw_ptr.dtype.element_ty
        A = tl.exp(tl.load(A_log_ptr + h))
        beta = tl.where(live, _sigmoid(tl.load(b_ptr + (bos + offs_t).to(tl.int64) * s_b_t + h64 * s_b_h,
                                                mask=live, other=0.0).to(tl.float32)), 0.0)
        q_base = q_ptr + h64 * s_q_h
        k_base = k_ptr + h64 * s_k_h
        a_base = a_ptr + h64 * s_a_h
        s_base = ssm_ptr + slot * s_ssm_slot + h64 * (KD * KD) + offs_v[:, None] * KD

        ssq_q = tl.zeros([TP], dtype=tl.float64)  # fp64 like mtp_verify._l2norm
        ssq_k = tl.zeros([TP], dtype=tl.float64)
        A_raw = tl.zeros([TP, TP], dtype=tl.float32)
        M_raw = tl.zeros([TP, TP], dtype=tl.float32)
        acc = tl.zeros([BV, NC], dtype=tl.float32)
        rows = offs_t[:, None]
        rk_tile = rk_ptr + slot * s_rk_slot + h64 * s_rk_h + offs_t.to(tl.int64)[:, None] * s_rk_t
        rg_tile = rg_ptr + slot * s_rg_slot + h64 * s_rg_h + offs_t.to(tl.int64)[:, None] * s_rg_t
        for c in range(0, KD, BK):
            offs_c = c + tl.arange(0, BK)
            ch_q = h * KD + offs_c
            ch_k = H * KD + h * KD + offs_c
            wq = w_ptr + ch_q.to(tl.int64) * s_w
            wk = w_ptr + ch_k.to(tl.int64) * s_w
            wq0, wq1, wq2, wq3 = tl.load(wq), tl.load(wq + 1), tl.load(wq + 2), tl.load(wq + 3)
            wk0, wk1, wk2, wk3 = tl.load(wk), tl.load(wk + 1), tl.load(wk + 2), tl.load(wk + 3)
            dtb = tl.load(dt_bias_ptr + h * KD + offs_c)
            # conv windows of this K-chunk (row 0 oldest), shifted token by token below
            q0 = tl.load(cbase + ch_q).to(tl.float32)
            q1 = tl.load(cbase + s_conv_row + ch_q).to(tl.float32)
            q2 = tl.load(cbase + 2 * s_conv_row + ch_q).to(tl.float32)
            k0 = tl.load(cbase + ch_k).to(tl.float32)
            k1 = tl.load(cbase + s_conv_row + ch_k).to(tl.float32)
            k2 = tl.load(cbase + 2 * s_conv_row + ch_k).to(tl.float32)
            if is_v0:
                # conv windows after each token (x_{t-2}, x_{t-1}, x_t), raw k and g rings: whole
                # [T, BK] tiles here (stores inside the token loop below cost registers)
                xq2 = _shift_load(q_base, s_q_t, offs_c, cbase, s_conv_row, ch_q, offs_t, bos, n_tok, 2)
                xq1 = _shift_load(q_base, s_q_t, offs_c, cbase, s_conv_row, ch_q, offs_t, bos, n_tok, 1)
                xq0 = _shift_load(q_base, s_q_t, offs_c, cbase, s_conv_row, ch_q, offs_t, bos, n_tok, 0)
                m_tile = live[:, None]
                tl.store(icw_base + ch_q[None, :], xq2.to(icw_ty), mask=m_tile)
                tl.store(icw_base + s_icw_win + ch_q[None, :], xq1.to(icw_ty), mask=m_tile)
                tl.store(icw_base + 2 * s_icw_win + ch_q[None, :], xq0.to(icw_ty), mask=m_tile)
                xk3 = _shift_load(k_base, s_k_t, offs_c, cbase, s_conv_row, ch_k, offs_t, bos, n_tok, 3)
                xk2 = _shift_load(k_base, s_k_t, offs_c, cbase, s_conv_row, ch_k, offs_t, bos, n_tok, 2)
                xk1 = _shift_load(k_base, s_k_t, offs_c, cbase, s_conv_row, ch_k, offs_t, bos, n_tok, 1)
                xk0 = _shift_load(k_base, s_k_t, offs_c, cbase, s_conv_row, ch_k, offs_t, bos, n_tok, 0)
                tl.store(icw_base + ch_k[None, :], xk2.to(icw_ty), mask=m_tile)
                tl.store(icw_base + s_icw_win + ch_k[None, :], xk1.to(icw_ty), mask=m_tile)
                tl.store(icw_base + 2 * s_icw_win + ch_k[None, :], xk0.to(icw_ty), mask=m_tile)
                ykt = _round_act(_conv_silu(xk3, xk2, xk1, xk0, wk0[None, :], wk1[None, :], wk2[None, :],
                                            wk3[None, :]), ACT_BF16)
                tl.store(rk_tile + offs_c[None, :], ykt.to(rk_ptr.dtype.element_ty), mask=m_tile)
                at = tl.load(a_base + (bos + offs_t).to(tl.int64)[:, None] * s_a_t + offs_c[None, :],
                             mask=m_tile, other=0.0).to(tl.float32)
                tl.store(rg_tile + offs_c[None, :], _kda_gate(at, dtb[None, :], A, lower_bound, USE_LB), mask=m_tile)
            # W[s] = k_s o prod_{s < j <= t} alpha_j, advanced one token at a time: the pairwise
            # decays are running products (no exp of a cumsum difference, no scan)
            Wr = tl.zeros([TP, BK], dtype=tl.float32)
            Qe = tl.zeros([TP, BK], dtype=tl.float32)  # q_t o e^{G_t}
            Ke = tl.zeros([TP, BK], dtype=tl.float32)  # k_t o e^{G_t}
            pre = tl.full([BK], 1.0, dtype=tl.float32)  # e^{G_t} = prod_{j <= t} alpha_j
            for t in tl.static_range(STEPS):
                live_t = t < n_tok
                tok = (bos + t).to(tl.int64)
                xq = tl.load(q_base + tok * s_q_t + offs_c, mask=(offs_c < KD) & live_t, other=0.0).to(tl.float32)
                xk = tl.load(k_base + tok * s_k_t + offs_c, mask=(offs_c < KD) & live_t, other=0.0).to(tl.float32)
                yq = tl.where(live_t, _round_act(_conv_silu(q0, q1, q2, xq, wq0, wq1, wq2, wq3), ACT_BF16), 0.0)
                yk = tl.where(live_t, _round_act(_conv_silu(k0, k1, k2, xk, wk0, wk1, wk2, wk3), ACT_BF16), 0.0)
                q0, q1, q2 = q1, q2, xq
                k0, k1, k2 = k1, k2, xk
                a_t = tl.load(a_base + tok * s_a_t + offs_c, mask=(offs_c < KD) & live_t, other=0.0).to(tl.float32)
                g = _kda_gate(a_t, dtb, A, lower_bound, USE_LB)
                alpha = tl.where(live_t, tl.exp(g), 1.0)

                sel = rows == t
                Wr = tl.where(rows < t, Wr * alpha[None, :], tl.where(sel, yk[None, :], Wr))
                pre = pre * alpha
                Qe = tl.where(sel, (yq * pre)[None, :], Qe)
                Ke = tl.where(sel, (yk * pre)[None, :], Ke)
                A_t = tl.sum(Wr * yk[None, :], axis=1)  # [s]: sum_K k_t k_s prod alpha (s <= t)
                M_t = tl.sum(Wr * yq[None, :], axis=1)
                A_raw = tl.where(sel, A_raw + A_t[None, :], A_raw)
                M_raw = tl.where(sel, M_raw + M_t[None, :], M_raw)
                yqd = yq.to(tl.float64)
                ykd = yk.to(tl.float64)
                ssq_q = tl.where(offs_t == t, ssq_q + tl.sum(yqd * yqd, axis=0), ssq_q)
                ssq_k = tl.where(offs_t == t, ssq_k + tl.sum(ykd * ykd, axis=0), ssq_k)

            # S0 [BV, BK] x [(q o e^G)^T | (k o e^G)^T] [BK, 2T]: both state products in one dot
            qk = tl.reshape(tl.join(tl.trans(Qe), tl.trans(Ke)), [BK, 2 * TP])
            S0 = tl.load(s_base + offs_c[None, :])
            acc = tl.dot(S0, _pad16_cols(qk, 2 * TP), acc, input_precision=DOT_PREC)

        # T x T algebra (per request and head; independent of the V-tile)
        rq = tl.rsqrt((ssq_q + 1e-6).to(tl.float32)) * scale
        rk = tl.rsqrt((ssq_k + 1e-6).to(tl.float32))
        lower = offs_t[:, None] > offs_t[None, :]
        eye = tl.where(offs_t[:, None] == offs_t[None, :], 1.0, 0.0)
        Nm = tl.where(lower, A_raw * rk[:, None] * rk[None, :] * beta[:, None], 0.0)
        Mm = tl.where(lower | (eye > 0), M_raw * rq[:, None] * rk[None, :], 0.0)
        # (I + Nm)^-1 = (I - Nm)(I + Nm^2)(I + Nm^4)(I + Nm^8)  (Nm strictly lower, Nm^16 = 0)
        Tinv = eye - Nm
        if TP > 2:
            N2 = _mm(Nm, Nm)
            Tinv = Tinv + _mm(Tinv, N2)
            if TP > 4:
                N4 = _mm(N2, N2)
                Tinv = Tinv + _mm(Tinv, N4)
                if TP > 8:
                    N8 = _mm(N4, N4)
                    Tinv = Tinv + _mm(Tinv, N8)
        P = _mm(Mm, Tinv) * beta[None, :]  # [t, s]

        W2 = tl.reshape(_unpad16_cols(acc, 2 * TP), [BV, TP, 2])
        Wq, Wk = tl.split(W2)  # [BV, T]: S0 (q o e^G)^T, S0 (k o e^G)^T (unnormalised)

        # v channels of this V-tile: conv, windows, ring
        ch_v = 2 * H * KD + h * KD + offs_v
        v_base = v_ptr + h64 * s_v_h
        xv3 = _shift_load(v_base, s_v_t, offs_v, cbase, s_conv_row, ch_v, offs_t, bos, n_tok, 3)
        xv2 = _shift_load(v_base, s_v_t, offs_v, cbase, s_conv_row, ch_v, offs_t, bos, n_tok, 2)
        xv1 = _shift_load(v_base, s_v_t, offs_v, cbase, s_conv_row, ch_v, offs_t, bos, n_tok, 1)
        xv0 = _shift_load(v_base, s_v_t, offs_v, cbase, s_conv_row, ch_v, offs_t, bos, n_tok, 0)
        wv = w_ptr + ch_v.to(tl.int64) * s_w
        yv = _round_act(_conv_silu(xv3, xv2, xv1, xv0, tl.load(wv)[None, :], tl.load(wv + 1)[None, :],
                                   tl.load(wv + 2)[None, :], tl.load(wv + 3)[None, :]), ACT_BF16)
        m_live = live[:, None]
        tl.store(icw_base + ch_v[None, :], xv2.to(icw_ty), mask=m_live)
        tl.store(icw_base + s_icw_win + ch_v[None, :], xv1.to(icw_ty), mask=m_live)
        tl.store(icw_base + 2 * s_icw_win + ch_v[None, :], xv0.to(icw_ty), mask=m_live)
        tl.store(rv_ptr + slot * s_rv_slot + h64 * s_rv_h + offs_t.to(tl.int64)[:, None] * s_rv_t
                 + offs_v[None, :], yv.to(rv_ptr.dtype.element_ty), mask=m_live)
        tl.store(rb_ptr + slot * s_rb_slot + h64 * s_rb_h + offs_t * s_rb_t, beta, mask=live & is_v0)

        # O^T = S0 Qg^T + (V^T - S0 Kg^T) P^T
        Z = tl.trans(yv) - Wk * rk[None, :]  # [BV, T]
        if TP >= 16:
            o = Wq * rq[None, :] + tl.dot(Z, tl.trans(P), input_precision="ieee")
        else:
            o = Wq * rq[None, :] + tl.sum(Z[:, None, :] * P[None, :, :], axis=2)
        tl.store(o_ptrs, _round_act(o, ACT_BF16).to(out_ty), mask=live[None, :])


def launch_verify_ring_wy(q, k, v, a, b, out, *, conv_weight, A_flat, dt_flat, lower_bound, scale, ssm_state,
                          conv_state, slot_indices, cu_seqlens, intermediate_conv, intermediate_rows,
                          ring_rawv, ring_rawk, ring_g, ring_beta, N, T, H, steps, act_bf16,
                          block_v=128, block_k=32, num_warps=4, num_stages=None, dot_precision="tf32x3",
                          pdl=False):
    """Launch :func:`_mtp_verify_wy_kernel` on already validated arguments (see ``mtp_verify``)."""
    TP = max(2, triton.next_power_of_2(steps))
    rv, rk, rg, rb = ring_rawv, ring_rawk, ring_g, ring_beta
    kw = dict(num_warps=num_warps)
    if pdl:
        kw.update(USE_PDL=True, launch_pdl=True)
    if num_stages is not None:
        kw["num_stages"] = num_stages
    grid = (128 // block_v, N, H)
    _mtp_verify_wy_kernel[grid](
        q, k, v, a, b, out,
        conv_weight, A_flat, dt_flat,
        ssm_state, conv_state, slot_indices, cu_seqlens,
        intermediate_conv, intermediate_rows,
        rv, rk, rg, rb,
        N, T, H, 0.0 if lower_bound is None else lower_bound, scale,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        a.stride(1), a.stride(2), b.stride(1), b.stride(2), out.stride(1), out.stride(2),
        conv_weight.stride(0),
        ssm_state.stride(0), conv_state.stride(0), conv_state.stride(1),
        intermediate_conv.stride(0), intermediate_conv.stride(1), intermediate_conv.stride(2),
        rv.stride(0), rv.stride(1), rv.stride(2), rk.stride(0), rk.stride(1), rk.stride(2),
        rg.stride(0), rg.stride(1), rg.stride(2), rb.stride(0), rb.stride(1), rb.stride(2),
        STEPS=steps, TP=TP, BV=block_v, BK=block_k, ACT_BF16=act_bf16,
        USE_LB=lower_bound is not None, DOT_PREC=dot_precision,
        **kw,
    )
    return out
