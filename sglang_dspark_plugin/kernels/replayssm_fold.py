"""ReplaySSM commit: fold the accepted prefix of the verify rings into the persistent state.

After a ring-mode :func:`mtp_verify`, request n accepted ``accept_lens[n]`` tokens (anchor/bonus
token included). This kernel replays exactly those steps from the rings into
``ssm_state[layer, slot]`` in place, for every KDA layer in one launch, and optionally rolls the
conv state forward to the window after the last accepted token and writes a radix "track"
snapshot. It uses the same device helpers as the verify kernel, so the folded state equals the
verify's snapshot-mode state after step ``accept - 1``.
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
from .common import _delta_step, _l2norm, _pdl_enter


@triton.jit(do_not_specialize=["H", "L", "ICW_STEPS", "s_rb_layer", "s_rb_slot", "s_rb_h", "s_rb_t"])
def _replayssm_fold_kernel(
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
    BV: tl.constexpr, CONV: tl.constexpr, TRACK: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    _pdl_enter(USE_PDL)
    iv = tl.program_id(0)
    n = tl.program_id(1)
    lh = tl.program_id(2)
    KD: tl.constexpr = 128
    layer = (lh // H).to(tl.int64)
    h = lh % H
    h64 = h.to(tl.int64)
    offs_k = tl.arange(0, KD)
    offs_v = iv * BV + tl.arange(0, BV)

    slot = tl.load(slot_ptr + n).to(tl.int64)
    acc = tl.load(acc_ptr + n)
    if (slot >= 0) & (acc > 0):
        n_acc = tl.minimum(acc, L)
        tile = h64 * (KD * KD) + offs_v[:, None] * KD + offs_k[None, :]
        s_layer = ssm_ptr + layer * s_ssm_layer
        S = tl.load(s_layer + slot * s_ssm_slot + tile)
        if CONV:
            # conv_state[layer, slot] <- intermediate_conv[layer, row, accept - 1]; this program
            # copies its V-tile's channel slice of the q, k and v groups of head h. All three loads
            # are issued (after the state tile's) before the first store: the compiler may not move
            # a load above a store that could alias it, and nine interleaved load/store pairs were
            # nine serial memory round trips, a quarter of the fold's stall samples (ncu, H200, H=32,
            # N=64, T=16; fold + conv 143.6 -> 125.2 us).
            row = tl.load(irow_ptr + n).to(tl.int64)
            step = tl.minimum(n_acc, ICW_STEPS) - 1
            src = icw_ptr + layer * s_icw_layer + row * s_icw_row + step.to(tl.int64) * s_icw_step
            dst = conv_ptr + layer * s_conv_layer + slot * s_conv_slot
            win = tl.arange(0, 4)[:, None]  # window rows 0..2 (padded to 4)
            ch = h * KD + offs_v[None, :]  # this V-tile's channels in the q group; + H*KD: k, v
            in_win = (win < 3) & (ch >= 0)  # ch >= 0 is always true: it makes the mask [4, BV]
            win_q = tl.load(src + win * s_icw_win + ch, mask=in_win)
            win_k = tl.load(src + win * s_icw_win + H * KD + ch, mask=in_win)
            win_v = tl.load(src + win * s_icw_win + 2 * H * KD + ch, mask=in_win)
            tl.store(dst + win * s_conv_row + ch, win_q, mask=in_win)
            tl.store(dst + win * s_conv_row + H * KD + ch, win_k, mask=in_win)
            tl.store(dst + win * s_conv_row + 2 * H * KD + ch, win_v, mask=in_win)
        if TRACK:
            tslot = tl.load(tslot_ptr + n).to(tl.int64)
            tstep = tl.load(tstep_ptr + n)
        rv_base = rv_ptr + layer * s_rv_layer + slot * s_rv_slot + h64 * s_rv_h
        rk_base = rk_ptr + layer * s_rk_layer + slot * s_rk_slot + h64 * s_rk_h
        rg_base = rg_ptr + layer * s_rg_layer + slot * s_rg_slot + h64 * s_rg_h
        rb_base = rb_ptr + layer * s_rb_layer + slot * s_rb_slot + h64 * s_rb_h
        # The rings of token t + 1 are loaded while token t is folded: the step's loads no
        # longer sit on the per-token latency chain (the state tile never leaves registers).
        k_nx = tl.load(rk_base + offs_k)
        g_nx = tl.load(rg_base + offs_k)
        b_nx = tl.load(rb_base)
        v_nx = tl.load(rv_base + offs_v)
        for t in range(n_acc):
            k_raw, g, beta, v = k_nx, g_nx, b_nx, v_nx
            more = t + 1 < n_acc
            k_nx = tl.load(rk_base + (t + 1) * s_rk_t + offs_k, mask=more & (offs_k < KD), other=0.0)
            g_nx = tl.load(rg_base + (t + 1) * s_rg_t + offs_k, mask=more & (offs_k < KD), other=0.0)
            b_nx = tl.load(rb_base + (t + 1) * s_rb_t, mask=more, other=0.0)
            v_nx = tl.load(rv_base + (t + 1) * s_rv_t + offs_v, mask=more & (offs_v < KD), other=0.0)
            S = _delta_step(S, _l2norm(k_raw.to(tl.float32)), g, beta, v.to(tl.float32))
            if TRACK:
                tl.store(s_layer + tslot * s_ssm_slot + tile, S, mask=(t == tstep) & (tslot >= 0))
        tl.store(s_layer + slot * s_ssm_slot + tile, S)



# ----------------------------------------------------------------------------------------------
# Wrapper: validate -> plan -> launch (the three stages follow it)
# ----------------------------------------------------------------------------------------------


def replayssm_fold(
    ssm_state: torch.Tensor, ring_rawv: torch.Tensor, ring_rawk: torch.Tensor, ring_g: torch.Tensor,
    ring_beta: torch.Tensor, slot_indices: torch.Tensor, accept_lens: torch.Tensor, *,
    conv_state: Optional[torch.Tensor] = None, intermediate_conv: Optional[torch.Tensor] = None,
    intermediate_rows: Optional[torch.Tensor] = None,
    track_slot_indices: Optional[torch.Tensor] = None, track_steps: Optional[torch.Tensor] = None,
    block_v: Optional[int] = None, num_warps: Optional[int] = None, impl: Optional[str] = None,
) -> torch.Tensor:
    """Fold the accepted prefix of every request's verify rings into the persistent state, all layers.

    For request n with ``slot = slot_indices[n] >= 0`` and ``a = accept_lens[n] >= 1``, every layer
    and head replays steps ``t = 0 .. a-1``: ``k = rawk * rsqrt(sum(rawk^2) + 1e-6)``,
    ``S <- S * exp(g)``, ``u = beta * (rawv - S k)``, ``S <- S + u k^T`` into ``ssm_state[layer, slot]``.
    ``a == 0`` or ``slot == -1`` is a no-op. No host sync.

    Parameters
    ----------
    ssm_state : torch.Tensor
        ``[layers, slots, H, 128 (V), 128 (K)]`` fp32 (per-slot ``[H, 128, 128]`` block contiguous),
        updated in place. A single-layer ``[slots, H, 128, 128]`` is accepted (all other tensors then
        single-layer too).
    ring_rawv, ring_rawk : torch.Tensor
        ``[layers, slots, H, L, 128]`` activation dtype (bf16 in SGLang), last dim contiguous, as
        written by :func:`mtp_verify` in ring mode.
    ring_g : torch.Tensor
        ``[layers, slots, H, L, 128]`` fp32 log-decay.
    ring_beta : torch.Tensor
        ``[layers, slots, H, L]`` fp32.
    slot_indices : torch.Tensor
        ``[N]`` int32 persistent slot per request (``-1`` = padding, skipped).
    accept_lens : torch.Tensor
        ``[N]`` int32 accepted tokens per request including the bonus token (``1 .. 1+num_spec``;
        ``0`` = no-op; values above ``L`` are clamped to ``L``).
    conv_state : torch.Tensor, optional
        ``[layers, slots, 3, D]`` activation dtype, D contiguous: set to
        ``intermediate_conv[layer, intermediate_rows[n], a-1]`` when given.
    intermediate_conv : torch.Tensor, optional
        ``[layers, rows, steps, 3, D]`` (same dtype as ``conv_state``), the verify's conv windows.
    intermediate_rows : torch.Tensor, optional
        ``[N]`` int32 scratch row per request (the one given to :func:`mtp_verify`).
    track_slot_indices, track_steps : torch.Tensor, optional
        ``[N]`` int32 each: also write the state after step ``track_steps[n]`` (0-based; ``< 0`` or
        ``>= a`` = none) into ``ssm_state[:, track_slot_indices[n]]`` (SGLang's radix "track"
        snapshot; a track slot of ``-1`` is skipped).
    block_v, num_warps : int, optional
        Tuning knobs (defaults from :mod:`.launch_config`): V-tile rows per program, warps.
    impl : str, optional
        ``None`` / ``"auto"`` / ``"rows"``: the recurrent ``[block_v, 128]`` kernel above (the same
        step helper as the recurrent verify, so the folded state equals snapshot mode bit for bit).
        Chunked (tl.dot) folds were measured 2-5x slower on the H200, in one-kernel and in
        prep + streaming form (docs/design/alternatives-measured.md), and are not shipped.

    Returns
    -------
    torch.Tensor
        ``ssm_state`` (updated in place).

    Grid ``(128 // block_v, N, layers * H)``; program (iv, n, layer*H + h) owns the state tile
    ``ssm_state[layer, slot, h, iv*block_v : (iv+1)*block_v, :]`` (no two programs share state rows).

    Stages: ``_validate`` checks every argument (metadata only) and brings single-layer tensors to
    the all-layer form, :func:`plan_replayssm_fold` picks the launch parameters from the shapes,
    ``_launch`` launches the kernel.
    """
    c = _validate(ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta, slot_indices, accept_lens,
                  conv_state=conv_state, intermediate_conv=intermediate_conv, intermediate_rows=intermediate_rows,
                  track_slot_indices=track_slot_indices, track_steps=track_steps)
    plan = plan_replayssm_fold(c.H, c.N, c.layers, impl=impl, block_v=block_v, num_warps=num_warps)
    if c.N > 0 and c.layers > 0:
        _launch(plan, c, slot_indices, accept_lens, intermediate_rows=intermediate_rows,
                track_slot_indices=track_slot_indices, track_steps=track_steps)
    return ssm_state  # the caller's tensor (single- or all-layer), updated in place


# ----------------------------------------------------------------------------------------------
# Stage 1: validate (tensor metadata only: no value read, no host sync)
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Checked:
    """What validation established, with every state/ring/conv tensor in the all-layer form."""

    ssm_state: torch.Tensor  # [layers, slots, H, 128, 128]
    rings: tuple  # (rawv, rawk, g, beta), [layers, slots, H, L(, 128)]
    conv_state: Optional[torch.Tensor]  # [layers, slots, 3, D] when the conv state rolls forward
    intermediate_conv: Optional[torch.Tensor]  # [layers, rows, steps, 3, D]
    H: int
    L: int  # ring length
    N: int  # requests
    layers: int
    track: bool  # write the radix track snapshot


def _layered(t: Optional[torch.Tensor], single_dim: int) -> Optional[torch.Tensor]:
    return t.unsqueeze(0) if t is not None and isinstance(t, torch.Tensor) and t.dim() == single_dim else t


def _validate(ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta, slot_indices, accept_lens, *, conv_state,
              intermediate_conv, intermediate_rows, track_slot_indices, track_steps) -> _Checked:
    """Check every argument of :func:`replayssm_fold` (raises ``DSparkError`` E1xx, first problem first)."""
    V.check_tensor("ssm_state", ssm_state, V.E_SSM)
    if ssm_state.dim() == 4:  # single-layer form: every tensor gets a layer dim of 1 (views)
        ssm_state = ssm_state.unsqueeze(0)
        ring_rawv, ring_rawk, ring_g = (_layered(t, 4) for t in (ring_rawv, ring_rawk, ring_g))
        ring_beta = _layered(ring_beta, 3)
        conv_state = _layered(conv_state, 3)
        intermediate_conv = _layered(intermediate_conv, 4)
    H = ssm_state.shape[-3] if ssm_state.dim() >= 3 else -1
    V.check_ssm_state("ssm_state", ssm_state, H, layered=True)
    layers, slots = ssm_state.shape[0], ssm_state.shape[1]
    for name, t in (("ring_rawv", ring_rawv), ("ring_rawk", ring_rawk)):
        V.check_tensor(name, t, V.E_RING)
    act = ring_rawv.dtype
    if act not in V.ACTIVATION_DTYPES:
        raise V.dspark_error(V.E_RING, "ring_rawv", expected="bfloat16 or float32", got=str(act),
                             fix="pass the pool's replayssm_rawv ring (activation dtype)")
    L = V.check_rings(ring_rawv, ring_rawk, ring_g, ring_beta, H, 1, act, layered=True, slots=slots, layers=layers)
    N = V.check_index("slot_indices", slot_indices, None, what="slot per request, -1 = padding")
    V.check_index("accept_lens", accept_lens, N, what="accepted tokens per request incl. the bonus token")

    conv_args = (conv_state, intermediate_conv, intermediate_rows)
    n_conv = sum(t is not None for t in conv_args)
    if n_conv not in (0, 3):
        raise V.dspark_error(
            V.E_FOLD_ARGS, "conv_state/intermediate_conv/intermediate_rows", expected="all three or none",
            got=f"{n_conv} of 3", fix="pass all three to roll the conv state forward, or none to fold the state only",
        )
    if n_conv == 3:
        # SGLang allocates the conv state, the verify's conv windows and the rings in one dtype
        # (the pool's conv dtype); the fold copies conv windows byte for byte.
        V.check_conv_state("conv_state", conv_state, H, act, layered=True)
        V.check_intermediate_conv(intermediate_conv, H, 1, act, layered=True)
        V.check_index("intermediate_rows", intermediate_rows, N, what="scratch row per request")
        if conv_state.shape[0] != layers or intermediate_conv.shape[0] != layers or conv_state.shape[1] != slots:
            raise V.dspark_error(
                V.E_FOLD_ARGS, "conv_state/intermediate_conv",
                expected=f"{layers} layers (and {slots} slots for conv_state) like ssm_state",
                got=f"conv_state {list(conv_state.shape)}, intermediate_conv {list(intermediate_conv.shape)}",
                fix="pass the all-layer pool tensors (or single-layer tensors everywhere)",
            )
    n_track = (track_slot_indices is not None) + (track_steps is not None)
    if n_track == 1:
        raise V.dspark_error(
            V.E_FOLD_ARGS, "track_slot_indices/track_steps", expected="both or none", got="only one",
            fix="pass both to write the radix track snapshot, or neither",
        )
    if n_track == 2:
        V.check_index("track_slot_indices", track_slot_indices, N, what="track slot per request, -1 = none")
        V.check_index("track_steps", track_steps, N, what="0-based step to snapshot, < 0 = none")
    V.check_device(ssm_state.device, ring_rawv=ring_rawv, ring_rawk=ring_rawk, ring_g=ring_g, ring_beta=ring_beta,
                   slot_indices=slot_indices, accept_lens=accept_lens, conv_state=conv_state,
                   intermediate_conv=intermediate_conv, intermediate_rows=intermediate_rows,
                   track_slot_indices=track_slot_indices, track_steps=track_steps)
    return _Checked(ssm_state=ssm_state, rings=(ring_rawv, ring_rawk, ring_g, ring_beta),
                    conv_state=conv_state if n_conv == 3 else None,
                    intermediate_conv=intermediate_conv if n_conv == 3 else None,
                    H=H, L=L, N=N, layers=layers, track=n_track == 2)


# ----------------------------------------------------------------------------------------------
# Stage 2: plan (launch parameters from the shapes, like FlashInfer's plan())
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FoldPlan:
    """How :func:`replayssm_fold` launches for a shape: grid ``(128 // block_v, N, layers * H)``."""

    block_v: int  # V rows per program
    num_warps: int


def plan_replayssm_fold(H: int, N: int, layers: int, *, impl: Optional[str] = None, block_v: Optional[int] = None,
                        num_warps: Optional[int] = None) -> FoldPlan:
    """The launch plan of :func:`replayssm_fold` for ``H`` heads, ``N`` requests and ``layers`` KDA
    layers: the launch table's choice (:mod:`.launch_config`), with the caller's knobs taking
    precedence. One kernel ships (``impl`` None / "auto" / "rows"). Raises E121/E123 for bad knobs."""
    V.check_impl(impl, (None, "auto", "rows"))
    cfg = LC.fold(H, N, layers)
    return FoldPlan(block_v=V.check_block_v(block_v if block_v is not None else cfg["block_v"]),
                    num_warps=num_warps or cfg["num_warps"])


# ----------------------------------------------------------------------------------------------
# Stage 3: launch
# ----------------------------------------------------------------------------------------------

def _launch(plan: FoldPlan, c: _Checked, slot_indices, accept_lens, *, intermediate_rows, track_slot_indices,
            track_steps) -> None:
    """Launch the fold kernel on validated arguments (all-layer form)."""
    ssm_state = c.ssm_state
    rv, rk, rg, rb = c.rings
    if c.conv_state is not None:
        conv_ptr, icw_ptr, irow_ptr = c.conv_state, c.intermediate_conv, intermediate_rows
        conv_strides = (c.conv_state.stride(0), c.conv_state.stride(1), c.conv_state.stride(2))
        icw_strides = tuple(c.intermediate_conv.stride(i) for i in range(4))
        icw_steps = c.intermediate_conv.shape[2]
    else:
        conv_ptr = icw_ptr = ssm_state  # placeholders, never touched
        irow_ptr = slot_indices
        conv_strides, icw_strides, icw_steps = (0, 0, 0), (0, 0, 0, 0), 1
    tslot_ptr, tstep_ptr = (track_slot_indices, track_steps) if c.track else (slot_indices, slot_indices)

    grid = (HEAD_DIM // plan.block_v, c.N, c.layers * c.H)
    _replayssm_fold_kernel[grid](
        ssm_state, rv, rk, rg, rb, slot_indices, accept_lens,
        conv_ptr, icw_ptr, irow_ptr, tslot_ptr, tstep_ptr,
        c.H, c.L, icw_steps,
        ssm_state.stride(0), ssm_state.stride(1),
        rv.stride(0), rv.stride(1), rv.stride(2), rv.stride(3),
        rk.stride(0), rk.stride(1), rk.stride(2), rk.stride(3),
        rg.stride(0), rg.stride(1), rg.stride(2), rg.stride(3),
        rb.stride(0), rb.stride(1), rb.stride(2), rb.stride(3),
        *conv_strides, *icw_strides,
        BV=plan.block_v, CONV=c.conv_state is not None, TRACK=c.track,
        num_warps=plan.num_warps, **LC.pdl_kwargs(ssm_state.device),
    )
