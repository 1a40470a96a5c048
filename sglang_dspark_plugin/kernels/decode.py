"""Plain KDA decode (num_spec == 0): one token per request, conv and recurrent state in place.

One Triton program owns one (request, head) and loops over the V-tiles of the head itself, so
no other program ever reads a conv window this program shifts (a V-split grid would race: a
program could read a window another program already advanced). Inside the program every read
of the old conv window happens before a barrier and every write of the shifted window after it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..settings import HEAD_DIM
from . import launch_config as LC
from . import validation as V
from .common import (_conv_silu, _delta_step, _kda_gate, _l2norm, _load_conv_weights, _load_conv_window,
                     _pdl_enter, _round_act, _sigmoid)
from .reference import default_scale


@triton.jit(do_not_specialize=["H", "s_b_t", "s_b_h"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr,
    w_ptr, A_log_ptr, dt_bias_ptr,
    ssm_ptr, conv_ptr, slot_ptr,
    H, lower_bound, scale,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_a_t, s_a_h, s_b_t, s_b_h, s_o_t, s_o_h,
    s_w, s_ssm_slot, s_conv_slot, s_conv_row,
    BV: tl.constexpr, ACT_BF16: tl.constexpr, USE_LB: tl.constexpr, USE_PDL: tl.constexpr = False,
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
        for iv in range(NV):
            offs_v = iv * BV + tl.arange(0, BV)
            ch_v = 2 * H * KD + h * KD + offs_v
            v0, v1, v2 = _load_conv_window(cbase, ch_v, s_conv_row)
            xv = tl.load(v_ptr + tok * s_v_t + h64 * s_v_h + offs_v).to(tl.float32)
            wv0, wv1, wv2, wv3 = _load_conv_weights(w_ptr, ch_v, s_w)
            yv = _round_act(_conv_silu(v0, v1, v2, xv, wv0, wv1, wv2, wv3), ACT_BF16)

            s_ptrs = s_base + offs_v[:, None] * KD + offs_k[None, :]
            S = _delta_step(tl.load(s_ptrs), kn, g, beta, yv)
            tl.store(s_ptrs, S)
            o = tl.sum(S * qn[None, :], axis=1)
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


def decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float],
    ssm_state: torch.Tensor, conv_state: torch.Tensor, slot_indices: torch.Tensor,
    scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
    block_v: Optional[int] = None, num_warps: Optional[int] = None,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """KDA decode step for B requests of one token each; updates conv and recurrent state in place.

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
    block_v, num_warps : int, optional
        Tuning knobs (defaults from :mod:`.launch_config`, keyed on H and N): V-tile rows per loop
        step (power of two dividing 128; 128 = the whole state tile at once) and warps.
    impl : str, optional
        ``None`` / ``"auto"`` / ``"rows"``: the recurrent ``[block_v, 128]`` kernel (the only one).

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
    V.check_device(dev, k=k, v=v, a=a, b=b, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias,
                   ssm_state=ssm_state, conv_state=conv_state, slot_indices=slot_indices, out=out)
    cfg = LC.decode(H, B)
    BV = V.check_block_v(block_v if block_v is not None else cfg["block_v"])
    warps = num_warps or cfg["num_warps"]
    V.check_impl(impl, (None, "auto", "rows"))
    if B == 0:
        return out
    _decode_kernel[(B, H)](
        q, k, v, a, b, out,
        conv_weight, A_flat, dt_flat,
        ssm_state, conv_state, slot_indices,
        H, 0.0 if lower_bound is None else lower_bound, scale,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        a.stride(1), a.stride(2), b.stride(1), b.stride(2), out.stride(1), out.stride(2),
        conv_weight.stride(0), ssm_state.stride(0), conv_state.stride(0), conv_state.stride(1),
        BV=BV, ACT_BF16=act == torch.bfloat16, USE_LB=lower_bound is not None,
        num_warps=warps, **LC.pdl_kwargs(dev),
    )
    return out
