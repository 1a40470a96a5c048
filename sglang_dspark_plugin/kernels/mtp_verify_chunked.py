"""Chunked (WY / UT-transform) ring-mode verify: a prep kernel and a streaming kernel.

The recurrent kernel (``mtp_verify.py``, ``impl="rows"``) makes four passes over a
``[block_v, 128]`` state tile per token, each K-reduction a warp-shuffle tree: on the H200 that
is compute-bound from ~4 tokens on. Here the state is contracted with the whole window by
tensor-core products (``tl.dot``) and the token-to-token coupling is ``T x T`` algebra.

Math, per (request, head), window of ``n`` tokens, state ``S0 [V, K]``, ``k_t``/``q_t`` the
normalised keys / scaled queries, per-K log-decays ``g_t``, ``G_t = sum_{j <= t} g_j``::

    recurrence:  S_t = S_{t-1} diag(e^{g_t}) + beta_t (v_t - S_{t-1} diag(e^{g_t}) k_t) k_t^T,  o_t = S_t q_t
    closed form: S_t = S0 diag(e^{G_t}) + sum_{s <= t} u_s (k_s o e^{G_t - G_s})^T
                 A[t, s] = sum_K k_t k_s e^{G_t - G_s}   (s < t)
                 M[t, s] = sum_K q_t k_s e^{G_t - G_s}   (s <= t)
                 U^T = (I + diag(beta) A)^-1 diag(beta) (V^T - (k o e^G) S0^T)
                 O^T = (q o e^G) S0^T + M U^T

Split: the *prep* kernel (one program per request, head and chunk of q/k channels) does the
channel-local work that does not touch the state -- q/k conv, gates, rings, conv windows -- and
leaves ``q o e^G``, ``k o e^G`` and the chunk's partial ``A``/``M`` and sums of squares in a small
workspace; the *streaming* kernel (one program per request, head and V-tile) reads the state once,
in K-chunks, into ``tl.dot`` (``tf32x3`` by default: three tf32 products, about fp32 accuracy),
does the v conv of its V-tile and combines. The window coupling ``P = M (I + diag(beta) A)^-1
diag(beta)`` (from the partials, with the norms) is computed by the streaming kernel after its
state loop for windows up to 4 tokens (``O^T = S0 Qg^T rq + (V^T - S0 Kg^T rk) P^T``), and from 5
tokens by a *finish* kernel per (request, head) between the two, which also folds it into one
q-side operand ``W = diag(rq) Qg - P diag(rk) Kg`` (``O^T = S0 W^T + V^T P^T``). One kernel doing
everything ran at low occupancy (255 registers) and was 2x slower on the H200
(docs/design/alternatives-measured.md).

Precision: ``G_t - G_s`` is formed from the prefix sums kept as exact fp32 pairs (hi + lo of an
fp64 cumsum), so a pairwise decay ``e^{G_t - G_s}`` is as accurate as one ``exp`` of the segment
sum even after hundreds of log-decay units (large ``|G|``, small difference); only pairs with
``s <= t`` are exponentiated (the exponent is clamped at 0), so nothing overflows whatever the gate.

Conv, gates, ring writes and intermediate conv windows use the helpers of ``common.py``
(same roundings), so the rings and conv windows are the same bytes as the recurrent kernel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (_apply_output_gate, _carried_keys, _conv_silu, _kda_gate, _last_tile_of_head, _lazy_cursor,
                     _load_delta, _pdl_enter, _round_act, _sigmoid, _store_delta, _tf32_part)


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------

@triton.jit
def _shift_tile(tok_ptr, s_tok, offs_c, conv_base, s_row, ch, offs_t, bos, n_tok, D: tl.constexpr):
    """``x_{t-D}`` for window rows t and the given channels, fp32 ``[TD, C]``; 0 where ``t >= n_tok``.

    ``offs_c``: channel offsets inside the head (activations); ``ch``: the same channels in the
    conv state. Token ``t - D >= 0`` comes from the activations, ``t - D in [-3, -1]`` from conv
    state row ``3 + t - D`` (the previous inputs, row 0 oldest)."""
    i = offs_t - D
    live = offs_t < n_tok
    m_tok = live & (i >= 0)
    m_cv = live & (i < 0)
    xt = tl.load(tok_ptr + (bos + i).to(tl.int64)[:, None] * s_tok + offs_c[None, :], mask=m_tok[:, None], other=0.0)
    xc = tl.load(conv_base + (3 + i)[:, None] * s_row + ch[None, :], mask=m_cv[:, None], other=0.0)
    return tl.where(m_tok[:, None], xt.to(tl.float32), xc.to(tl.float32))


@triton.jit
def _prefix_sum_pair(g):
    """Inclusive prefix sum over rows of ``g [TD, C]`` as fp32 ``(hi, lo)`` with ``hi + lo`` = the
    fp64 sum: differences of ``hi`` are exact for nearby values (Sterbenz), so ``G_t - G_s`` keeps
    its accuracy when ``|G|`` is large and the difference small."""
    G = tl.cumsum(g.to(tl.float64), axis=0)
    hi = G.to(tl.float32)
    lo = (G - hi.to(tl.float64)).to(tl.float32)
    return hi, lo


@triton.jit
def _pair_sums(yq, yk, hi, lo, m_live, TP: tl.constexpr):
    """``A[t, s] = sum_c yk_t yk_s e^{G_t - G_s}`` and ``M[t, s] = sum_c yq_t yk_s e^{G_t - G_s}`` over
    the chunk's channels, for ``s <= t`` (else 0), unnormalised.

    Fast path (tensor cores): ``e^{G_t - G_s} = e^{G_t - G_m} e^{G_m - G_s}`` with ``m`` the middle
    row, when every ``|G - G_m|`` of the chunk is below 40 (factors within ``e^{+-40}``, no overflow;
    always the case for a lower-bounded gate of -5 and windows up to 16); each factor's exp carries
    a relative error of about ``|G - G_m| * 1e-7``, well inside fp32 verify accuracy (2e-7 measured
    on the H200). Otherwise the exact pairwise form, one row ``t`` per loop iteration (a
    ``[TP, C]`` tile of ``e^{G_t - G_s}``): a dynamic loop, so this rare branch costs neither code
    size nor registers on the fast path (an unrolled ``[TP, TP, C]`` form spilled at TP = 16)."""
    r = tl.arange(0, TP)
    mid = r[:, None] == (TP // 2 - 1)
    hm = tl.sum(tl.where(mid, hi, 0.0), axis=0)[None, :]
    lm = tl.sum(tl.where(mid, lo, 0.0), axis=0)[None, :]
    x = (hi - hm) + (lo - lm)
    causal = r[None, :] <= r[:, None]
    if tl.max(tl.max(tl.where(m_live, tl.abs(x), 0.0), axis=1), axis=0) < 40.0:
        right = tl.trans(yk * tl.exp(-x))  # [C, TP]
        A = tl.where(causal, tl.dot(yk * tl.exp(x), right, input_precision="tf32x3"), 0.0)
        M = tl.where(causal, tl.dot(yq * tl.exp(x), right, input_precision="tf32x3"), 0.0)
    else:
        A = tl.zeros([TP, TP], dtype=tl.float32)
        M = tl.zeros([TP, TP], dtype=tl.float32)
        for t in range(TP):
            row_t = r[:, None] == t
            hi_t = tl.sum(tl.where(row_t, hi, 0.0), axis=0)[None, :]
            lo_t = tl.sum(tl.where(row_t, lo, 0.0), axis=0)[None, :]
            d = tl.where((r <= t)[:, None], tl.exp(tl.minimum((hi_t - hi) + (lo_t - lo), 0.0)), 0.0)  # [s, C]
            yk_t = tl.sum(tl.where(row_t, yk, 0.0), axis=0)[None, :]
            yq_t = tl.sum(tl.where(row_t, yq, 0.0), axis=0)[None, :]
            A = tl.where(row_t, tl.sum(yk_t * yk * d, axis=1)[None, :], A)
            M = tl.where(row_t, tl.sum(yq_t * yk * d, axis=1)[None, :], M)
    return A, M


@triton.jit
def _window_operand(ws_rows, offs_c, row_ok, ALL_ROWS: tl.constexpr):
    """The streaming kernel's window operand rows for channels ``offs_c`` (``[ROWS, BK]``): all
    rows, or (``ALL_ROWS`` False: padded to 16-row halves) zero where not ``row_ok``."""
    if ALL_ROWS:
        wt = tl.load(ws_rows + offs_c[None, :])
    else:
        wt = tl.load(ws_rows + offs_c[None, :], mask=row_ok[:, None], other=0.0)
    return wt


@triton.jit
def _unit_lower_inverse_rows(Nm, TP: tl.constexpr):
    """``(I + Nm)^-1`` for a strictly lower-triangular ``Nm [TP, TP]`` by forward substitution
    (row t = e_t - sum_{s<t} Nm[t, s] row s): no tl.dot, so any TP >= 2 works."""
    r = tl.arange(0, TP)
    X = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for t in tl.static_range(1, TP):
        n_t = tl.sum(tl.where(r[:, None] == t, Nm, 0.0), axis=0)  # Nm[t, :]
        X = tl.where(r[:, None] == t, X - tl.sum(n_t[:, None] * X, axis=0)[None, :], X)
    return X


@triton.jit
def _mm_small(a, b, K: tl.constexpr):
    """``a [M, K] @ b [K, N]`` in fp32: tl.dot (IEEE) when K allows it, else broadcast-multiply-sum."""
    if K >= 16:
        return tl.dot(a, b, input_precision="ieee")
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _window_coupling(wp_ptr, wss_ptr, rb_row, n, h, H, scale, live, offs_t, TP: tl.constexpr, NC: tl.constexpr):
    """The window's ``T x T`` coupling of request n, head h from the prep's ``NC`` chunk partials
    (added in chunk order): ``P = M Tm`` with ``Tm = (I + diag(beta) A)^-1 diag(beta)`` and
    normalised q/k, the norms' reciprocals ``rq`` (times ``scale``) / ``rk`` (``[TP]``), and ``Tm``
    itself (the lazy ring's corrected deltas are ``U = Z Tm^T``). ``rb_row``: the window's betas."""
    tt = offs_t[:, None] * TP + offs_t[None, :]
    A_raw = tl.zeros([TP, TP], dtype=tl.float32)  # unnormalised k.k and q.k pair sums
    M_raw = tl.zeros([TP, TP], dtype=tl.float32)
    ssq_q = tl.zeros([TP], dtype=tl.float64)  # fp64 sums of squares, as common._l2norm
    ssq_k = tl.zeros([TP], dtype=tl.float64)
    for ci in tl.static_range(NC):
        nhc = ((n * H + h) * NC + ci).to(tl.int64)
        A_raw += tl.load(wp_ptr + nhc * (2 * TP * TP) + tt)
        M_raw += tl.load(wp_ptr + nhc * (2 * TP * TP) + TP * TP + tt)
        ssq_q += tl.load(wss_ptr + nhc * (2 * TP) + offs_t)
        ssq_k += tl.load(wss_ptr + nhc * (2 * TP) + TP + offs_t)
    beta = tl.load(rb_row, mask=live, other=0.0)
    rq = tl.rsqrt((ssq_q + 1e-6).to(tl.float32)) * scale
    rk = tl.rsqrt((ssq_k + 1e-6).to(tl.float32))
    lower = offs_t[:, None] > offs_t[None, :]
    diag = offs_t[:, None] == offs_t[None, :]
    Nm = tl.where(lower, A_raw * rk[:, None] * rk[None, :] * beta[:, None], 0.0)
    Mm = tl.where(lower | diag, M_raw * rq[:, None] * rk[None, :], 0.0)
    inv = _unit_lower_inverse_rows(Nm, TP)
    P = _mm_small(Mm, inv, TP) * beta[None, :]  # [t, s]
    return P, rq, rk, inv * beta[None, :]


# ----------------------------------------------------------------------------------------------
# Ring-mode verify: prep kernel (per request, head, channel chunk) + streaming kernel (per V-tile)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _conv_inputs(x_base, s_x_t, offs_c, ch, cbase, s_conv_row, offs_t, bos, n_tok, w_ptr, s_w):
    """The loads of a conv: the inputs ``x_{t-3} .. x_t`` (``[TP, C]`` fp32 each, see
    :func:`_shift_tile`) and the 4 weights (``[1, C]``) of the given channels.

    Kept apart from :func:`_conv_outputs` so that a kernel issues all its loads before its first
    store: the compiler may not move a load above a store that could alias it, and a store
    waits for the load its value comes from, so loads placed after such a store are one more
    serial memory round trip."""
    x3 = _shift_tile(x_base, s_x_t, offs_c, cbase, s_conv_row, ch, offs_t, bos, n_tok, 3)
    x2 = _shift_tile(x_base, s_x_t, offs_c, cbase, s_conv_row, ch, offs_t, bos, n_tok, 2)
    x1 = _shift_tile(x_base, s_x_t, offs_c, cbase, s_conv_row, ch, offs_t, bos, n_tok, 1)
    x0 = _shift_tile(x_base, s_x_t, offs_c, cbase, s_conv_row, ch, offs_t, bos, n_tok, 0)
    w = w_ptr + ch.to(tl.int64) * s_w
    return (x3, x2, x1, x0, tl.load(w)[None, :], tl.load(w + 1)[None, :], tl.load(w + 2)[None, :],
            tl.load(w + 3)[None, :])


@triton.jit
def _conv_outputs(x3, x2, x1, x0, w0, w1, w2, w3, ch, icw_base, s_icw_win, m_live, ACT_BF16: tl.constexpr):
    """Conv + SiLU outputs ``[TP, C]`` (fp32, rounded to the act dtype) from :func:`_conv_inputs`,
    zeros past the request; writes the conv window after each token (``x_{t-2}, x_{t-1}, x_t``)
    to the intermediate conv windows."""
    y = _round_act(_conv_silu(x3, x2, x1, x0, w0, w1, w2, w3), ACT_BF16)
    icw_ty = icw_base.dtype.element_ty
    tl.store(icw_base + ch[None, :], x2.to(icw_ty), mask=m_live)
    tl.store(icw_base + s_icw_win + ch[None, :], x1.to(icw_ty), mask=m_live)
    tl.store(icw_base + 2 * s_icw_win + ch[None, :], x0.to(icw_ty), mask=m_live)
    return y


@triton.jit(do_not_specialize=["H", "s_b_t", "s_b_h", "s_rb_slot", "s_rb_h", "s_rb_t"])
def _verify_prep_kernel(
    q_ptr, k_ptr, a_ptr, b_ptr, w_ptr, A_log_ptr, dt_bias_ptr,
    conv_ptr, slot_ptr, cu_ptr, icw_ptr, irow_ptr,
    rk_ptr, rg_ptr, rb_ptr, ws_ptr, wp_ptr, wss_ptr,
    cur_ptr, wb_ptr, wr_ptr, wc_ptr, ring_len,
    H, lower_bound,
    s_q_t, s_q_h, s_k_t, s_k_h, s_a_t, s_a_h, s_b_t, s_b_h,
    s_w, s_conv_slot, s_conv_row,
    s_icw_row, s_icw_step, s_icw_win,
    s_rk_slot, s_rk_h, s_rk_t, s_rg_slot, s_rg_h, s_rg_t, s_rb_slot, s_rb_h, s_rb_t,
    STEPS: tl.constexpr, TP: tl.constexpr, BK: tl.constexpr,
    ACT_BF16: tl.constexpr, USE_LB: tl.constexpr, USE_PDL: tl.constexpr = False,
    LAZY: tl.constexpr = False, LP: tl.constexpr = 16,
):
    """Program (n, h, c): everything of the window that does not touch the state, for the q/k
    channels of chunk ``c`` (``BK`` of them; ``NC = 128 / BK`` chunks per head).

    Writes these channels' q/k conv windows, rawk / g rings (chunk 0 also the beta ring) and, for
    the streaming kernel, ``ws[n, h, :, :, chunk] = [q o e^G ; k o e^G]`` (``[2, TP, BK]`` fp32,
    unnormalised, zero rows past the request), the chunk's unnormalised pair sums
    ``wp[n, h, c] = [A_c (TP x TP) | M_c (TP x TP)]`` and fp64 sums of squares
    ``wss[n, h, c] = [|q_t|^2 (TP) | |k_t|^2 (TP)]``, which the finish kernel (5+ tokens) or the
    streaming kernel adds up in chunk order. One program per chunk rather than per head: fewer
    registers (255 -> 96-128 per thread at 4-token windows) and shorter serial chains per program
    (H200).

    ``LAZY`` (lazy record ring): the window's records go to ring rows ``base + t`` behind the
    slot's ``p`` pending ones (``base = 0`` when the window flushes), its betas to the workspace
    ``wb[n, h]`` (the beta ring keeps the records' key-norm reciprocals), and this program also
    leaves the pending records' carried keys of its channels in ``wr[n, h, :p, chunk]`` and the
    checkpoint decay in ``wc[n, h, chunk]`` (:func:`_carried_keys`) for the streaming kernel."""
    _pdl_enter(USE_PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    ci = tl.program_id(2)
    KD: tl.constexpr = 128
    NC: tl.constexpr = KD // BK
    offs_t = tl.arange(0, TP)
    h64 = h.to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot >= 0:
        bos = tl.load(cu_ptr + n)
        n_tok = tl.minimum(tl.load(cu_ptr + n + 1) - bos, STEPS)
        live = offs_t < n_tok
        m_live = live[:, None]
        row = tl.load(irow_ptr + n).to(tl.int64)
        cbase = conv_ptr + slot * s_conv_slot
        t64 = offs_t.to(tl.int64)[:, None]
        icw_base = icw_ptr + row * s_icw_row + t64 * s_icw_step
        offs_c = ci * BK + tl.arange(0, BK)
        # every load of the program first (see _conv_inputs)
        ch_q = h * KD + offs_c
        ch_k = H * KD + h * KD + offs_c
        q3, q2, q1, q0, wq0, wq1, wq2, wq3 = _conv_inputs(q_ptr + h64 * s_q_h, s_q_t, offs_c, ch_q, cbase,
                                                          s_conv_row, offs_t, bos, n_tok, w_ptr, s_w)
        k3, k2, k1, k0, wk0, wk1, wk2, wk3 = _conv_inputs(k_ptr + h64 * s_k_h, s_k_t, offs_c, ch_k, cbase,
                                                          s_conv_row, offs_t, bos, n_tok, w_ptr, s_w)
        at = tl.load(a_ptr + h64 * s_a_h + (bos + offs_t).to(tl.int64)[:, None] * s_a_t + offs_c[None, :],
                     mask=m_live, other=0.0).to(tl.float32)
        dtb = tl.load(dt_bias_ptr + h * KD + offs_c)
        A_h = tl.exp(tl.load(A_log_ptr + h))
        b_raw = tl.load(b_ptr + (bos + offs_t).to(tl.int64) * s_b_t + h64 * s_b_h, mask=live & (ci == 0), other=0.0)
        nh = (n * H + h).to(tl.int64)
        if LAZY:
            p, flush, base = _lazy_cursor(cur_ptr, slot, ring_len, STEPS)
            carried, ckpt_decay = _carried_keys(rk_ptr + slot * s_rk_slot + h64 * s_rk_h,
                                                rg_ptr + slot * s_rg_slot + h64 * s_rg_h,
                                                rb_ptr + slot * s_rb_slot + h64 * s_rb_h,
                                                s_rk_t, s_rg_t, s_rb_t, offs_c, p, LP)
            offs_l = tl.arange(0, LP)
            tl.store(wr_ptr + nh * (LP * KD) + offs_l[:, None] * KD + offs_c[None, :], carried,
                     mask=(offs_l < p)[:, None])
            tl.store(wc_ptr + nh * KD + offs_c, ckpt_decay)
            # all of this program's reads of pending rows before a flushing window overwrites them
            tl.debug_barrier()
        else:
            base = 0
        rows_t = base + t64  # ring rows of the window's tokens

        yq = _conv_outputs(q3, q2, q1, q0, wq0, wq1, wq2, wq3, ch_q, icw_base, s_icw_win, m_live, ACT_BF16)
        yk = _conv_outputs(k3, k2, k1, k0, wk0, wk1, wk2, wk3, ch_k, icw_base, s_icw_win, m_live, ACT_BF16)
        g = tl.where(m_live, _kda_gate(at, dtb[None, :], A_h, lower_bound, USE_LB), 0.0)
        tl.store(rk_ptr + slot * s_rk_slot + h64 * s_rk_h + rows_t * s_rk_t + offs_c[None, :],
                 yk.to(rk_ptr.dtype.element_ty), mask=m_live)
        tl.store(rg_ptr + slot * s_rg_slot + h64 * s_rg_h + rows_t * s_rg_t + offs_c[None, :], g, mask=m_live)
        hi, lo = _prefix_sum_pair(g)
        A_c, M_c = _pair_sums(yq, yk, hi, lo, m_live, TP)
        eG = tl.exp(hi + lo)
        ws_tile = ws_ptr + nh * (2 * TP * KD) + offs_t[:, None] * KD + offs_c[None, :]
        tl.store(ws_tile, yq * eG)
        tl.store(ws_tile + TP * KD, yk * eG)
        nhc = ((n * H + h) * NC + ci).to(tl.int64)
        tt = offs_t[:, None] * TP + offs_t[None, :]
        tl.store(wp_ptr + nhc * (2 * TP * TP) + tt, A_c)
        tl.store(wp_ptr + nhc * (2 * TP * TP) + TP * TP + tt, M_c)
        yqd = yq.to(tl.float64)
        ykd = yk.to(tl.float64)
        tl.store(wss_ptr + nhc * (2 * TP) + offs_t, tl.sum(yqd * yqd, axis=1))
        tl.store(wss_ptr + nhc * (2 * TP) + TP + offs_t, tl.sum(ykd * ykd, axis=1))
        if ci == 0:
            if LAZY:
                tl.store(wb_ptr + nh * TP + offs_t, _sigmoid(b_raw.to(tl.float32)), mask=live)
            else:
                tl.store(rb_ptr + slot * s_rb_slot + h64 * s_rb_h + offs_t * s_rb_t, _sigmoid(b_raw.to(tl.float32)),
                         mask=live)


@triton.jit(do_not_specialize=["H", "s_rb_slot", "s_rb_h", "s_rb_t"])
def _verify_finish_kernel(slot_ptr, cu_ptr, rb_ptr, ws_ptr, wp_ptr, wss_ptr, pp_ptr, cur_ptr, wb_ptr, ring_len, H, scale,
                          s_rb_slot, s_rb_h, s_rb_t,
                          STEPS: tl.constexpr, TP: tl.constexpr, NC: tl.constexpr, USE_PDL: tl.constexpr = False,
                          LAZY: tl.constexpr = False, SPLIT_W: tl.constexpr = False):
    """Program (n, h), between prep and streaming kernel for windows of 5+ tokens: the window
    coupling ``P`` (to ``pp[n, h]``, ``[TP, TP]``) and the q-side operand
    ``W = diag(rq) Qg - P diag(rk) Kg`` (over ``ws[n, h, 0]``), so that ``O^T = S0 W^T + V^T P^T``:
    the streaming kernels then do one state product and no ``T x T`` algebra. Once per head, not
    once per V-tile, and off the streaming kernel's critical path (H200, H=32, N=256: 880 -> 760 us
    at 16-token windows).

    ``LAZY``: the betas come from the workspace ``wb``; ``pp[n, h]`` is ``[P | Tm | Tm diag(rk)]``
    (``[3, TP, TP]``: the streaming kernel's corrected deltas are ``U = V^T Tm^T - (S Kg^T) (Tm diag(rk))^T``),
    and the window's key-norm reciprocals go to the beta ring at the records' rows.

    ``SPLIT_W`` (for the Gluon streaming kernel, non-lazy): ``W`` goes out as its tf32 part
    (``ws[n, h, 0]``, low 13 mantissa bits cleared) and the rest (``ws[n, h, 1]``, over the ``Kg``
    rows, which the finished non-lazy form does not use): the operands of its 3-pass tf32 product."""
    _pdl_enter(USE_PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    KD: tl.constexpr = 128
    offs_t = tl.arange(0, TP)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot >= 0:
        bos = tl.load(cu_ptr + n)
        live = offs_t < tl.minimum(tl.load(cu_ptr + n + 1) - bos, STEPS)
        nh = (n * H + h).to(tl.int64)
        rb_slot = rb_ptr + slot * s_rb_slot + h.to(tl.int64) * s_rb_h
        rb_row = wb_ptr + nh * TP + offs_t if LAZY else rb_slot + offs_t * s_rb_t
        P, rq, rk, Tm = _window_coupling(wp_ptr, wss_ptr, rb_row, n, h, H, scale, live, offs_t, TP, NC)
        tt = offs_t[:, None] * TP + offs_t[None, :]
        if LAZY:
            pp_nh = pp_ptr + nh * (3 * TP * TP)
            tl.store(pp_nh + TP * TP + tt, Tm)
            tl.store(pp_nh + 2 * TP * TP + tt, Tm * rk[None, :])
            p, flush, base = _lazy_cursor(cur_ptr, slot, ring_len, STEPS)
            tl.store(rb_slot + (base + offs_t) * s_rb_t, rk, mask=live)
        else:
            pp_nh = pp_ptr + nh * (TP * TP)
        tl.store(pp_nh + tt, P)
        ws_q = ws_ptr + nh * (2 * TP * KD) + offs_t[:, None] * KD + tl.arange(0, KD)[None, :]
        W = tl.load(ws_q) * rq[:, None] - _mm_small(P * rk[None, :], tl.load(ws_q + TP * KD), TP)
        if SPLIT_W:
            W_hi = _tf32_part(W)
            tl.store(ws_q, W_hi)
            tl.store(ws_q + TP * KD, W - W_hi)
        else:
            tl.store(ws_q, W)


@triton.jit(do_not_specialize=["N", "T", "H", "s_rv_slot", "s_rv_h", "s_rv_t", "s_rb_slot", "s_rb_h", "s_rb_t"])
def _verify_stream_kernel(
    v_ptr, out_ptr, w_ptr, ssm_ptr, conv_ptr, slot_ptr, cu_ptr, icw_ptr, irow_ptr, rv_ptr, rb_ptr,
    ws_ptr, wp_ptr, wss_ptr, pp_ptr,
    cur_ptr, wb_ptr, wr_ptr, wc_ptr, rd_hi_ptr, rd_lo_ptr, ring_len,
    N, T, H, scale,
    s_v_t, s_v_h, s_o_t, s_o_h, s_w, s_ssm_slot, s_conv_slot, s_conv_row,
    s_icw_row, s_icw_step, s_icw_win, s_rv_slot, s_rv_h, s_rv_t, s_rb_slot, s_rb_h, s_rb_t,
    s_rd_slot, s_rd_h, s_rd_t,
    og_ptr, onw_ptr, cnt_ptr, onorm_eps, s_og_t, s_og_h,
    STEPS: tl.constexpr, TP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, NC: tl.constexpr,
    FINISHED: tl.constexpr, ACT_BF16: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr = False,
    LAZY: tl.constexpr = False, LP: tl.constexpr = 16, SPLIT_D: tl.constexpr = False, GATE: tl.constexpr = False,
):
    """Program (iv, n, h): stream the state tile ``[BV, 128]`` through ``tl.dot``, do the V-tile's
    v conv (conv windows, rawv ring) and combine.

    ``FINISHED`` (windows of 5+ tokens, after the finish kernel): one product ``S0 W^T`` and
    ``O^T = S0 W^T + V^T P^T`` with ``W`` and ``P`` from the workspace; the product is padded to 16
    window rows (``TW``) when ``TP = 8``: a 16-column product measured faster on the H200 than an
    8-column one (H=32, N=256, T=8: 423 against 525 us). Otherwise (up to 4 tokens) one product with
    ``[q o e^G ; k o e^G]`` stacked (``[2TP, BK]``), ``P`` and the norms from the prep's partials
    here, and ``O^T = S0 Qg^T rq + (V^T - S0 Kg^T rk) P^T`` (the extra finish launch cost more than
    it saved at 4-token windows: 78.8 against 76.8 us at H=32, N=64).

    The epilogue's loads come after the state loop: issuing them first (and the v conv in the prep)
    measured slower on the H200 (more registers live across the loop: 168 instead of 115 per thread
    at 4-token windows; 74.9 / 170.1 / 242.3 us against 76.6 / 142.5 / 219.6 at H=32, N=64).

    ``LAZY`` (lazy record ring): the state the window starts from is the checkpoint carried over
    the slot's ``p`` pending records, ``S = S0 o e^{G_p} + D^T Kc`` (the records' deltas ``D``, the
    prep's carried keys ``Kc``); its product with the window operand ``X`` is taken as
    ``S0 (e^{G_p} o X)^T + D^T (Kc X^T)`` (two small extra products instead of forming ``S``:
    forming it in every window cost 30-180 us more at H=32, N=64 on the H200). A flushing window
    forms ``S`` per K-chunk in its state loop instead, writes it back to the checkpoint (the only
    state write) and takes the window's product with it. The state product also gives ``S Kg^T`` (with ``FINISHED``: ``[W ; Kg]`` stacked, 2TP rows), from which the
    window's corrected deltas ``U = Z Tm^T`` (``Z = V^T - S Kg^T diag(rk)``) go to the delta ring at
    rows ``base + t``. No rawv ring is written."""
    _pdl_enter(USE_PDL)
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    KD: tl.constexpr = 128
    TW: tl.constexpr = max(TP, 16) if FINISHED else TP  # window rows of this kernel's tiles
    # Lazy 8-row windows after the finish kernel: [W ; Kg] (8 + 8 rows) fill one 16-row operand
    # instead of two halves padded to 16 each, and the product is not split (the epilogue takes
    # what it needs of it by zero rows / columns of P and Tk)
    PACKED: tl.constexpr = LAZY and FINISHED and 2 * TP == TW
    SPLIT_ACC: tl.constexpr = (LAZY or not FINISHED) and not PACKED  # [q or W ; k] rows, split after
    ROWS: tl.constexpr = 2 * TW if SPLIT_ACC else TW  # rows of the state product's operand
    ALL_ROWS: tl.constexpr = TW == TP or PACKED  # no padding rows in the operand
    offs_v = iv * BV + tl.arange(0, BV)
    offs_t = tl.arange(0, TW)
    out_ty = out_ptr.dtype.element_ty
    h64 = h.to(tl.int64)

    # Output rows no request covers ([cu_seqlens[N], T)): zero the dense positions of block n.
    cu_end = tl.load(cu_ptr + N)
    p_d = n * STEPS + offs_t
    tl.store(out_ptr + p_d.to(tl.int64)[None, :] * s_o_t + h64 * s_o_h + offs_v[:, None],
             tl.zeros([BV, TW], dtype=tl.float32).to(out_ty),
             mask=((offs_t < STEPS) & (p_d >= cu_end) & (p_d < T))[None, :])

    slot = tl.load(slot_ptr + n).to(tl.int64)
    bos = tl.load(cu_ptr + n)
    n_tok = tl.minimum(tl.load(cu_ptr + n + 1) - bos, STEPS)
    live = offs_t < n_tok
    o_ptrs = out_ptr + (bos + offs_t).to(tl.int64)[None, :] * s_o_t + h64 * s_o_h + offs_v[:, None]
    if slot < 0:
        # CUDA-graph padding: read nothing from the slot, write nothing but zeros to out.
        tl.store(o_ptrs, tl.zeros([BV, TW], dtype=tl.float32).to(out_ty), mask=live[None, :])
    else:
        nh = (n * H + h).to(tl.int64)
        s_tile = ssm_ptr + slot * s_ssm_slot + h64 * (KD * KD) + offs_v[:, None] * KD
        offs_r = tl.arange(0, ROWS)
        # operand row r: W (or q o e^G) row r for r < TW, k o e^G row r - TW after; rows past TP
        # of each half are the padding to TW (finished windows: 16-wide products)
        ws_rows = ws_ptr + nh * (2 * TP * KD) + tl.where(offs_r < TW, offs_r, TP + offs_r - TW)[:, None] * KD
        row_ok = (offs_r % TW) < TP  # (unused when ALL_ROWS)
        if LAZY:
            p, flush, base = _lazy_cursor(cur_ptr, slot, ring_len, STEPS)
            offs_l = tl.arange(0, LP)
            rd_off = slot * s_rd_slot + h64 * s_rd_h
            d_rows = rd_off + offs_l[:, None] * s_rd_t + offs_v[None, :]  # the records' deltas [LP, BV]
            wr_rows = wr_ptr + nh * (LP * KD) + offs_l[:, None] * KD
            pend = offs_l < p
        acc = tl.zeros([BV, ROWS], dtype=tl.float32)
        if LAZY:
            if flush:
                # The window does not fit behind the records: form the current state
                # S = S0 o e^{G_p} + D^T Kc chunk by chunk, write it back to the checkpoint (the
                # only state write) and take the window's product with it.
                D = _load_delta(rd_hi_ptr, rd_lo_ptr, d_rows, pend[:, None], SPLIT_D)
                for c in range(0, KD, BK):
                    offs_c = c + tl.arange(0, BK)
                    S0 = tl.load(s_tile + offs_c[None, :]) * tl.load(wc_ptr + nh * KD + offs_c)[None, :]
                    kc = tl.load(wr_rows + offs_c[None, :], mask=pend[:, None], other=0.0)
                    S0 = tl.dot(tl.trans(D), kc, S0, input_precision=DOT_PREC)
                    tl.store(s_tile + offs_c[None, :], S0)
                    acc = tl.dot(S0, tl.trans(_window_operand(ws_rows, offs_c, row_ok, ALL_ROWS)), acc,
                                 input_precision=DOT_PREC)
            else:
                # Without a flush S is not formed: S X^T = S0 (e^{G_p} o X)^T + D^T (Kc X^T), and
                # Kc X^T is a [LP, ROWS] sum over the chunks.
                kx = tl.zeros([LP, ROWS], dtype=tl.float32)
                for c in range(0, KD, BK):
                    offs_c = c + tl.arange(0, BK)
                    S0 = tl.load(s_tile + offs_c[None, :])
                    wt = _window_operand(ws_rows, offs_c, row_ok, ALL_ROWS)
                    kc = tl.load(wr_rows + offs_c[None, :], mask=pend[:, None], other=0.0)
                    kx = tl.dot(kc, tl.trans(wt), kx, input_precision=DOT_PREC)
                    acc = tl.dot(S0, tl.trans(wt * tl.load(wc_ptr + nh * KD + offs_c)[None, :]), acc,
                                 input_precision=DOT_PREC)
                D = _load_delta(rd_hi_ptr, rd_lo_ptr, d_rows, pend[:, None], SPLIT_D)
                acc = tl.dot(tl.trans(D), kx, acc, input_precision=DOT_PREC)
        else:
            for c in range(0, KD, BK):
                offs_c = c + tl.arange(0, BK)
                S0 = tl.load(s_tile + offs_c[None, :])
                acc = tl.dot(S0, tl.trans(_window_operand(ws_rows, offs_c, row_ok, ALL_ROWS)), acc,
                             input_precision=DOT_PREC)
        if not FINISHED:
            rb_row = wb_ptr + nh * TP + offs_t if LAZY else rb_ptr + slot * s_rb_slot + h64 * s_rb_h + offs_t * s_rb_t
            P, rq, rk, Tm = _window_coupling(wp_ptr, wss_ptr, rb_row, n, h, H, scale, live, offs_t, TP, NC)

        # v channels of this V-tile: conv, windows, rawv ring; all loads before the first store
        row = tl.load(irow_ptr + n).to(tl.int64)
        icw_base = icw_ptr + row * s_icw_row + offs_t.to(tl.int64)[:, None] * s_icw_step
        ch_v = 2 * H * KD + h * KD + offs_v
        v3, v2, v1, v0, wv0, wv1, wv2, wv3 = _conv_inputs(v_ptr + h64 * s_v_h, s_v_t, offs_v, ch_v,
                                                          conv_ptr + slot * s_conv_slot, s_conv_row, offs_t, bos,
                                                          n_tok, w_ptr, s_w)
        tt = offs_t[:, None] * TP + offs_t[None, :]
        if FINISHED:
            in_tp = offs_t < TP
            pp_nh = pp_ptr + nh * (3 * TP * TP if LAZY else TP * TP)
            P = tl.load(pp_nh + tt, mask=in_tp[:, None] & in_tp[None, :], other=0.0)
            if LAZY:
                Tm = tl.load(pp_nh + TP * TP + tt, mask=in_tp[:, None] & in_tp[None, :], other=0.0)
                if PACKED:  # Tk's columns moved to the product's Kg columns: acc Tk'^T = (S Kg^T) Tk^T
                    Tk = tl.load(pp_nh + 2 * TP * TP + offs_t[:, None] * TP + (offs_t - TP)[None, :],
                                 mask=in_tp[:, None] & (offs_t >= TP)[None, :], other=0.0)
                else:
                    Tk = tl.load(pp_nh + 2 * TP * TP + tt, mask=in_tp[:, None] & in_tp[None, :], other=0.0)
        yv = _conv_outputs(v3, v2, v1, v0, wv0, wv1, wv2, wv3, ch_v, icw_base, s_icw_win, live[:, None], ACT_BF16)
        if not LAZY:
            tl.store(rv_ptr + slot * s_rv_slot + h64 * s_rv_h + offs_t.to(tl.int64)[:, None] * s_rv_t
                     + offs_v[None, :], yv.to(rv_ptr.dtype.element_ty), mask=live[:, None])
        if SPLIT_ACC:
            acc_q, acc_k = tl.split(tl.permute(tl.reshape(acc, [BV, 2, TW]), [0, 2, 1]))
        else:  # PACKED: columns TP.. are S Kg^T, unused by o (stored for t < TP only) and picked by Tk
            acc_q = acc
            acc_k = acc
        if FINISHED:  # acc_q = S W^T; 16-wide products on the tensor cores (DOT_PREC): 8-wide
            # ones in registers, or IEEE fp32 ones (FMAs), were the kernel's largest cost on the
            # H200 (docs/design/alternatives-measured.md)
            o = acc_q + tl.dot(tl.trans(yv), tl.trans(P), input_precision=DOT_PREC)
            if LAZY:
                U = (tl.dot(tl.trans(yv), tl.trans(Tm), input_precision=DOT_PREC)
                     - tl.dot(acc_k, tl.trans(Tk), input_precision=DOT_PREC))
        else:
            Z = tl.trans(yv) - acc_k * rk[None, :]  # [BV, T]
            o = acc_q * rq[None, :] + _mm_small(Z, tl.trans(P), TP)
            if LAZY:
                U = _mm_small(Z, tl.trans(Tm), TP)
                tl.store(rb_ptr + slot * s_rb_slot + h64 * s_rb_h + (base + offs_t) * s_rb_t, rk,
                         mask=live & (iv == 0))
        if LAZY:
            # this program's reads of its pending records (D) before a flushing window overwrites
            # them (other programs own other V columns)
            tl.debug_barrier()
            _store_delta(rd_hi_ptr, rd_lo_ptr, rd_off + (base + offs_t)[None, :] * s_rd_t + offs_v[:, None], U,
                         live[None, :], SPLIT_D)
        tl.store(o_ptrs, _round_act(o, ACT_BF16).to(out_ty), mask=live[None, :])
        if GATE:
            # the output gate needs each row's 128 channels, spread over the head's V-tile
            # programs: the last of them to finish normalises the head's rows
            if _last_tile_of_head(cnt_ptr + n * H + h, KD // BV):
                _apply_output_gate(out_ptr + bos.to(tl.int64) * s_o_t + h64 * s_o_h, s_o_t,
                                   og_ptr + bos.to(tl.int64) * s_og_t + h64 * s_og_h, s_og_t, onw_ptr, onorm_eps,
                                   n_tok, TR=TP, ACT_BF16=ACT_BF16)


def launch_verify_ring_chunked(q, k, v, a, b, out, *, conv_weight, A_flat, dt_flat, lower_bound, scale, ssm_state,
                               conv_state, slot_indices, cu_seqlens, intermediate_conv, intermediate_rows,
                               ring_rawv, ring_rawk, ring_g, ring_beta, N, T, H, steps, act_bf16,
                               block_v=128, block_k=32, num_warps=4, num_stages=None, dot_precision="tf32x3",
                               finish=False, finish_num_warps=4, prep_block_k=32, prep_num_warps=1, pdl_kwargs=None,
                               record_cursor=None, ring_delta=None, gate=None, stream="triton"):
    """Launch the prep, (with ``finish``) finish and streaming kernels on arguments ``mtp_verify``
    has validated. ``stream="gluon"``: the streaming kernel is the Hopper Gluon kernel of
    :mod:`.mtp_verify_gluon` (needs ``finish`` and no lazy record ring).

    Workspace (allocated here, from the caching allocator: CUDA-graph capturable): ``[N, H, 2, TP, 128]``
    fp32 decayed q/k, the prep's per-chunk pair sums ``[N, H, NC, 2, TP, TP]`` fp32 and sums of squares
    ``[N, H, NC, 2, TP]`` fp64, with ``finish`` also ``P`` (``[N, H, TP, TP]`` fp32; lazy: ``[N, H, 3, TP, TP]``);
    ``TP = next_pow2(1 + num_spec)``, ``NC = 128 / prep_block_k``. Lazy record ring (``record_cursor``
    given, ``ring_delta`` a pair ``(hi, lo)``: one fp32 ring and None, or two 16-bit rings): the
    window's betas ``[N, H, TP]``, the pending records' carried keys ``[N, H, LP, 128]`` and the
    checkpoint decays ``[N, H, 128]``, fp32, ``LP = max(16, next_pow2(L))``. Output gate (``gate``:
    ``(output_gate, weight, eps, counters)``): the streaming kernel's last V-tile program of each
    (request, head) applies it."""
    rv, rk, rg, rb = ring_rawv, ring_rawk, ring_g, ring_beta
    # the Gluon stream's wgmma takes window operands of 8 rows or more
    TP = max(8 if stream == "gluon" else 2, triton.next_power_of_2(steps))
    dev = q.device
    NC = 128 // prep_block_k
    lazy = record_cursor is not None
    L = rk.shape[-2]
    LP = max(16, triton.next_power_of_2(L))
    ws = torch.empty((N, H, 2, TP, 128), dtype=torch.float32, device=dev)
    wp = torch.empty((N, H, NC, 2, TP, TP), dtype=torch.float32, device=dev)
    wss = torch.empty((N, H, NC, 2, TP), dtype=torch.float64, device=dev)
    pp = torch.empty(((N, H, 3 if lazy else 1, TP, TP) if finish else (1,)), dtype=torch.float32, device=dev)
    if lazy:
        wb = torch.empty((N, H, TP), dtype=torch.float32, device=dev)
        wr = torch.empty((N, H, LP, 128), dtype=torch.float32, device=dev)
        wc = torch.empty((N, H, 128), dtype=torch.float32, device=dev)
        rd_hi, rd_lo = ring_delta
        split_d = rd_lo is not None
        rd_lo = rd_hi if rd_lo is None else rd_lo
        cursor = record_cursor
    else:
        wb = wr = wc = rd_hi = rd_lo = ws  # placeholders, never touched
        cursor, split_d = slot_indices, False
    pdl_kw = pdl_kwargs or {}  # launch_config.pdl_kwargs(device)
    icw = intermediate_conv
    _verify_prep_kernel[(N, H, NC)](
        q, k, a, b, conv_weight, A_flat, dt_flat,
        conv_state, slot_indices, cu_seqlens, icw, intermediate_rows,
        rk, rg, rb, ws, wp, wss,
        cursor, wb, wr, wc, L,
        H, 0.0 if lower_bound is None else lower_bound,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), a.stride(1), a.stride(2), b.stride(1), b.stride(2),
        conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        icw.stride(0), icw.stride(1), icw.stride(2),
        rk.stride(0), rk.stride(1), rk.stride(2), rg.stride(0), rg.stride(1), rg.stride(2),
        rb.stride(0), rb.stride(1), rb.stride(2),
        STEPS=steps, TP=TP, BK=prep_block_k, ACT_BF16=act_bf16, USE_LB=lower_bound is not None,
        LAZY=lazy, LP=LP, num_warps=prep_num_warps, **pdl_kw,
    )
    if finish:
        _verify_finish_kernel[(N, H)](
            slot_indices, cu_seqlens, rb, ws, wp, wss, pp, cursor, wb, L, H, scale,
            rb.stride(0), rb.stride(1), rb.stride(2),
            STEPS=steps, TP=TP, NC=NC, LAZY=lazy, SPLIT_W=stream == "gluon", num_warps=finish_num_warps, **pdl_kw)
    if stream == "gluon":
        assert finish and not lazy, "the Gluon stream takes the finished, non-lazy form"
        from .mtp_verify_gluon import launch_verify_stream_gluon

        return launch_verify_stream_gluon(
            v, out, conv_weight=conv_weight, ssm_state=ssm_state, conv_state=conv_state, slot_indices=slot_indices,
            cu_seqlens=cu_seqlens, intermediate_conv=icw, intermediate_rows=intermediate_rows, ring_rawv=rv,
            ws=ws, pp=pp, N=N, T=T, H=H, steps=steps, TP=TP, act_bf16=act_bf16, gate=gate)
    if gate is not None:
        og, onw, eps, counters = gate
        gate_args = (og, onw, counters, eps, og.stride(1), og.stride(2))
    else:
        gate_args = (out, out, slot_indices, 0.0, 0, 0)  # placeholders, never touched
    kw = dict(num_warps=num_warps, **pdl_kw)
    if num_stages is not None:
        kw["num_stages"] = num_stages
    _verify_stream_kernel[(128 // block_v, N, H)](
        v, out, conv_weight, ssm_state, conv_state, slot_indices, cu_seqlens, icw, intermediate_rows, rv, rb,
        ws, wp, wss, pp,
        cursor, wb, wr, wc, rd_hi, rd_lo, L,
        N, T, H, scale,
        v.stride(1), v.stride(2), out.stride(1), out.stride(2), conv_weight.stride(0),
        ssm_state.stride(0), conv_state.stride(0), conv_state.stride(1),
        icw.stride(0), icw.stride(1), icw.stride(2),
        rv.stride(0), rv.stride(1), rv.stride(2), rb.stride(0), rb.stride(1), rb.stride(2),
        *(rd_hi.stride()[:3] if lazy else (0, 0, 0)),
        *gate_args,
        STEPS=steps, TP=TP, BV=block_v, BK=block_k, NC=NC, FINISHED=finish, ACT_BF16=act_bf16,
        DOT_PREC=dot_precision, LAZY=lazy, LP=LP, SPLIT_D=split_d, GATE=gate is not None, **kw,
    )
    return out
