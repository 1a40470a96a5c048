"""MTP (speculative) verify for KDA: conv + gates + delta rule over a 1+num_spec token window.

One Triton program owns one (request, head, V-tile). It reads the persistent recurrent state tile
``[BV, 128]`` once, keeps it in registers across the window's steps and never writes it back
(verify is read-only on ``ssm_state`` and ``conv_state``). Per step it writes the conv window
after the token (both modes) and either the state after the step (snapshot mode) or the
ReplaySSM rings (ring mode), so the commit can pick the accepted prefix later.

The ``@triton.jit`` helpers of ``common.py`` are shared with the other kernels, so that they all
perform the same floating-point operations in the same order (the recurrent fold reproduces
snapshot mode bit for bit under the same compiler). Ring mode defaults to the chunked kernel of
``mtp_verify_chunked.py`` where the launch table says it is faster.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..settings import HEAD_DIM
from . import launch_config as LC
from . import validation as V
from .common import (_apply_output_gate, _conv_silu, _delta_step, _kda_gate, _l2norm, _last_tile_of_head,
                     _load_conv_weights, _load_conv_window, _pdl_enter, _round_act, _sigmoid)
from .mtp_verify_chunked import launch_verify_ring_chunked
from .mtp_verify_gluon import gluon_verify_supported
from .reference import default_scale


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

# Scalars that vary per batch (N, T) or only feed scalar loads are not specialised, so one compile
# serves every batch size / head count for a given (num_spec, dtype, gate, mode).
@triton.jit(do_not_specialize=["N", "T", "H", "s_b_t", "s_b_h", "s_rb_slot", "s_rb_h", "s_rb_t"])
def _mtp_verify_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, out_ptr,
    w_ptr, A_log_ptr, dt_bias_ptr,
    ssm_ptr, conv_ptr, slot_ptr, cu_ptr,
    icw_ptr, irow_ptr, issm_ptr,
    rv_ptr, rk_ptr, rg_ptr, rb_ptr,
    N, T, H, lower_bound, scale,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_a_t, s_a_h, s_b_t, s_b_h, s_o_t, s_o_h,
    s_w,
    s_ssm_slot, s_conv_slot, s_conv_row,
    s_icw_row, s_icw_step, s_icw_win,
    s_issm_row, s_issm_step,
    s_rv_slot, s_rv_h, s_rv_t, s_rk_slot, s_rk_h, s_rk_t,
    s_rg_slot, s_rg_h, s_rg_t, s_rb_slot, s_rb_h, s_rb_t,
    og_ptr, onw_ptr, cnt_ptr, onorm_eps, s_og_t, s_og_h,
    STEPS: tl.constexpr, BV: tl.constexpr, ACT_BF16: tl.constexpr,
    USE_LB: tl.constexpr, SNAPSHOT: tl.constexpr, RING: tl.constexpr, USE_PDL: tl.constexpr = False,
    GATE: tl.constexpr = False, TP: tl.constexpr = 2,
):
    _pdl_enter(USE_PDL)
    iv = tl.program_id(0)
    n = tl.program_id(1)
    h = tl.program_id(2)
    KD: tl.constexpr = 128
    offs_k = tl.arange(0, KD)
    offs_v = iv * BV + tl.arange(0, BV)
    out_ty = out_ptr.dtype.element_ty
    h64 = h.to(tl.int64)

    # Output rows no request covers ([cu_seqlens[N], T)): zero the dense positions of block n.
    cu_end = tl.load(cu_ptr + N)
    for j in tl.static_range(STEPS):
        p = n * STEPS + j
        tl.store(out_ptr + p.to(tl.int64) * s_o_t + h64 * s_o_h + offs_v,
                 tl.zeros([BV], dtype=tl.float32).to(out_ty),
                 mask=(offs_v < KD) & (p >= cu_end) & (p < T))

    slot = tl.load(slot_ptr + n).to(tl.int64)
    bos = tl.load(cu_ptr + n)
    n_tok = tl.minimum(tl.load(cu_ptr + n + 1) - bos, STEPS)

    if slot < 0:
        # CUDA-graph padding: read nothing from the slot, write nothing but zeros to out.
        for t in range(n_tok):
            tl.store(out_ptr + (bos + t).to(tl.int64) * s_o_t + h64 * s_o_h + offs_v,
                     tl.zeros([BV], dtype=tl.float32).to(out_ty))
    else:
        row = tl.load(irow_ptr + n).to(tl.int64)
        is_v0 = iv == 0
        ch_q = h * KD + offs_k
        ch_k = H * KD + h * KD + offs_k
        ch_v = 2 * H * KD + h * KD + offs_v

        # Conv windows (3 previous inputs, row 0 oldest) of this head's q, k and V-tile channels.
        cbase = conv_ptr + slot * s_conv_slot
        q0, q1, q2 = _load_conv_window(cbase, ch_q, s_conv_row)
        k0, k1, k2 = _load_conv_window(cbase, ch_k, s_conv_row)
        v0, v1, v2 = _load_conv_window(cbase, ch_v, s_conv_row)
        wq0, wq1, wq2, wq3 = _load_conv_weights(w_ptr, ch_q, s_w)
        wk0, wk1, wk2, wk3 = _load_conv_weights(w_ptr, ch_k, s_w)
        wv0, wv1, wv2, wv3 = _load_conv_weights(w_ptr, ch_v, s_w)

        A = tl.exp(tl.load(A_log_ptr + h))
        dtb = tl.load(dt_bias_ptr + h * KD + offs_k)

        # The state tile, read once and kept in registers for the whole window.
        S = tl.load(ssm_ptr + slot * s_ssm_slot + h64 * (KD * KD)
                    + offs_v[:, None] * KD + offs_k[None, :])

        icw_base = icw_ptr + row * s_icw_row
        # The inputs of token t + 1 are loaded while token t is computed (software prefetch): the
        # loads leave the per-token latency chain, which the state recurrence makes serial.
        q_base = q_ptr + h64 * s_q_h
        k_base = k_ptr + h64 * s_k_h
        v_base = v_ptr + h64 * s_v_h
        a_base = a_ptr + h64 * s_a_h
        b_base = b_ptr + h64 * s_b_h
        m_k = (offs_k < KD) & (n_tok > 0)
        m_v = (offs_v < KD) & (n_tok > 0)
        tok0 = bos.to(tl.int64)
        xq_nx = tl.load(q_base + tok0 * s_q_t + offs_k, mask=m_k, other=0.0)
        xk_nx = tl.load(k_base + tok0 * s_k_t + offs_k, mask=m_k, other=0.0)
        xv_nx = tl.load(v_base + tok0 * s_v_t + offs_v, mask=m_v, other=0.0)
        a_nx = tl.load(a_base + tok0 * s_a_t + offs_k, mask=m_k, other=0.0)
        b_nx = tl.load(b_base + tok0 * s_b_t, mask=n_tok > 0, other=0.0)
        for t in range(n_tok):
            tok = (bos + t).to(tl.int64)
            xq = xq_nx.to(tl.float32)
            xk = xk_nx.to(tl.float32)
            xv = xv_nx.to(tl.float32)
            a_t = a_nx.to(tl.float32)
            b_t = b_nx.to(tl.float32)
            nx = tok + 1
            more = t + 1 < n_tok
            xq_nx = tl.load(q_base + nx * s_q_t + offs_k, mask=more & (offs_k < KD), other=0.0)
            xk_nx = tl.load(k_base + nx * s_k_t + offs_k, mask=more & (offs_k < KD), other=0.0)
            xv_nx = tl.load(v_base + nx * s_v_t + offs_v, mask=more & (offs_v < KD), other=0.0)
            a_nx = tl.load(a_base + nx * s_a_t + offs_k, mask=more & (offs_k < KD), other=0.0)
            b_nx = tl.load(b_base + nx * s_b_t, mask=more, other=0.0)
            # conv + SiLU, rounded to the activation dtype as SGLang does
            yq = _round_act(_conv_silu(q0, q1, q2, xq, wq0, wq1, wq2, wq3), ACT_BF16)
            yk = _round_act(_conv_silu(k0, k1, k2, xk, wk0, wk1, wk2, wk3), ACT_BF16)
            yv = _round_act(_conv_silu(v0, v1, v2, xv, wv0, wv1, wv2, wv3), ACT_BF16)
            q0, q1, q2 = q1, q2, xq
            k0, k1, k2 = k1, k2, xk
            v0, v1, v2 = v1, v2, xv

            # conv window after this token -> intermediate_conv[row, t]
            ic = icw_base + t * s_icw_step
            icw_ty = icw_ptr.dtype.element_ty
            m_qk = (offs_k < KD) & is_v0
            tl.store(ic + ch_q, q0.to(icw_ty), mask=m_qk)
            tl.store(ic + s_icw_win + ch_q, q1.to(icw_ty), mask=m_qk)
            tl.store(ic + 2 * s_icw_win + ch_q, q2.to(icw_ty), mask=m_qk)
            tl.store(ic + ch_k, k0.to(icw_ty), mask=m_qk)
            tl.store(ic + s_icw_win + ch_k, k1.to(icw_ty), mask=m_qk)
            tl.store(ic + 2 * s_icw_win + ch_k, k2.to(icw_ty), mask=m_qk)
            tl.store(ic + ch_v, v0.to(icw_ty))
            tl.store(ic + s_icw_win + ch_v, v1.to(icw_ty))
            tl.store(ic + 2 * s_icw_win + ch_v, v2.to(icw_ty))

            # gates
            g = _kda_gate(a_t, dtb, A, lower_bound, USE_LB)
            beta = _sigmoid(b_t)
            qn = _l2norm(yq) * scale
            kn = _l2norm(yk)

            if RING:
                tl.store(rv_ptr + slot * s_rv_slot + h64 * s_rv_h + t * s_rv_t + offs_v,
                         yv.to(rv_ptr.dtype.element_ty))
                tl.store(rk_ptr + slot * s_rk_slot + h64 * s_rk_h + t * s_rk_t + offs_k,
                         yk.to(rk_ptr.dtype.element_ty), mask=m_qk)
                tl.store(rg_ptr + slot * s_rg_slot + h64 * s_rg_h + t * s_rg_t + offs_k, g, mask=m_qk)
                tl.store(rb_ptr + slot * s_rb_slot + h64 * s_rb_h + t * s_rb_t, beta, mask=is_v0)

            S = _delta_step(S, kn, g, beta, yv)
            o = tl.sum(S * qn[None, :], axis=1)
            tl.store(out_ptr + tok * s_o_t + h64 * s_o_h + offs_v, _round_act(o, ACT_BF16).to(out_ty))
            if SNAPSHOT:
                tl.store(issm_ptr + row * s_issm_row + t * s_issm_step + h64 * (KD * KD)
                         + offs_v[:, None] * KD + offs_k[None, :], S)
        if GATE:
            # The output gate normalises each output row over all 128 channels, which the
            # head's 128 // BV V-tile programs hold between them: the last to finish applies it.
            NVT: tl.constexpr = KD // BV
            if _last_tile_of_head(cnt_ptr + n * H + h, NVT):
                _apply_output_gate(out_ptr + bos.to(tl.int64) * s_o_t + h64 * s_o_h, s_o_t,
                                   og_ptr + bos.to(tl.int64) * s_og_t + h64 * s_og_h, s_og_t, onw_ptr, onorm_eps,
                                   n_tok, TR=TP, ACT_BF16=ACT_BF16)


# ----------------------------------------------------------------------------------------------
# Wrapper: validate -> plan -> launch (the three stages follow it)
# ----------------------------------------------------------------------------------------------

def mtp_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: Optional[float],
    ssm_state: torch.Tensor, conv_state: torch.Tensor,
    slot_indices: torch.Tensor, cu_seqlens: torch.Tensor, num_spec: int,
    intermediate_conv: torch.Tensor, intermediate_rows: torch.Tensor,
    intermediate_ssm: Optional[torch.Tensor] = None,
    ring_rawv: Optional[torch.Tensor] = None, ring_rawk: Optional[torch.Tensor] = None,
    ring_g: Optional[torch.Tensor] = None, ring_beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
    block_v: Optional[int] = None, num_warps: Optional[int] = None,
    block_k: Optional[int] = None, num_stages: Optional[int] = None,
    dot_precision: Optional[str] = None, impl: Optional[str] = None,
    prep_block_k: Optional[int] = None, prep_num_warps: Optional[int] = None,
    finish: Optional[bool] = None,
    record_cursor: Optional[torch.Tensor] = None, ring_delta=None,
    output_gate: Optional[torch.Tensor] = None, output_norm_weight: Optional[torch.Tensor] = None,
    output_norm_eps: Optional[float] = None, output_gate_workspace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """KDA speculative verify of N requests x (1 + num_spec) tokens; state and conv are read-only
    (except the lazy record ring's flush, which writes the state: ``record_cursor``).

    Each request n owns tokens ``[cu_seqlens[n], cu_seqlens[n+1])`` (at most ``1 + num_spec``;
    shorter requests are fine, steps past their length are neither computed nor written) and
    starts from ``ssm_state[slot_indices[n]]`` / ``conv_state[slot_indices[n]]``. No host sync.

    Parameters
    ----------
    q, k, v : torch.Tensor
        Pre-conv raw inputs, shape ``[1, T, H, 128]``, dtype bf16 / fp32 (all three the same:
        the activation dtype). Last dim contiguous; head and token strides are free, so the three
        channel groups of SGLang's ``mixed_qkv [T, 3*H*128]`` can be passed as views
        (``mixed_qkv[:, :H*128].view(1, T, H, 128)`` etc.). ``T == N * (1 + num_spec)``.
    a : torch.Tensor
        Raw forget-gate input, ``[1, T, H, 128]``, bf16 / fp32, last dim contiguous.
    b : torch.Tensor
        Raw beta logits, ``[1, T, H]``, bf16 / fp32 (any strides).
    conv_weight : torch.Tensor
        ``[D, 4]`` fp32, ``D = 3*H*128`` channels ``[q heads | k heads | v heads]``, column 3 multiplies
        the current input. Last dim contiguous.
    A_log : torch.Tensor
        ``H`` fp32 values, any shape (``[H]`` or SGLang's ``[1, 1, H, 1]``), contiguous.
    dt_bias : torch.Tensor
        ``H*128`` fp32 values, contiguous.
    lower_bound : float or None
        ``None``: gate ``g = -exp(A_log) * softplus(a + dt_bias)``; a float (e.g. -5.0):
        ``g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``.
    ssm_state : torch.Tensor
        Persistent recurrent state ``[slots, H, 128 (V), 128 (K)]`` fp32, each slot's ``[H, 128, 128]``
        block contiguous (any slot stride). Read only.
    conv_state : torch.Tensor
        Persistent conv window ``[slots, 3, D]`` in the activation dtype, D contiguous, row 0 oldest.
        Read only.
    slot_indices : torch.Tensor
        ``[N]`` int32, slot of each request; ``-1`` = CUDA-graph padding (nothing read or written,
        output rows zero).
    cu_seqlens : torch.Tensor
        ``[N + 1]`` int32 token offsets (``cu_seqlens[0] == 0``). Output rows ``[cu_seqlens[N], T)``
        belong to no request and are zero-filled.
    num_spec : int
        Draft tokens per request (window = ``1 + num_spec`` steps); a compile-time constant.
    intermediate_conv : torch.Tensor
        ``[rows, >= 1+num_spec, 3, D]`` activation dtype, D contiguous; ``[intermediate_rows[n], t]``
        receives the conv window after token t (written in both modes).
    intermediate_rows : torch.Tensor
        ``[N]`` int32, scratch row of each request for ``intermediate_conv`` / ``intermediate_ssm``.
    intermediate_ssm : torch.Tensor, optional
        Snapshot mode: ``[rows, >= 1+num_spec, H, 128, 128]`` fp32 (each ``[H, 128, 128]`` block
        contiguous); ``[row, t]`` receives the state after step t.
    ring_rawv, ring_rawk : torch.Tensor, optional
        Ring mode: ``[slots, H, L, 128]`` activation dtype, last dim contiguous, ``L >= 1+num_spec``;
        step t of request n goes to ``[slot, h, t]``: rawv = v after conv+SiLU (before the delta rule),
        rawk = k after conv+SiLU (before the L2 norm).
    ring_g : torch.Tensor, optional
        Ring mode: ``[slots, H, L, 128]`` fp32 per-K log-decay g.
    ring_beta : torch.Tensor, optional
        Ring mode: ``[slots, H, L]`` fp32 ``sigmoid(b)``.
    scale : float, optional
        Query scale, default ``128 ** -0.5``.
    out : torch.Tensor, optional
        ``[1, T, H, 128]`` in the activation dtype, last dim contiguous; allocated when None.
    block_v, num_warps, block_k, num_stages : int, optional
        Tuning knobs (defaults from :mod:`.launch_config`, keyed on H, N and the window): V-tile per
        program (power of two dividing 128), warps; chunked kernel only: the ``tl.dot`` K-chunk
        (16..128) and pipeline stages of its streaming kernel.
    dot_precision : str, optional
        Chunked kernel: ``tl.dot`` input precision of the state product (and of the
        finished epilogue products, plain and lazy), ``"tf32x3"`` (default,
        about fp32 accuracy on tensor cores), ``"ieee"`` (exact fp32 FMA) or ``"tf32"``.
    impl : str, optional
        ``None``/``"auto"``: the launch table's choice (ring mode: the chunked prep + streaming
        kernels of :mod:`.mtp_verify_chunked` for large batches / long windows, else the recurrent
        ``[block_v, 128]`` kernel below; snapshot mode: always the recurrent kernel).
        ``"chunked"`` or ``"rows"`` force one (``"chunked"`` falls back to ``"rows"`` in snapshot mode).
        ``"gluon"``: the chunked prep and finish kernels, then the Hopper Gluon stream of
        :mod:`.mtp_verify_gluon` (ring mode without ``record_cursor``, where
        :func:`gluon_stream_supported`; else DSPARK-E123). The server chooses it with
        ``SGLANG_DSPARK_VERIFY_IMPL=gluon``.
    prep_block_k, prep_num_warps : int, optional
        Chunked kernel: q/k channels and warps per program of its prep kernel (one program per
        request, head and channel chunk).
    finish : bool, optional
        Chunked kernel: run the per-(request, head) finish kernel between prep and streaming kernel
        (the window's ``T x T`` algebra once per head; default from the table: windows of 5+ tokens).
    record_cursor : torch.Tensor, optional
        Lazy record ring (ring mode; docs/design/lazy-record-ring.md): ``[slots]`` int32, ``p`` =
        the records of accepted tokens a slot holds in ring rows ``[0, p)`` that
        ``ssm_state[slot]`` (the checkpoint) does not yet include (the pool's ``dspark_record_cursor``). Read only here (the
        commit moves it, :func:`sglang_dspark_plugin.kernels.record_ring.commit_records`). The window starts from
        the checkpoint carried over those records; when it would not fit behind them
        (``p + 1 + num_spec > L``) that state is written to ``ssm_state[slot]`` first (a flush) and
        the window's records start at row 0, else at row ``p``. Record of token t: its corrected
        delta ``beta (v - S' k)`` (``ring_delta``), its key before normalisation (``ring_rawk``), the
        key norm's reciprocal (``ring_beta``: in this mode it keeps no betas) and its log-decay
        (``ring_g``). ``ring_rawv`` is not written. Always the chunked kernels.
    ring_delta : torch.Tensor or (torch.Tensor, torch.Tensor), optional
        With ``record_cursor``: the corrected deltas ``[slots, H, L, 128]``, one fp32 ring, or two
        2-byte rings of that shape and equal strides holding the high and low 16 bits of each fp32
        value (lossless; SGLang's bf16 ``replayssm_d`` / ``replayssm_k``, which the speculative ring
        leaves unused).

    output_gate, output_norm_weight, output_norm_eps : optional, all or none
        Kimi-K3's output gate, fused into the epilogue: each output row (rounded to the
        activation dtype) becomes ``o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate)`` (the
        model's ``o_norm``, ``FusedRMSNormGated`` with the sigmoid gate). ``output_gate``
        ``[1, T, H, 128]`` bf16 / fp32, last dim contiguous (token and head strides free: a view of
        the model's gate projection); ``output_norm_weight`` ``[128]`` fp32 or bf16;
        ``output_norm_eps`` a Python float. The row's 128 channels are spread over the V-tile
        programs of its head: the last of them to finish normalises the head's rows.
    output_gate_workspace : torch.Tensor, optional
        With the output gate: ``[>= N * H]`` int32 zeros, the per-(request, head) arrival counters
        of the V-tile programs; the kernel leaves them zero, so one buffer serves every call (and
        CUDA-graph replay). None allocates one per call (a memset launch).

    Exactly one of snapshot mode (``intermediate_ssm``) and ring mode (all four rings) must be used.

    Returns
    -------
    torch.Tensor
        ``out``, ``[1, T, H, 128]`` in the activation dtype.

    Recurrent kernel: grid ``(128 // block_v, N, H)``, program (iv, n, h) keeps the state tile ``[block_v, 128]``
    in registers for the whole window; q/k conv and norms are recomputed per V-tile; V-tile 0 alone
    writes the q/k conv windows and the rawk/g/beta rings.

    Stages: ``_validate`` checks every argument (metadata only), :func:`plan_mtp_verify` picks the
    kernel and its launch parameters from the shapes (callable on its own, e.g. to see what a shape
    runs), ``_launch`` launches it.
    """
    checked = _validate(
        q, k, v, a, b, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
        ssm_state=ssm_state, conv_state=conv_state, slot_indices=slot_indices, cu_seqlens=cu_seqlens,
        num_spec=num_spec, intermediate_conv=intermediate_conv, intermediate_rows=intermediate_rows,
        intermediate_ssm=intermediate_ssm, rings=(ring_rawv, ring_rawk, ring_g, ring_beta), scale=scale, out=out,
        record_cursor=record_cursor, ring_delta=ring_delta, output_gate=output_gate,
        output_norm_weight=output_norm_weight, output_norm_eps=output_norm_eps,
        output_gate_workspace=output_gate_workspace,
    )
    if impl == "gluon" and not gluon_stream_supported(ssm_state):
        raise V.dspark_error(V.E_IMPL, "impl", expected="gluon on an sm_90 GPU with Gluon (Triton >= 3.6) and a "
                             "state pool of contiguous slots", got=f"impl = 'gluon' on {q.device}",
                             fix="leave impl=None (the Triton kernels)")
    plan = plan_mtp_verify(
        checked.H, checked.N, checked.steps, ring=checked.ring, impl=impl, block_v=block_v, num_warps=num_warps,
        block_k=block_k, num_stages=num_stages, dot_precision=dot_precision, prep_block_k=prep_block_k,
        prep_num_warps=prep_num_warps, finish=finish, lazy=checked.delta is not None,
    )
    if out is None:
        out = torch.empty((1, checked.T, checked.H, HEAD_DIM), dtype=checked.act, device=q.device)
    if checked.N == 0:
        return out
    gate = None
    if checked.gate_eps is not None:
        counters = output_gate_workspace
        if counters is None:
            counters = torch.zeros(checked.N * checked.H, dtype=torch.int32, device=q.device)
        gate = (output_gate, output_norm_weight, checked.gate_eps, counters)
    _launch(
        plan, checked, q, k, v, a, b, out, conv_weight=conv_weight, ssm_state=ssm_state, conv_state=conv_state,
        slot_indices=slot_indices, cu_seqlens=cu_seqlens, intermediate_conv=intermediate_conv,
        intermediate_rows=intermediate_rows, intermediate_ssm=intermediate_ssm,
        rings=(ring_rawv, ring_rawk, ring_g, ring_beta), record_cursor=record_cursor, gate=gate,
    )
    return out


def gluon_stream_supported(ssm_state: torch.Tensor) -> bool:
    """Whether ``impl="gluon"`` can run on this state pool: an sm_90 GPU with Gluon, and slots
    contiguous (the kernel reads the pool as one 2-D TMA view ``[slots * H * 128, 128]``)."""
    H = ssm_state.shape[1]
    return (gluon_verify_supported(ssm_state.device) and ssm_state.stride(0) == H * HEAD_DIM * HEAD_DIM
            and ssm_state.data_ptr() % 16 == 0)


# ----------------------------------------------------------------------------------------------
# Stage 1: validate (tensor metadata only: no value read, no host sync)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Checked:
    """What validation established about one call's inputs."""

    T: int  # tokens (N * steps)
    H: int  # heads
    N: int  # requests
    steps: int  # 1 + num_spec
    act: torch.dtype  # activation dtype (q/k/v, conv state, rings, out)
    ring: bool  # ring mode (ReplaySSM rings); else snapshot mode
    A_flat: torch.Tensor  # [H] fp32 view of A_log
    dt_flat: torch.Tensor  # [H*128] fp32 view of dt_bias
    lower_bound: Optional[float]
    scale: float
    delta: Optional[tuple] = None  # lazy record ring: (hi, lo) delta ring(s), lo None when fp32
    gate_eps: Optional[float] = None  # the output gate's eps, None without the output gate


def _validate(q, k, v, a, b, *, conv_weight, A_log, dt_bias, lower_bound, ssm_state, conv_state, slot_indices,
              cu_seqlens, num_spec, intermediate_conv, intermediate_rows, intermediate_ssm, rings, scale,
              out, record_cursor=None, ring_delta=None, output_gate=None, output_norm_weight=None,
              output_norm_eps=None, output_gate_workspace=None) -> _Checked:
    """Check every argument of :func:`mtp_verify` (raises ``DSparkError`` E1xx, first problem first)."""
    T, H, act = V.check_activations([("q", q, True), ("k", k, True), ("v", v, True), ("a", a, False)])
    dev = q.device
    V.check_beta(b, T, H)
    num_spec = V.check_num_spec(num_spec)
    steps = 1 + num_spec
    N = V.check_index("slot_indices", slot_indices, None, what="slot per request, -1 = padding")
    if T != N * steps:
        raise V.dspark_error(
            V.E_TOKENS, "T (tokens of q)", expected=f"T == N * (1 + num_spec) = {N} * {steps} = {N * steps}",
            got=f"T = {T}",
            fix="densify ragged verify batches to N rows of 1+num_spec tokens (pad short rows; cu_seqlens "
                "keeps the real lengths), and pass num_spec = draft_token_num - 1",
        )
    V.check_index("cu_seqlens", cu_seqlens, N + 1, what="token offsets per request")
    V.check_index("intermediate_rows", intermediate_rows, N, what="scratch row per request")
    V.check_conv_weight(conv_weight, H)
    A_flat, dt_flat = V.check_gate_params(A_log, dt_bias, H)
    lower_bound = V.check_scalar("lower_bound", lower_bound, allow_none=True)
    scale = default_scale() if scale is None else V.check_scalar("scale", scale, allow_none=False)
    V.check_ssm_state("ssm_state", ssm_state, H, layered=False)
    V.check_conv_state("conv_state", conv_state, H, act, layered=False)
    V.check_intermediate_conv(intermediate_conv, H, steps, act, layered=False)

    n_rings = sum(r is not None for r in rings)
    snapshot = intermediate_ssm is not None
    if n_rings not in (0, 4):
        raise V.dspark_error(
            V.E_MODE, "ring_rawv/ring_rawk/ring_g/ring_beta", expected="all four rings or none",
            got=f"{n_rings} of 4", fix="pass the pool's four replayssm_* rings together (ring mode)",
        )
    ring = n_rings == 4
    if snapshot == ring:
        raise V.dspark_error(
            V.E_MODE, "intermediate_ssm / rings",
            expected="exactly one mode: intermediate_ssm (snapshot) or the four rings (ReplaySSM)",
            got="both" if snapshot else "neither",
            fix="pass intermediate_ssm=None under --enable-linear-replayssm-spec, else pass no rings",
        )
    if snapshot:
        V.check_intermediate_ssm(intermediate_ssm, H, steps)
    else:
        V.check_rings(*rings, H, steps, act, layered=False, slots=ssm_state.shape[0])
    if out is not None:
        V.check_out(out, T, H, act)
    ring_rawv, ring_rawk, ring_g, ring_beta = rings
    delta = V.check_lazy_ring(record_cursor, ring_delta, ring_rawk, ssm_state.shape[0], ring)
    gate = V.check_output_gate(output_gate, output_norm_weight, output_norm_eps, output_gate_workspace, T, H, N)
    V.check_device(dev, k=k, v=v, a=a, b=b, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias,
                   ssm_state=ssm_state, conv_state=conv_state, slot_indices=slot_indices, cu_seqlens=cu_seqlens,
                   intermediate_conv=intermediate_conv, intermediate_rows=intermediate_rows,
                   intermediate_ssm=intermediate_ssm, ring_rawv=ring_rawv, ring_rawk=ring_rawk, ring_g=ring_g,
                   ring_beta=ring_beta, out=out, record_cursor=record_cursor,
                   ring_delta=None if delta is None else delta[0], output_gate=output_gate,
                   output_norm_weight=output_norm_weight, output_gate_workspace=output_gate_workspace)
    return _Checked(T=T, H=H, N=N, steps=steps, act=act, ring=ring, A_flat=A_flat, dt_flat=dt_flat,
                    lower_bound=lower_bound, scale=scale, delta=delta, gate_eps=None if gate is None else gate[0])


# ----------------------------------------------------------------------------------------------
# Stage 2: plan (which kernel, which launch parameters; shapes only, like FlashInfer's plan())
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class VerifyPlan:
    """How :func:`mtp_verify` launches for a shape: the kernel and its launch parameters.

    ``impl`` is ``"rows"`` (the recurrent kernel above: grid ``(128 // block_v, N, H)``) or
    ``"chunked"`` (ring mode only: prep, optional finish and streaming kernels of
    :mod:`.mtp_verify_chunked`); the ``chunked``-only fields are None for ``"rows"``.
    """

    impl: str
    block_v: int  # V rows per program (chunked: of the streaming kernel)
    num_warps: int
    num_stages: Optional[int]  # None = Triton's default
    block_k: Optional[int] = None  # chunked: tl.dot K-chunk of the streaming kernel
    prep_block_k: Optional[int] = None  # chunked: q/k channels per prep program
    prep_num_warps: Optional[int] = None
    dot_precision: Optional[str] = None  # chunked: "tf32x3", "ieee" or "tf32"
    finish: Optional[bool] = None  # chunked: run the per-(request, head) finish kernel
    finish_num_warps: Optional[int] = None


def plan_mtp_verify(H: int, N: int, steps: int, *, ring: bool, impl: Optional[str] = None,
                    block_v: Optional[int] = None, num_warps: Optional[int] = None, block_k: Optional[int] = None,
                    num_stages: Optional[int] = None, dot_precision: Optional[str] = None,
                    prep_block_k: Optional[int] = None, prep_num_warps: Optional[int] = None,
                    finish: Optional[bool] = None, lazy: bool = False) -> VerifyPlan:
    """The launch plan of :func:`mtp_verify` for ``H`` heads, ``N`` requests and ``steps`` = 1 + num_spec
    tokens per request: the launch table's choice (:mod:`.launch_config`), with the knobs the caller
    set (same meaning as in :func:`mtp_verify`) taking precedence. Raises E121-E123 for bad knobs.
    ``lazy``: the lazy record ring (``record_cursor`` given), which only the chunked kernels keep."""
    V.check_impl(impl, (None, "auto", "chunked", "rows", "gluon"))
    if impl == "gluon" and (lazy or not ring):
        raise V.dspark_error(V.E_IMPL, "impl", expected="gluon only in ring mode without the lazy record ring",
                             got=f"impl = 'gluon' with {'record_cursor' if lazy else 'intermediate_ssm (snapshot mode)'}",
                             fix="leave impl=None there (the Triton kernels)")
    if lazy and impl == "rows":
        raise V.dspark_error(V.E_IMPL, "impl", expected="chunked or None (the lazy record ring's only kernels)",
                             got="impl = 'rows'", fix="leave impl=None with record_cursor")
    # snapshot mode always runs the recurrent kernel: the chunked form computes outputs only
    if impl == "gluon":  # the prep and finish kernels, then the Gluon stream (mtp_verify_gluon.py)
        cfg = LC.verify_ring(H, N, steps, "chunked")  # the prep / finish tiles
        return VerifyPlan(impl="gluon", block_v=128, num_warps=4, num_stages=None, block_k=32,
                          prep_block_k=prep_block_k or cfg["prep_block_k"],
                          prep_num_warps=prep_num_warps or cfg["prep_num_warps"], dot_precision="tf32x3",
                          finish=True, finish_num_warps=cfg["finish_num_warps"])
    cfg = (LC.verify_ring(H, N, steps, None if impl == "auto" else impl, lazy=lazy) if ring
           else dict(impl="rows", **LC.verify_rows(H, N, steps)))
    BV = V.check_block_v(block_v if block_v is not None else cfg["block_v"])
    warps = num_warps or cfg["num_warps"]
    stages = num_stages if num_stages is not None else cfg.get("num_stages")
    if cfg["impl"] != "chunked":
        return VerifyPlan(impl="rows", block_v=BV, num_warps=warps, num_stages=stages)
    BK = V.check_block_k(block_k if block_k is not None else cfg["block_k"])
    return VerifyPlan(
        impl="chunked", block_v=max(16, BV), num_warps=warps, num_stages=stages, block_k=max(16, BK),  # tl.dot: >= 16
        prep_block_k=prep_block_k or cfg["prep_block_k"], prep_num_warps=prep_num_warps or cfg["prep_num_warps"],
        dot_precision=dot_precision or cfg.get("dot_precision", "tf32x3"),
        finish=cfg["finish"] if finish is None else bool(finish), finish_num_warps=cfg["finish_num_warps"],
    )


# ----------------------------------------------------------------------------------------------
# Stage 3: launch
# ----------------------------------------------------------------------------------------------

def _launch(plan: VerifyPlan, c: _Checked, q, k, v, a, b, out, *, conv_weight, ssm_state, conv_state, slot_indices,
            cu_seqlens, intermediate_conv, intermediate_rows, intermediate_ssm, rings, record_cursor=None,
            gate=None) -> None:
    """Launch the planned kernel(s) on validated arguments; ``gate``: ``(output_gate, weight, eps,
    counters)`` or None."""
    dev = q.device
    if plan.impl in ("chunked", "gluon"):
        ring_rawv, ring_rawk, ring_g, ring_beta = rings
        launch_verify_ring_chunked(
            q, k, v, a, b, out, conv_weight=conv_weight, A_flat=c.A_flat, dt_flat=c.dt_flat,
            lower_bound=c.lower_bound, scale=c.scale, ssm_state=ssm_state, conv_state=conv_state,
            slot_indices=slot_indices, cu_seqlens=cu_seqlens, intermediate_conv=intermediate_conv,
            intermediate_rows=intermediate_rows, ring_rawv=ring_rawv, ring_rawk=ring_rawk, ring_g=ring_g,
            ring_beta=ring_beta, N=c.N, T=c.T, H=c.H, steps=c.steps, act_bf16=c.act == torch.bfloat16,
            block_v=plan.block_v, block_k=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages,
            prep_block_k=plan.prep_block_k, prep_num_warps=plan.prep_num_warps, dot_precision=plan.dot_precision,
            finish=plan.finish, finish_num_warps=plan.finish_num_warps, pdl_kwargs=LC.pdl_kwargs(dev),
            record_cursor=record_cursor, ring_delta=c.delta, gate=gate, stream="gluon" if plan.impl == "gluon" else "triton")
        return
    extra = {} if plan.num_stages is None else dict(num_stages=plan.num_stages)
    snapshot = not c.ring
    issm = intermediate_ssm if snapshot else ssm_state  # placeholder pointer, never touched
    issm_strides = (intermediate_ssm.stride(0), intermediate_ssm.stride(1)) if snapshot else (0, 0)
    if c.ring:
        rv, rk, rg, rb = rings
        ring_strides = (rv.stride(0), rv.stride(1), rv.stride(2), rk.stride(0), rk.stride(1), rk.stride(2),
                        rg.stride(0), rg.stride(1), rg.stride(2), rb.stride(0), rb.stride(1), rb.stride(2))
    else:
        rv = rk = rg = rb = ssm_state
        ring_strides = (0,) * 12

    if gate is not None:
        og, onw, eps, counters = gate
        gate_args = (og, onw, counters, eps, og.stride(1), og.stride(2))
    else:
        gate_args = (out, out, slot_indices, 0.0, 0, 0)  # placeholders, never touched
    grid = (HEAD_DIM // plan.block_v, c.N, c.H)
    _mtp_verify_kernel[grid](
        q, k, v, a, b, out,
        conv_weight, c.A_flat, c.dt_flat,
        ssm_state, conv_state, slot_indices, cu_seqlens,
        intermediate_conv, intermediate_rows, issm,
        rv, rk, rg, rb,
        c.N, c.T, c.H, 0.0 if c.lower_bound is None else c.lower_bound, c.scale,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        a.stride(1), a.stride(2), b.stride(1), b.stride(2), out.stride(1), out.stride(2),
        conv_weight.stride(0),
        ssm_state.stride(0), conv_state.stride(0), conv_state.stride(1),
        intermediate_conv.stride(0), intermediate_conv.stride(1), intermediate_conv.stride(2),
        *issm_strides,
        *ring_strides,
        *gate_args,
        STEPS=c.steps, BV=plan.block_v, ACT_BF16=c.act == torch.bfloat16,
        USE_LB=c.lower_bound is not None, SNAPSHOT=snapshot, RING=c.ring,
        GATE=gate is not None, TP=max(2, triton.next_power_of_2(c.steps)),
        num_warps=plan.num_warps, **extra, **LC.pdl_kwargs(dev),
    )
