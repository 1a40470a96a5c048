"""KDA decode (num_spec == 0): one token per request, conv state in place; the recurrent state
either in place (plain) or buffered in SGLang's decode ring (``--enable-linear-replayssm``).

One Triton program owns one (request, head) and loops over the V-tiles of the head itself, so
no other program ever reads a conv window this program shifts (a V-split grid would race: a
program could read a window another program already advanced). Inside the program every read
of the old conv window happens before a barrier and every write of the shifted window after it.

Buffered ("ReplaySSM decode ring", SGLang's contract): the pool's state ``S0`` is a checkpoint
``w`` tokens old, where ``w = write_pos`` (SGLang snapshots it per request for this step and
advances it afterwards: to 0 after a flush, else ``w + 1``). Ring rows ``j < w`` hold each of those
tokens' corrected delta ``d_j = beta_j (v_j - S'_j k_j)`` ``[V]``, normalised key ``k_j`` and
log-gate ``g_j`` ``[K]``, so the state before this token is, per K channel ``c``::

    S[:, c] = exp(G_w[c]) S0[:, c] + sum_j d_j exp(G_w[c] - G_{j+1}[c]) k_j[c],   G_m = sum_{i<m} g_i

(one ``[BV, LP] x [LP, K]`` ``tl.dot`` per V-tile). This token's step runs on it as in plain
decode; then either its row ``(d_w, k_w, g_w)`` is appended (nothing else written: one state read,
a few KiB written) or, at ``w == L - 1`` or a forced flush, the new state goes to the pool.

``impl="factored"`` does not form ``S`` on the steps that do not flush: the step only needs ``S``
times two vectors (after this token's decay ``e^g``), ``S x = S0 (e^G o x) + D^T (Kc x)`` with
``Kc`` the carried keys above, so each V-tile costs two row sums over the checkpoint tile and an
``[LP] x [LP, BV]`` product instead of the ``tl.dot`` over the whole tile:

    u = beta (v - S (e^g o k)),   o = S (e^g o q) + u (k . q)

(the state after the step is ``S o e^g + u k^T``). The v conv runs once per head, before the V
loop; ``beta v`` goes through this token's ring row, which each V-tile reads and overwrites with
its ``u``. A flushing step forms each state tile in the same pass (one read and one write of the
state, as in plain decode), adding the ring rows as rank-1 terms; their carried keys go over the
ring's keys first (the flush ends those rows). The ring tiles of the two products die before the
V loop and no ``tl.dot`` operand exists, so the step fits plain decode's tiles.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..settings import HEAD_DIM
from . import launch_config as LC
from . import validation as V
from .common import (_apply_output_gate, _conv_silu, _delta_step, _kda_gate, _l2norm, _load_conv_weights,
                     _load_conv_window, _pdl_enter, _round_act, _sigmoid)
from .reference import default_scale


@triton.jit
def _carried_keys(rk_base, rg_base, s_rk_l, s_rg_l, offs_l, offs_k, rows):
    """Ring rows ``j < w`` (``rows``) of one (slot, head): each row's key carried to this token,
    ``k_j o exp(G_w - G_{j+1})`` ``[LP, K]`` (0 past the cursor), and the checkpoint's decay
    ``exp(G_w)`` ``[K]`` (module docstring)."""
    ring_g = tl.load(rg_base + offs_l[:, None] * s_rg_l + offs_k[None, :], mask=rows[:, None], other=0.0)
    ring_k = tl.load(rk_base + offs_l[:, None] * s_rk_l + offs_k[None, :], mask=rows[:, None], other=0.0)
    G = tl.sum(ring_g, axis=0)
    carried_k = tl.where(rows[:, None], ring_k * tl.exp(G[None, :] - tl.cumsum(ring_g, axis=0)), 0.0)
    return carried_k, tl.exp(G)


@triton.jit
def _add_ring_rows(S, rd_base, kc_base, s_rd_l, s_kc_l, w, offs_v, offs_k):
    """``S + sum_{j < w} d_j kc_j^T`` for one ``[BV, K]`` tile: the ring rows' deltas (``rd_base``)
    times their carried keys (``kc_base``, written by this program before a barrier), one rank-1
    term per row."""
    for j in range(w):
        d = tl.load(rd_base + j * s_rd_l + offs_v)
        kc = tl.load(kc_base + j * s_kc_l + offs_k)
        S = tl.fma(d[:, None], kc[None, :], S)
    return S


@triton.jit
def _ring_state(S0, d, carried_k, checkpoint_decay, step_decay, DOT_PREC: tl.constexpr):
    """The state before this token's update, one ``[BV, K]`` tile: the checkpoint tile ``S0`` and
    the ring's deltas ``d`` ``[LP, BV]`` carried up to now, then this token's decay ``step_decay``."""
    S = tl.dot(tl.trans(d), carried_k, S0 * checkpoint_decay[None, :], input_precision=DOT_PREC)
    return S * step_decay[None, :]


@triton.jit(do_not_specialize=["H", "s_b_t", "s_b_h"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr,
    w_ptr, A_log_ptr, dt_bias_ptr,
    ssm_ptr, conv_ptr, slot_ptr,
    H, lower_bound, scale,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_a_t, s_a_h, s_b_t, s_b_h, s_o_t, s_o_h,
    s_w, s_ssm_slot, s_conv_slot, s_conv_row,
    rd_ptr, rk_ptr, rg_ptr, wp_ptr, ff_ptr, ring_len,
    s_rd_slot, s_rd_h, s_rd_l, s_rk_slot, s_rk_h, s_rk_l, s_rg_slot, s_rg_h, s_rg_l,
    og_ptr, onw_ptr, onorm_eps, s_og_t, s_og_h,
    BV: tl.constexpr, ACT_BF16: tl.constexpr, USE_LB: tl.constexpr,
    BUFFERED: tl.constexpr = False, LP: tl.constexpr = 16, HAS_FORCE_FLUSH: tl.constexpr = False,
    DOT_PREC: tl.constexpr = "tf32x3", USE_PDL: tl.constexpr = False, FACTORED: tl.constexpr = False,
    GATE: tl.constexpr = False,
):
    _pdl_enter(USE_PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    KD: tl.constexpr = 128
    NV: tl.constexpr = KD // BV
    offs_k = tl.arange(0, KD)
    out_ty = out_ptr.dtype.element_ty
    h64 = h.to(tl.int64)
    tok = n.to(tl.int64)
    o_base = out_ptr + tok * s_o_t + h64 * s_o_h

    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:
        tl.store(o_base + offs_k, tl.zeros([KD], dtype=tl.float32).to(out_ty))
    else:
        ch_q = h * KD + offs_k
        ch_k = H * KD + h * KD + offs_k
        ch_v_all = 2 * H * KD + h * KD + offs_k
        cbase = conv_ptr + slot * s_conv_slot
        # ---- reads of the old windows (all before the barrier below) ----
        q0, q1, q2 = _load_conv_window(cbase, ch_q, s_conv_row)
        k0, k1, k2 = _load_conv_window(cbase, ch_k, s_conv_row)
        v1_all = tl.load(cbase + s_conv_row + ch_v_all)
        v2_all = tl.load(cbase + 2 * s_conv_row + ch_v_all)
        xq = tl.load(q_ptr + tok * s_q_t + h64 * s_q_h + offs_k).to(tl.float32)
        xk = tl.load(k_ptr + tok * s_k_t + h64 * s_k_h + offs_k).to(tl.float32)
        xv_all = tl.load(v_ptr + tok * s_v_t + h64 * s_v_h + offs_k)

        wq0, wq1, wq2, wq3 = _load_conv_weights(w_ptr, ch_q, s_w)
        wk0, wk1, wk2, wk3 = _load_conv_weights(w_ptr, ch_k, s_w)
        yq = _round_act(_conv_silu(q0, q1, q2, xq, wq0, wq1, wq2, wq3), ACT_BF16)
        yk = _round_act(_conv_silu(k0, k1, k2, xk, wk0, wk1, wk2, wk3), ACT_BF16)
        qn = _l2norm(yq) * scale
        kn = _l2norm(yk)

        A = tl.exp(tl.load(A_log_ptr + h))
        dtb = tl.load(dt_bias_ptr + h * KD + offs_k)
        a_t = tl.load(a_ptr + tok * s_a_t + h64 * s_a_h + offs_k).to(tl.float32)
        g = _kda_gate(a_t, dtb, A, lower_bound, USE_LB)
        beta = _sigmoid(tl.load(b_ptr + tok * s_b_t + h64 * s_b_h).to(tl.float32))

        s_base = ssm_ptr + slot * s_ssm_slot + h64 * (KD * KD)
        if BUFFERED:
            # Ring rows j < w of this (slot, head), rows >= w masked to 0, and the decays that
            # carry each row and the checkpoint up to this token (module docstring).
            w = tl.load(wp_ptr + n)
            flush = w == ring_len - 1
            if HAS_FORCE_FLUSH:
                flush = flush | (tl.load(ff_ptr + n) != 0)
            offs_l = tl.arange(0, LP)
            rows = offs_l < w
            rd_base = rd_ptr + slot * s_rd_slot + h64 * s_rd_h
            rk_base = rk_ptr + slot * s_rk_slot + h64 * s_rk_h
            rg_base = rg_ptr + slot * s_rg_slot + h64 * s_rg_h
            step_decay = tl.exp(g)
            carried_k, checkpoint_decay = _carried_keys(rk_base, rg_base, s_rk_l, s_rg_l, offs_l, offs_k, rows)
            if FACTORED:  # S x = S0 (e^G o x) + D^T (Kc x) for x = e^g o k and e^g o q
                k_dec = kn * step_decay
                q_dec = qn * step_decay
                k_rows = tl.sum(carried_k * k_dec[None, :], axis=1)
                q_rows = tl.sum(carried_k * q_dec[None, :], axis=1)
                k_ckpt = k_dec * checkpoint_decay
                q_ckpt = q_dec * checkpoint_decay
                kq = tl.sum(kn * qn)
                total_decay = checkpoint_decay * step_decay  # of the checkpoint, at a flush
                # u = beta v - beta S (e^g o k): beta goes into the key products, and beta v of
                # the whole head (its conv, once) into this token's ring row, which the V loop
                # reads tile by tile and overwrites with u (one load per tile instead of the
                # conv's nine)
                kb_ckpt = k_ckpt * beta
                kb_rows = k_rows * beta
                v0_all = tl.load(cbase + ch_v_all).to(tl.float32)
                wv0, wv1, wv2, wv3 = _load_conv_weights(w_ptr, ch_v_all, s_w)
                yv_all = _round_act(_conv_silu(v0_all, v1_all.to(tl.float32), v2_all.to(tl.float32),
                                               xv_all.to(tl.float32), wv0, wv1, wv2, wv3), ACT_BF16)
                tl.store(rd_base + w * s_rd_l + offs_k, beta * yv_all)
                if flush:
                    # The flush forms each state tile, which needs every row's key carried past
                    # this token's decay: they go over the ring's keys (rows < w die with the
                    # flush, which resets the cursor to 0), read back after the barrier.
                    tl.store(rk_base + offs_l[:, None] * s_rk_l + offs_k[None, :],
                             carried_k * step_decay[None, :], mask=rows[:, None])
                tl.debug_barrier()
        for iv in range(NV):
            offs_v = iv * BV + tl.arange(0, BV)
            s_ptrs = s_base + offs_v[:, None] * KD + offs_k[None, :]
            if BUFFERED:
                d_ptrs = rd_base + offs_l[:, None] * s_rd_l + offs_v[None, :]  # [LP, BV]: rows < w
            if BUFFERED and FACTORED:
                S0 = tl.load(s_ptrs)
                d = tl.load(d_ptrs, mask=rows[:, None], other=0.0)
                bv_ = tl.load(rd_base + w * s_rd_l + offs_v)  # beta v (prologue)
                u = bv_ - tl.sum(S0 * kb_ckpt[None, :], axis=1) - tl.sum(d * kb_rows[:, None], axis=0)
                o = tl.sum(S0 * q_ckpt[None, :], axis=1) + tl.sum(d * q_rows[:, None], axis=0) + u * kq
                if flush:  # the state after this token, formed: one rank-1 term per ring row
                    # (the tile read again, from cache: S0 kept live to here costs every step registers)
                    S = _add_ring_rows(tl.load(s_ptrs) * total_decay[None, :], rd_base, rk_base, s_rd_l, s_rk_l, w,
                                       offs_v, offs_k)
                    tl.store(s_ptrs, tl.fma(u[:, None], kn[None, :], S))
                else:
                    tl.debug_barrier()  # every thread has read its beta v before u replaces it
                    tl.store(rd_base + w * s_rd_l + offs_v, u)
            else:
                ch_v = 2 * H * KD + h * KD + offs_v
                v0, v1, v2 = _load_conv_window(cbase, ch_v, s_conv_row)
                xv = tl.load(v_ptr + tok * s_v_t + h64 * s_v_h + offs_v).to(tl.float32)
                wv0, wv1, wv2, wv3 = _load_conv_weights(w_ptr, ch_v, s_w)
                yv = _round_act(_conv_silu(v0, v1, v2, xv, wv0, wv1, wv2, wv3), ACT_BF16)
            if BUFFERED and not FACTORED:
                S = _ring_state(tl.load(s_ptrs), tl.load(d_ptrs, mask=rows[:, None], other=0.0), carried_k,
                                checkpoint_decay, step_decay, DOT_PREC)
                # the step of _delta_step, keeping its corrected delta u for the ring
                u = beta * (yv - tl.sum(S * kn[None, :], axis=1))
                S = tl.fma(u[:, None], kn[None, :], S)
                if flush:
                    tl.store(s_ptrs, S)
                else:
                    tl.store(rd_base + w * s_rd_l + offs_v, u)
                o = tl.sum(S * qn[None, :], axis=1)
            if not BUFFERED:
                S = _delta_step(tl.load(s_ptrs), kn, g, beta, yv)
                tl.store(s_ptrs, S)
                o = tl.sum(S * qn[None, :], axis=1)
            tl.store(o_base + offs_v, _round_act(o, ACT_BF16).to(out_ty))
        if GATE:
            # the output gate over the whole head: this program's V-tiles, read back (other threads
            # stored them)
            tl.debug_barrier()
            _apply_output_gate(o_base, 0, og_ptr + tok * s_og_t + h64 * s_og_h, 0, onw_ptr, onorm_eps, 1,
                               TR=2, ACT_BF16=ACT_BF16)
        if BUFFERED:
            if not flush:
                tl.store(rk_base + w * s_rk_l + offs_k, kn)
                tl.store(rg_base + w * s_rg_l + offs_k, g)

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


def decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float],
    ssm_state: torch.Tensor, conv_state: torch.Tensor, slot_indices: torch.Tensor,
    scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
    ring_d: Optional[torch.Tensor] = None, ring_k: Optional[torch.Tensor] = None,
    ring_g: Optional[torch.Tensor] = None, write_pos: Optional[torch.Tensor] = None,
    force_flush: Optional[torch.Tensor] = None,
    block_v: Optional[int] = None, num_warps: Optional[int] = None,
    impl: Optional[str] = None, dot_precision: str = "tf32x3",
    output_gate: Optional[torch.Tensor] = None, output_norm_weight: Optional[torch.Tensor] = None,
    output_norm_eps: Optional[float] = None,
) -> torch.Tensor:
    """KDA decode step for B requests of one token each; updates the conv state in place and the
    recurrent state in place (plain) or through SGLang's decode ring (buffered: the rings given).

    Parameters
    ----------
    q, k, v : torch.Tensor
        Pre-conv raw inputs ``[1, B, H, 128]``, bf16 / fp32 (one activation dtype), last dim
        contiguous, token/head strides free (views of SGLang's ``mixed_qkv [B, 3*H*128]`` work).
    a : torch.Tensor
        Raw forget-gate input ``[1, B, H, 128]`` (SGLang's 2-D ``[B, H*128]`` -> ``a.view(1, B, H, 128)``).
    b : torch.Tensor
        Raw beta logits ``[1, B, H]``.
    conv_weight, A_log, dt_bias, lower_bound, scale :
        As in :func:`mtp_verify` (``[D, 4]`` fp32, ``H`` fp32, ``H*128`` fp32, float or None, float).
    ssm_state : torch.Tensor
        ``[slots, H, 128 (V), 128 (K)]`` fp32, per-slot block contiguous. Updated in place.
    conv_state : torch.Tensor
        ``[slots, 3, D]`` activation dtype, D contiguous, row 0 oldest. Shifted in place.
    slot_indices : torch.Tensor
        ``[B]`` int32; ``-1`` = padding: state and conv untouched, output row zero.
    out : torch.Tensor, optional
        ``[1, B, H, 128]`` activation dtype, last dim contiguous; allocated when None.
    ring_d, ring_k, ring_g : torch.Tensor, optional
        Buffered decode (``--enable-linear-replayssm``): the layer's decode rings
        ``[slots, H, L, 128]`` fp32 (SGLang's ``replayssm_d`` / ``replayssm_k`` / ``replayssm_g``):
        per ring row, corrected delta ``d`` (over V), normalised key and log-gate (over K). Rows
        ``< write_pos`` are read; row ``write_pos`` is written unless this step flushes (the
        factored step also uses row ``write_pos`` and, at a flush, the key rows before it as
        scratch: SGLang reads no row at or past the cursor, which a flush resets to 0).
    write_pos : torch.Tensor, optional
        ``[B]`` int32, SGLang's per-request snapshot of the ring cursor for this step (rows
        already buffered, ``0 .. L-1``); ``ssm_state[slot]`` is that many tokens old. At
        ``write_pos == L - 1`` the step flushes: the new state goes to ``ssm_state``.
    force_flush : torch.Tensor, optional
        ``[B]`` int32, nonzero = flush this step whatever ``write_pos`` (SGLang's radix track).
    block_v, num_warps : int, optional
        Tuning knobs (defaults from :mod:`.launch_config`, keyed on H and N): V-tile rows per loop
        step (power of two dividing 128; 128 = the whole state tile at once; >= 16 when buffered)
        and warps.
    impl : str, optional
        ``None`` / ``"auto"`` / ``"rows"``: the recurrent ``[block_v, 128]`` kernel, which forms the
        state every step. ``"factored"`` (buffered only; the backend's default in SGLang's decode
        ring, ``settings.buffered_decode_impl``): between flushes, the step's two products with the
        state from the checkpoint and the ring rows, without forming it (module docstring).
    dot_precision : str
        ``tl.dot`` precision of the buffered state reconstruction (``"tf32x3"``: about fp32;
        ``"ieee"``).
    output_gate, output_norm_weight, output_norm_eps : optional, all or none
        Kimi-K3's output gate, fused: each output row (rounded to the activation dtype) becomes
        ``o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate)`` (the model's ``o_norm``,
        ``FusedRMSNormGated`` with the sigmoid gate). ``output_gate`` ``[1, B, H, 128]`` bf16 /
        fp32, last dim contiguous (a view of the model's gate projection); ``output_norm_weight``
        ``[128]`` fp32 or bf16; ``output_norm_eps`` a Python float.

    Returns
    -------
    torch.Tensor
        ``out`` ``[1, B, H, 128]``.

    Grid ``(B, H)``; each program loops over ``128 // block_v`` V-tiles of its head.
    """
    T, H, act = V.check_activations([("q", q, True), ("k", k, True), ("v", v, True), ("a", a, False)])
    dev = q.device
    V.check_beta(b, T, H)
    B = V.check_index("slot_indices", slot_indices, None, what="slot per request, -1 = padding")
    if T != B:
        raise V.dspark_error(
            V.E_TOKENS, "T (tokens of q)", expected=f"T == B = {B} (one token per request in decode)",
            got=f"T = {T}", fix="use mtp_verify for windows of several tokens per request",
        )
    V.check_conv_weight(conv_weight, H)
    A_flat, dt_flat = V.check_gate_params(A_log, dt_bias, H)
    lower_bound = V.check_scalar("lower_bound", lower_bound, allow_none=True)
    scale = default_scale() if scale is None else V.check_scalar("scale", scale, allow_none=False)
    V.check_ssm_state("ssm_state", ssm_state, H, layered=False)
    V.check_conv_state("conv_state", conv_state, H, act, layered=False)
    if out is None:
        out = torch.empty((1, T, H, HEAD_DIM), dtype=act, device=dev)
    else:
        V.check_out(out, T, H, act)
    L = V.check_decode_ring(ring_d, ring_k, ring_g, write_pos, H, ssm_state.shape[0], B)
    if L and force_flush is not None:
        V.check_index("force_flush", force_flush, B, what="nonzero = flush this step")
    buffered = dict(ring_d=ring_d, ring_k=ring_k, ring_g=ring_g, write_pos=write_pos) if L else {}
    gate = V.check_output_gate(output_gate, output_norm_weight, output_norm_eps, None, T, H, None)
    V.check_device(dev, k=k, v=v, a=a, b=b, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias,
                   ssm_state=ssm_state, conv_state=conv_state, slot_indices=slot_indices, out=out,
                   output_gate=output_gate, output_norm_weight=output_norm_weight, **buffered)
    factored = impl == "factored"
    cfg = LC.decode(H, B, buffered=bool(L), factored=factored)
    BV = V.check_block_v(block_v if block_v is not None else cfg["block_v"])
    if L and BV < 16:
        raise V.dspark_error(V.E_BLOCK_V, "block_v", expected="block_v >= 16 in buffered decode (tl.dot tile)",
                             got=f"block_v = {BV}", fix="leave block_v=None")
    warps = num_warps or cfg["num_warps"]
    V.check_impl(impl, (None, "auto", "rows", "factored"))
    if factored and not L:
        raise V.dspark_error(V.E_IMPL, "impl", expected="impl='factored' only with the decode ring (ring_d, ...)",
                             got="impl='factored' without rings", fix="leave impl=None for plain decode")
    if B == 0:
        return out
    rings = (ring_d, ring_k, ring_g) if L else (ssm_state,) * 3  # unread when plain
    ring_strides = [st for r in rings for st in r.stride()[:3]]
    if gate is not None:
        gate_args = (output_gate, output_norm_weight, gate[0], output_gate.stride(1), output_gate.stride(2))
    else:
        gate_args = (out, out, 0.0, 0, 0)  # placeholders, never touched
    _decode_kernel[(B, H)](
        q, k, v, a, b, out,
        conv_weight, A_flat, dt_flat,
        ssm_state, conv_state, slot_indices,
        H, 0.0 if lower_bound is None else lower_bound, scale,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        a.stride(1), a.stride(2), b.stride(1), b.stride(2), out.stride(1), out.stride(2),
        conv_weight.stride(0), ssm_state.stride(0), conv_state.stride(0), conv_state.stride(1),
        *rings, write_pos if L else slot_indices, force_flush if force_flush is not None else slot_indices,
        L, *ring_strides,
        *gate_args,
        BV=BV, ACT_BF16=act == torch.bfloat16, USE_LB=lower_bound is not None,
        BUFFERED=bool(L), LP=max(16, triton.next_power_of_2(max(L, 1))),
        HAS_FORCE_FLUSH=bool(L) and force_flush is not None, DOT_PREC=dot_precision, FACTORED=factored,
        GATE=gate is not None, num_warps=warps, **LC.pdl_kwargs(dev),
    )
    return out
