"""Lazy record ring: the commit (cursor advance and conv roll) and the state of a slot
materialised from its checkpoint and pending records.

Under the lazy record ring (docs/design/lazy-record-ring.md) a slot's pool state is a checkpoint and ring
rows ``[0, p)`` hold the records of the ``p`` accepted tokens since (``mtp_verify`` with
``record_cursor`` writes them). Where SGLang needs the state itself -- the radix "track"
snapshot written at commit -- this kernel carries the checkpoint over the first ``count``
records, for every KDA layer in one launch, with one tensor-core product per state tile::

    S = S0 o e^{G_count} + sum_{s < count} d_s (k_s o e^{G_count - G_{s+1}})^T,   G_m = sum_{i < m} g_i

The verify's own flush (when the next window would not fit behind the records) does the same
inside the verify's state pass and needs no launch of its own.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..settings import HEAD_DIM, interpreting
from . import validation as V
from .common import _carried_keys, _load_delta, _pdl_enter
from .conv_window import BLOCK as CONV_BLOCK, _copy_window, check_conv_pair
from .launch_config import pdl_kwargs


@triton.jit(do_not_specialize=["H"])
def _materialize_records_kernel(
    ssm_ptr, rk_ptr, rg_ptr, rb_ptr, rd_hi_ptr, rd_lo_ptr, src_ptr, cnt_ptr, dst_ptr,
    H,
    s_ssm_layer, s_ssm_slot,
    s_rk_layer, s_rk_slot, s_rk_h, s_rk_t,
    s_rg_layer, s_rg_slot, s_rg_h, s_rg_t,
    s_rb_layer, s_rb_slot, s_rb_h, s_rb_t,
    s_rd_layer, s_rd_slot, s_rd_h, s_rd_t,
    BV: tl.constexpr, LP: tl.constexpr, SPLIT_D: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Program (iv, n, layer*H + h): rows ``[iv*BV, (iv+1)*BV)`` of ``ssm_state[layer, dst, h]``."""
    _pdl_enter(USE_PDL)
    iv = tl.program_id(0)
    n = tl.program_id(1)
    lh = tl.program_id(2)
    KD: tl.constexpr = 128
    layer = (lh // H).to(tl.int64)
    h64 = (lh % H).to(tl.int64)
    src = tl.load(src_ptr + n).to(tl.int64)
    dst = tl.load(dst_ptr + n).to(tl.int64)
    cnt = tl.load(cnt_ptr + n)
    if (src >= 0) & (dst >= 0) & ((cnt > 0) | (dst != src)):
        offs_k = tl.arange(0, KD)
        offs_v = iv * BV + tl.arange(0, BV)
        offs_l = tl.arange(0, LP)
        carried, decay = _carried_keys(rk_ptr + layer * s_rk_layer + src * s_rk_slot + h64 * s_rk_h,
                                       rg_ptr + layer * s_rg_layer + src * s_rg_slot + h64 * s_rg_h,
                                       rb_ptr + layer * s_rb_layer + src * s_rb_slot + h64 * s_rb_h,
                                       s_rk_t, s_rg_t, s_rb_t, offs_k, cnt, LP)
        rd_off = layer * s_rd_layer + src * s_rd_slot + h64 * s_rd_h
        D = _load_delta(rd_hi_ptr, rd_lo_ptr, rd_off + offs_l[:, None] * s_rd_t + offs_v[None, :],
                        (offs_l < cnt)[:, None], SPLIT_D)
        tile = h64 * (KD * KD) + offs_v[:, None] * KD + offs_k[None, :]
        s_layer = ssm_ptr + layer * s_ssm_layer
        S = tl.load(s_layer + src * s_ssm_slot + tile) * decay[None, :]
        S = tl.dot(tl.trans(D), carried, S, input_precision=DOT_PREC)
        tl.store(s_layer + dst * s_ssm_slot + tile, S)


def materialize_records(
    ssm_state: torch.Tensor, ring_rawk: torch.Tensor, ring_g: torch.Tensor, ring_beta: torch.Tensor, ring_delta,
    src_slots: torch.Tensor, counts: torch.Tensor, dst_slots: torch.Tensor, *,
    block_v: Optional[int] = None, dot_precision: str = "tf32x3",
) -> torch.Tensor:
    """``ssm_state[:, dst] = ssm_state[:, src]`` carried over the first ``counts[n]`` records of ``src``'s
    lazy record ring, all layers and heads (module docstring). ``dst == src`` is the in-place flush.

    Parameters
    ----------
    ssm_state : torch.Tensor
        ``[layers, slots, H, 128 (V), 128 (K)]`` fp32, per-slot ``[H, 128, 128]`` block contiguous.
    ring_rawk : torch.Tensor
        ``[layers, slots, H, L, 128]`` activation dtype: each record's key before normalisation.
    ring_g : torch.Tensor
        ``[layers, slots, H, L, 128]`` fp32 log-decays.
    ring_beta : torch.Tensor
        ``[layers, slots, H, L]`` fp32: under the lazy ring, each record's key-norm reciprocal.
    ring_delta : torch.Tensor or (torch.Tensor, torch.Tensor)
        The corrected deltas, ``ring_rawk``'s shape: one fp32 ring or two 16-bit rings (high and
        low halves), as for :func:`mtp_verify`'s ``ring_delta``.
    src_slots, counts, dst_slots : torch.Tensor
        ``[N]`` int32 each: source slot, records to carry over (``0 .. L``), destination slot
        (``-1`` in either slot = skip).
    block_v : int, optional
        V rows per program (default 32; 128 under the interpreter), >= 16.
    dot_precision : str
        ``tl.dot`` precision of the product (``"tf32x3"``: about fp32; ``"ieee"``).

    Returns ``ssm_state``. Grid ``(128 // block_v, N, layers * H)``. No host sync.
    """
    V.check_tensor("ssm_state", ssm_state, V.E_SSM)
    H = ssm_state.shape[-3] if ssm_state.dim() == 5 else -1
    V.check_ssm_state("ssm_state", ssm_state, H, layered=True)
    act = ring_rawk.dtype
    V.check_rings(ring_rawk, ring_rawk, ring_g, ring_beta, H, 1, act, layered=True, slots=ssm_state.shape[1],
                  layers=ssm_state.shape[0])
    hi, lo = V.check_delta_ring(ring_delta, ring_rawk)
    N = V.check_index("src_slots", src_slots, None, what="source slot per row, -1 = skip")
    V.check_index("counts", counts, N, what="records to carry over")
    V.check_index("dst_slots", dst_slots, N, what="destination slot per row, -1 = skip")
    V.check_device(ssm_state.device, ring_rawk=ring_rawk, ring_g=ring_g, ring_beta=ring_beta, ring_delta=hi,
                   src_slots=src_slots, counts=counts, dst_slots=dst_slots)
    BV = V.check_block_v(block_v or (128 if interpreting() else 32))
    if BV < 16:
        raise V.dspark_error(V.E_BLOCK_V, "block_v", expected="block_v >= 16 (tl.dot tile)", got=f"block_v = {BV}",
                             fix="leave block_v=None")
    layers, L = ssm_state.shape[0], ring_rawk.shape[-2]
    if N == 0 or layers == 0:
        return ssm_state
    split = lo is not None
    lo = hi if lo is None else lo
    rk, rg, rb = ring_rawk, ring_g, ring_beta
    _materialize_records_kernel[(HEAD_DIM // BV, N, layers * H)](
        ssm_state, rk, rg, rb, hi, lo, src_slots, counts, dst_slots,
        H,
        ssm_state.stride(0), ssm_state.stride(1),
        *rk.stride()[:4], *rg.stride()[:4], *rb.stride()[:4], *hi.stride()[:4],
        BV=BV, LP=max(16, triton.next_power_of_2(L)), SPLIT_D=split, DOT_PREC=dot_precision,
        num_warps=4, **pdl_kwargs(ssm_state.device),
    )
    return ssm_state


@triton.jit
def _commit_records_kernel(
    cursor_ptr, slot_ptr, acc_ptr, row_ptr, tslot_ptr, tstep_ptr, tcount_ptr, tdst_ptr,
    conv_ptr, icw_ptr,
    D,
    s_conv_layer, s_conv_slot, s_conv_row,
    s_icw_layer, s_icw_row, s_icw_step, s_icw_win,
    STEPS: tl.constexpr, RING_LEN: tl.constexpr, HAS_TRACK: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (n, layer, blk): channels ``[blk*BLOCK, (blk+1)*BLOCK)`` of request ``n``'s conv
    windows in ``layer``; program (n, 0, 0) also moves request ``n``'s cursor. Rows touch disjoint
    slots (a request's own slot, its track slot), so programs never race."""
    n = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(2)
    slot = tl.load(slot_ptr + n)
    acc = tl.minimum(tl.maximum(tl.load(acc_ptr + n), 0), STEPS)
    dst = -1
    tstep = -1
    if HAS_TRACK:
        tstep = tl.load(tstep_ptr + n)
        tslot = tl.load(tslot_ptr + n)
        dst = tl.where((tstep >= 0) & (tstep < acc) & (slot >= 0) & (tslot >= 0), tslot, -1)
    if (layer == 0) & (blk == 0):
        p = tl.load(cursor_ptr + tl.maximum(slot, 0))
        base = tl.where(p + STEPS > RING_LEN, 0, p)  # the verify flushed: its records start at row 0
        if slot >= 0:
            tl.store(cursor_ptr + slot, base + acc)
        if HAS_TRACK:
            tl.store(tcount_ptr + n, base + tstep + 1)
            tl.store(tdst_ptr + n, dst)
            if dst >= 0:
                tl.store(cursor_ptr + dst, 0)  # the track slot holds a materialised state
    row = tl.load(row_ptr + n).to(tl.int64)
    ch = blk * BLOCK + tl.arange(0, BLOCK)
    mask = ch < D
    src = icw_ptr + layer * s_icw_layer + row * s_icw_row
    if (slot >= 0) & (acc > 0):  # the conv roll to the last accepted token
        _copy_window(conv_ptr + layer * s_conv_layer + slot.to(tl.int64) * s_conv_slot,
                     src + (acc - 1).to(tl.int64) * s_icw_step, s_conv_row, s_icw_win, ch, mask)
    if dst >= 0:  # the track snapshot's conv window, of the same step as its state
        _copy_window(conv_ptr + layer * s_conv_layer + dst.to(tl.int64) * s_conv_slot,
                     src + tstep.to(tl.int64) * s_icw_step, s_conv_row, s_icw_win, ch, mask)


def commit_records(
    record_cursor: torch.Tensor, slot_indices: torch.Tensor, accept_lens: torch.Tensor,
    conv_state: torch.Tensor, intermediate_conv: torch.Tensor, intermediate_rows: torch.Tensor, *,
    steps: int, ring_len: int, track_slot_indices: Optional[torch.Tensor] = None,
    track_steps: Optional[torch.Tensor] = None,
) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The lazy ring's commit of one verify, all layers, one launch: each request's cursor moves
    past its accepted tokens' records (to ``base + accept``; ``base`` = the row the verify wrote
    the window's first record to: 0 when it flushed, else the old cursor), and its conv window
    rolls to its last accepted token. With a radix track snapshot, the track slot gets the conv
    window of step ``track_steps[n]`` and its cursor is reset (it will hold a materialised state),
    and the returned ``(counts, dst)`` are :func:`materialize_records`' arguments for its state
    (``src`` = ``slot_indices``). No host sync.

    Parameters
    ----------
    record_cursor : torch.Tensor
        ``[slots]`` int32, updated in place.
    slot_indices, accept_lens, intermediate_rows : torch.Tensor
        ``[N]`` int32 each: the request's slot (``-1`` = padding, left alone), accepted tokens
        including the bonus one (``0 .. steps``), the verify's scratch row.
    conv_state : torch.Tensor
        ``[layers, slots, 3, D]`` activation dtype, D contiguous, updated in place.
    intermediate_conv : torch.Tensor
        ``[layers, rows, steps, 3, D]``: the verify's conv window after every step.
    steps, ring_len : int
        ``1 + num_spec`` and the ring length ``L``, as in the verify.
    track_slot_indices, track_steps : torch.Tensor, optional
        ``[N]`` int32 each, together: the track snapshot's slot (``-1`` = none) and step (taken only
        when ``0 <= step < accept``).

    Returns ``(counts, dst)`` ``[N]`` int32 each with a track (``dst = -1`` where none is taken),
    else None.
    """
    N = V.check_index("slot_indices", slot_indices, None, what="slot per request, -1 = padding")
    V.check_index("accept_lens", accept_lens, N, what="accepted tokens per request incl. the bonus token")
    V.check_index("intermediate_rows", intermediate_rows, N, what="scratch row per request")
    V.check_index("record_cursor", record_cursor, None, what="pending records per slot")
    check_conv_pair(conv_state, intermediate_conv)
    if (track_slot_indices is None) != (track_steps is None):
        raise V.dspark_error(V.E_FOLD_ARGS, "track_slot_indices/track_steps", expected="both or none", got="only one",
                             fix="pass both to write the radix track snapshot, or neither")
    has_track = track_slot_indices is not None
    if has_track:
        V.check_index("track_slot_indices", track_slot_indices, N, what="track slot per request, -1 = none")
        V.check_index("track_steps", track_steps, N, what="0-based step to snapshot, < 0 = none")
    V.check_device(record_cursor.device, slot_indices=slot_indices, accept_lens=accept_lens, conv_state=conv_state,
                   intermediate_conv=intermediate_conv, intermediate_rows=intermediate_rows)
    track_out = None
    if has_track:
        track_out = torch.empty(2, N, dtype=torch.int32, device=record_cursor.device)
    layers, D = conv_state.shape[0], conv_state.shape[-1]
    if N > 0:
        dummy = slot_indices
        # no layers: one layer program still moves the cursors; its conv copies are masked off (D = 0)
        _commit_records_kernel[(N, max(layers, 1), triton.cdiv(D, CONV_BLOCK))](
            record_cursor, slot_indices, accept_lens, intermediate_rows,
            track_slot_indices if has_track else dummy, track_steps if has_track else dummy,
            track_out[0] if has_track else dummy, track_out[1] if has_track else dummy,
            conv_state, intermediate_conv,
            D if layers else 0,
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            intermediate_conv.stride(0), intermediate_conv.stride(1), intermediate_conv.stride(2),
            intermediate_conv.stride(3),
            STEPS=steps, RING_LEN=ring_len, HAS_TRACK=has_track, BLOCK=CONV_BLOCK,
        )
    return None if track_out is None else (track_out[0], track_out[1])
