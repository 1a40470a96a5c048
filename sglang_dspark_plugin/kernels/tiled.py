"""K-tiled recurrent kernels: the state tile is held as ``[KC, BV, KS]`` (``K = KC * KS``) so that
a thread owns one V-row's K-values (``KC`` chunks of ``KS/4`` vectors) and the per-token
reductions over K are mostly in-thread (two warp shuffles per row instead of five per row-chunk).

Same math, helpers and rounding as the ``[BV, 128]`` kernels they replace:

* :func:`_fold_kernel` -- ReplaySSM commit (``replayssm_fold``);
* :func:`_decode_kernel` -- plain decode, conv and state in place (``decode``);
* :func:`_verify_snapshot_kernel` -- verify in snapshot mode (``mtp_verify``).

The fold and the snapshot verify share :func:`delta_step3`, so under the same compiler the fold
of accept ``a`` reproduces the snapshot after step ``a - 1`` operation for operation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mtp_verify import _conv_silu, _kda_gate, _round_act, _sigmoid

KS_DEFAULT = 16  # K values per chunk row (4 lanes x 4-wide vectors)


@triton.jit
def koffs(KC: tl.constexpr, KS: tl.constexpr):
    """K index of every (chunk, lane-vector) position, shaped ``[KC, 1, KS]``."""
    return (tl.arange(0, KC)[:, None, None] * KS + tl.arange(0, KS)[None, None, :])


@triton.jit
def l2norm3(x):
    """x * rsqrt(sum(x^2) + 1e-6) over a [KC, 1, KS] vector; the sum of squares in fp64 like
    ``mtp_verify._l2norm`` (order-independent, so every kernel normalises k identically)."""
    xd = x.to(tl.float64)
    ss = tl.sum(tl.sum(tl.sum(xd * xd, axis=2), axis=1), axis=0) + 1e-6
    return x * tl.rsqrt(ss.to(tl.float32))


@triton.jit
def kdot3(S, x3):
    """sum_K S[:, v, :] x[K] -> [BV] (S [KC, BV, KS], x3 [KC, 1, KS])."""
    return tl.sum(tl.sum(S * x3, axis=2), axis=0)


@triton.jit
def delta_step3(S, k3, g3, beta, v):
    """S <- S * exp(g); u = beta * (v - S k); S <- S + u k^T  on a [KC, BV, KS] tile."""
    S = S * tl.exp(g3)
    u = beta * (v - kdot3(S, k3))
    return tl.fma(u[None, :, None], k3, S)


# ----------------------------------------------------------------------------------------------
# ReplaySSM fold
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["H", "L", "ICW_STEPS", "s_rb_layer", "s_rb_slot", "s_rb_h", "s_rb_t"])
def _fold_kernel(
    ssm_ptr, rv_ptr, rk_ptr, rg_ptr, rb_ptr, slot_ptr, acc_ptr,
    conv_ptr, icw_ptr, irow_ptr, tslot_ptr, tstep_ptr,
    H, L, ICW_STEPS,
    s_ssm_layer, s_ssm_slot,
    s_rv_layer, s_rv_slot, s_rv_h, s_rv_t,
    s_rk_layer, s_rk_slot, s_rk_h, s_rk_t,
    s_rg_layer, s_rg_slot, s_rg_h, s_rg_t,
    s_rb_layer, s_rb_slot, s_rb_h, s_rb_t,
    s_conv_layer, s_conv_slot, s_conv_row,
    s_icw_layer, s_icw_row, s_icw_step, s_icw_win,
    BV: tl.constexpr, KS: tl.constexpr, CONV: tl.constexpr, TRACK: tl.constexpr,
    BCAST: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # programmatic dependent launch (see mtp_verify_wy): reads wait for the producer
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    iv = tl.program_id(0)
    n = tl.program_id(1)
    lh = tl.program_id(2)
    KD: tl.constexpr = 128
    KC: tl.constexpr = KD // KS
    layer = (lh // H).to(tl.int64)
    h = lh % H
    h64 = h.to(tl.int64)
    k3 = koffs(KC, KS)
    offs_v = iv * BV + tl.arange(0, BV)

    slot = tl.load(slot_ptr + n).to(tl.int64)
    acc = tl.load(acc_ptr + n)
    if (slot >= 0) & (acc > 0):
        n_acc = tl.minimum(acc, L)
        tile = h64 * (KD * KD) + offs_v[None, :, None] * KD + k3
        s_layer = ssm_ptr + layer * s_ssm_layer
        S = tl.load(s_layer + slot * s_ssm_slot + tile)
        if TRACK:
            tslot = tl.load(tslot_ptr + n).to(tl.int64)
            tstep = tl.load(tstep_ptr + n)
        rv_base = rv_ptr + layer * s_rv_layer + slot * s_rv_slot + h64 * s_rv_h
        rk_base = rk_ptr + layer * s_rk_layer + slot * s_rk_slot + h64 * s_rk_h
        rg_base = rg_ptr + layer * s_rg_layer + slot * s_rg_slot + h64 * s_rg_h
        rb_base = rb_ptr + layer * s_rb_layer + slot * s_rb_slot + h64 * s_rb_h
        # BCAST: per-K vectors loaded straight into the tile's [KC, BV, KS] layout (replicated over
        # rows), so the loop keeps the tile's register layout (rows across lanes)
        bcast = k3 + 0 * offs_v[None, :, None]
        for t in range(n_acc):
            if BCAST:
                kraw = tl.load(rk_base + t * s_rk_t + k3).to(tl.float32)
                kd = kraw.to(tl.float64)
                r = tl.rsqrt((tl.sum(tl.sum(tl.sum(kd * kd, axis=2), axis=1), axis=0) + 1e-6).to(tl.float32))
                kn = tl.load(rk_base + t * s_rk_t + bcast).to(tl.float32) * r
                g = tl.load(rg_base + t * s_rg_t + bcast)
            else:
                kn = l2norm3(tl.load(rk_base + t * s_rk_t + k3).to(tl.float32))
                g = tl.load(rg_base + t * s_rg_t + k3)
            beta = tl.load(rb_base + t * s_rb_t)
            v = tl.load(rv_base + t * s_rv_t + offs_v).to(tl.float32)
            S = delta_step3(S, kn, g, beta, v)
            if TRACK:
                tl.store(s_layer + tslot * s_ssm_slot + tile, S, mask=(t == tstep) & (tslot >= 0))
        tl.store(s_layer + slot * s_ssm_slot + tile, S)

        if CONV:
            # conv_state[layer, slot] <- intermediate_conv[layer, row, accept - 1] for this V-tile's
            # channel slice of the q, k and v groups of head h.
            row = tl.load(irow_ptr + n).to(tl.int64)
            step = tl.minimum(n_acc, ICW_STEPS) - 1
            src = icw_ptr + layer * s_icw_layer + row * s_icw_row + step.to(tl.int64) * s_icw_step
            dst = conv_ptr + layer * s_conv_layer + slot * s_conv_slot
            for grp in tl.static_range(3):
                ch = grp * H * KD + h * KD + offs_v
                for r in tl.static_range(3):
                    tl.store(dst + r * s_conv_row + ch, tl.load(src + r * s_icw_win + ch))


# ----------------------------------------------------------------------------------------------
# Decode (one token, conv + state in place). One program per (request, head) owns every V-tile
# of the head (a V-split grid would race on the shared q/k conv windows); with BV = 128 the whole
# state tile is loaded at once.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _conv_w3(w_ptr, ch3, s_w):
    base = w_ptr + ch3.to(tl.int64) * s_w
    return (tl.load(base + 0), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3))


@triton.jit(do_not_specialize=["H", "s_b_t", "s_b_h"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr,
    w_ptr, A_log_ptr, dt_bias_ptr,
    ssm_ptr, conv_ptr, slot_ptr,
    H, lower_bound, scale,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_a_t, s_a_h, s_b_t, s_b_h, s_o_t, s_o_h,
    s_w, s_ssm_slot, s_conv_slot, s_conv_row,
    BV: tl.constexpr, KS: tl.constexpr, ACT_BF16: tl.constexpr, USE_LB: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # programmatic dependent launch (see mtp_verify_wy): reads wait for the producer
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n = tl.program_id(0)
    h = tl.program_id(1)
    KD: tl.constexpr = 128
    KC: tl.constexpr = KD // KS
    NV: tl.constexpr = KD // BV
    k3 = koffs(KC, KS)
    offs_k = tl.arange(0, KD)
    out_ty = out_ptr.dtype.element_ty
    h64 = h.to(tl.int64)
    tok = n.to(tl.int64)
    o_base = out_ptr + tok * s_o_t + h64 * s_o_h

    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:
        tl.store(o_base + offs_k, tl.zeros([KD], dtype=tl.float32).to(out_ty))
    else:
        ch_q = h * KD + k3
        ch_k = H * KD + h * KD + k3
        ch_v_all = 2 * H * KD + h * KD + offs_k
        cbase = conv_ptr + slot * s_conv_slot
        s_base = ssm_ptr + slot * s_ssm_slot + h64 * (KD * KD)
        if NV == 1:
            S = tl.load(s_base + offs_k[None, :, None] * KD + k3)  # issue the state read first
        # ---- reads of the old windows (all before the barrier below) ----
        q0 = tl.load(cbase + ch_q).to(tl.float32)
        q1 = tl.load(cbase + s_conv_row + ch_q).to(tl.float32)
        q2 = tl.load(cbase + 2 * s_conv_row + ch_q).to(tl.float32)
        k0 = tl.load(cbase + ch_k).to(tl.float32)
        k1 = tl.load(cbase + s_conv_row + ch_k).to(tl.float32)
        k2 = tl.load(cbase + 2 * s_conv_row + ch_k).to(tl.float32)
        v1_all = tl.load(cbase + s_conv_row + ch_v_all)
        v2_all = tl.load(cbase + 2 * s_conv_row + ch_v_all)
        xq = tl.load(q_ptr + tok * s_q_t + h64 * s_q_h + k3).to(tl.float32)
        xk = tl.load(k_ptr + tok * s_k_t + h64 * s_k_h + k3).to(tl.float32)
        xv_all = tl.load(v_ptr + tok * s_v_t + h64 * s_v_h + offs_k)

        wq0, wq1, wq2, wq3 = _conv_w3(w_ptr, ch_q, s_w)
        wk0, wk1, wk2, wk3 = _conv_w3(w_ptr, ch_k, s_w)
        yq = _round_act(_conv_silu(q0, q1, q2, xq, wq0, wq1, wq2, wq3), ACT_BF16)
        yk = _round_act(_conv_silu(k0, k1, k2, xk, wk0, wk1, wk2, wk3), ACT_BF16)
        qn = l2norm3(yq) * scale
        kn = l2norm3(yk)

        A = tl.exp(tl.load(A_log_ptr + h))
        a_t = tl.load(a_ptr + tok * s_a_t + h64 * s_a_h + k3).to(tl.float32)
        g = _kda_gate(a_t, tl.load(dt_bias_ptr + h * KD + k3), A, lower_bound, USE_LB)
        beta = _sigmoid(tl.load(b_ptr + tok * s_b_t + h64 * s_b_h).to(tl.float32))

        for iv in tl.static_range(NV):
            offs_v = iv * BV + tl.arange(0, BV)
            ch_v = 2 * H * KD + h * KD + offs_v
            v0 = tl.load(cbase + ch_v).to(tl.float32)
            v1 = tl.load(cbase + s_conv_row + ch_v).to(tl.float32)
            v2 = tl.load(cbase + 2 * s_conv_row + ch_v).to(tl.float32)
            xv = tl.load(v_ptr + tok * s_v_t + h64 * s_v_h + offs_v).to(tl.float32)
            wv = w_ptr + ch_v.to(tl.int64) * s_w
            yv = _round_act(_conv_silu(v0, v1, v2, xv, tl.load(wv), tl.load(wv + 1), tl.load(wv + 2),
                                       tl.load(wv + 3)), ACT_BF16)
            s_ptrs = s_base + offs_v[None, :, None] * KD + k3
            if NV > 1:
                S = tl.load(s_ptrs)
            S = delta_step3(S, kn, g, beta, yv)
            tl.store(s_ptrs, S)
            o = kdot3(S, qn)
            tl.store(o_base + offs_v, _round_act(o, ACT_BF16).to(out_ty))

        # ---- shifted windows (c0, c1, c2) <- (c1, c2, x), after every read above ----
        tl.debug_barrier()
        conv_ty = conv_ptr.dtype.element_ty
        tl.store(cbase + ch_q, q1.to(conv_ty))
        tl.store(cbase + s_conv_row + ch_q, q2.to(conv_ty))
        tl.store(cbase + 2 * s_conv_row + ch_q, xq.to(conv_ty))
        tl.store(cbase + ch_k, k1.to(conv_ty))
        tl.store(cbase + s_conv_row + ch_k, k2.to(conv_ty))
        tl.store(cbase + 2 * s_conv_row + ch_k, xk.to(conv_ty))
        tl.store(cbase + ch_v_all, v1_all.to(conv_ty))
        tl.store(cbase + s_conv_row + ch_v_all, v2_all.to(conv_ty))
        tl.store(cbase + 2 * s_conv_row + ch_v_all, xv_all.to(conv_ty))


# ----------------------------------------------------------------------------------------------
# Verify, snapshot mode (every step's state is written: the (1+T) S traffic dominates)
# ----------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["N", "T", "H", "s_b_t", "s_b_h"])
def _verify_snapshot_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr,
    w_ptr, A_log_ptr, dt_bias_ptr,
    ssm_ptr, conv_ptr, slot_ptr, cu_ptr,
    icw_ptr, irow_ptr, issm_ptr,
    N, T, H, lower_bound, scale,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_a_t, s_a_h, s_b_t, s_b_h, s_o_t, s_o_h,
    s_w,
    s_ssm_slot, s_conv_slot, s_conv_row,
    s_icw_row, s_icw_step, s_icw_win,
    s_issm_row, s_issm_step,
    STEPS: tl.constexpr, BV: tl.constexpr, KS: tl.constexpr, ACT_BF16: tl.constexpr,
    USE_LB: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # programmatic dependent launch (see mtp_verify_wy): reads wait for the producer
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    KD: tl.constexpr = 128
    KC: tl.constexpr = KD // KS
    k3 = koffs(KC, KS)
    offs_v = iv * BV + tl.arange(0, BV)
    out_ty = out_ptr.dtype.element_ty
    h64 = h.to(tl.int64)

    cu_end = tl.load(cu_ptr + N)
    for j in tl.static_range(STEPS):
        p = n * STEPS + j
        tl.store(out_ptr + p.to(tl.int64) * s_o_t + h64 * s_o_h + offs_v,
                 tl.zeros([BV], dtype=tl.float32).to(out_ty), mask=(p >= cu_end) & (p < T))

    slot = tl.load(slot_ptr + n).to(tl.int64)
    bos = tl.load(cu_ptr + n)
    n_tok = tl.minimum(tl.load(cu_ptr + n + 1) - bos, STEPS)

    if slot < 0:
        for t in range(n_tok):
            tl.store(out_ptr + (bos + t).to(tl.int64) * s_o_t + h64 * s_o_h + offs_v,
                     tl.zeros([BV], dtype=tl.float32).to(out_ty))
    else:
        row = tl.load(irow_ptr + n).to(tl.int64)
        is_v0 = iv == 0
        tile = offs_v[None, :, None] * KD + k3
        S = tl.load(ssm_ptr + slot * s_ssm_slot + h64 * (KD * KD) + tile)
        ch_q = h * KD + k3
        ch_k = H * KD + h * KD + k3
        ch_v = 2 * H * KD + h * KD + offs_v
        cbase = conv_ptr + slot * s_conv_slot
        q0 = tl.load(cbase + ch_q).to(tl.float32)
        q1 = tl.load(cbase + s_conv_row + ch_q).to(tl.float32)
        q2 = tl.load(cbase + 2 * s_conv_row + ch_q).to(tl.float32)
        k0 = tl.load(cbase + ch_k).to(tl.float32)
        k1 = tl.load(cbase + s_conv_row + ch_k).to(tl.float32)
        k2 = tl.load(cbase + 2 * s_conv_row + ch_k).to(tl.float32)
        v0 = tl.load(cbase + ch_v).to(tl.float32)
        v1 = tl.load(cbase + s_conv_row + ch_v).to(tl.float32)
        v2 = tl.load(cbase + 2 * s_conv_row + ch_v).to(tl.float32)
        wq0, wq1, wq2, wq3 = _conv_w3(w_ptr, ch_q, s_w)
        wk0, wk1, wk2, wk3 = _conv_w3(w_ptr, ch_k, s_w)
        wv0, wv1, wv2, wv3 = _conv_w3(w_ptr, ch_v, s_w)
        A = tl.exp(tl.load(A_log_ptr + h))
        dtb = tl.load(dt_bias_ptr + h * KD + k3)
        icw_base = icw_ptr + row * s_icw_row
        icw_ty = icw_ptr.dtype.element_ty
        issm_base = issm_ptr + row * s_issm_row + h64 * (KD * KD) + tile
        for t in range(n_tok):
            tok = (bos + t).to(tl.int64)
            xq = tl.load(q_ptr + tok * s_q_t + h64 * s_q_h + k3).to(tl.float32)
            xk = tl.load(k_ptr + tok * s_k_t + h64 * s_k_h + k3).to(tl.float32)
            xv = tl.load(v_ptr + tok * s_v_t + h64 * s_v_h + offs_v).to(tl.float32)
            yq = _round_act(_conv_silu(q0, q1, q2, xq, wq0, wq1, wq2, wq3), ACT_BF16)
            yk = _round_act(_conv_silu(k0, k1, k2, xk, wk0, wk1, wk2, wk3), ACT_BF16)
            yv = _round_act(_conv_silu(v0, v1, v2, xv, wv0, wv1, wv2, wv3), ACT_BF16)
            q0, q1, q2 = q1, q2, xq
            k0, k1, k2 = k1, k2, xk
            v0, v1, v2 = v1, v2, xv

            ic = icw_base + t * s_icw_step
            m_qk = is_v0 & (k3 < KD)
            tl.store(ic + ch_q, q0.to(icw_ty), mask=m_qk)
            tl.store(ic + s_icw_win + ch_q, q1.to(icw_ty), mask=m_qk)
            tl.store(ic + 2 * s_icw_win + ch_q, q2.to(icw_ty), mask=m_qk)
            tl.store(ic + ch_k, k0.to(icw_ty), mask=m_qk)
            tl.store(ic + s_icw_win + ch_k, k1.to(icw_ty), mask=m_qk)
            tl.store(ic + 2 * s_icw_win + ch_k, k2.to(icw_ty), mask=m_qk)
            tl.store(ic + ch_v, v0.to(icw_ty))
            tl.store(ic + s_icw_win + ch_v, v1.to(icw_ty))
            tl.store(ic + 2 * s_icw_win + ch_v, v2.to(icw_ty))

            a_t = tl.load(a_ptr + tok * s_a_t + h64 * s_a_h + k3).to(tl.float32)
            g = _kda_gate(a_t, dtb, A, lower_bound, USE_LB)
            beta = _sigmoid(tl.load(b_ptr + tok * s_b_t + h64 * s_b_h).to(tl.float32))
            qn = l2norm3(yq) * scale
            kn = l2norm3(yk)
            S = delta_step3(S, kn, g, beta, yv)
            o = kdot3(S, qn)
            tl.store(out_ptr + tok * s_o_t + h64 * s_o_h + offs_v, _round_act(o, ACT_BF16).to(out_ty))
            tl.store(issm_base + t * s_issm_step, S)
