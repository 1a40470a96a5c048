"""Lazy record ring: materialise a slot's state from its checkpoint and pending records.

Under the lazy record ring (docs/lazy-flush.md) a slot's pool state is a checkpoint and ring
rows ``[0, p)`` hold the records of the ``p`` accepted tokens since (``mtp_verify`` with
``record_cursor`` writes them). Where SGLang needs the state itself -- the radix "track"
snapshot written at commit -- this kernel carries the checkpoint over the first ``count``
records, for every KDA layer in one launch, with one tensor-core product per state tile::

    S = S0 o e^{G_count} + sum_{s < count} d_s (k_s o e^{G_count - G_{s+1}})^T,   G_m = sum_{i < m} g_i

The verify's own flush (when the next window would not fit behind the records) does the same
inside the verify's state pass and needs no launch of its own.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..settings import HEAD_DIM, interpreting
from . import validation as V
from .common import _carried_keys, _load_delta, _pdl_enter
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


def commit_records(record_cursor: torch.Tensor, slot_indices: torch.Tensor, accept_lens: torch.Tensor, *,
                   steps: int, ring_len: int) -> torch.Tensor:
    """The lazy ring's commit of one verify: each request's cursor moves past its accepted tokens'
    records (``base + accept``, ``base`` = the row the verify wrote the window's first record to:
    0 when it flushed, else the old cursor). Returns ``base`` ``[N]`` int32 (the track snapshot of
    step t carries the checkpoint over ``base + t + 1`` records). Plain tensor ops, no host sync.

    ``record_cursor`` ``[slots]`` int32 (in place); ``slot_indices`` ``[N]`` int32 (``-1`` = padding,
    left alone: its row writes slot 0's cursor back unchanged, the reserved padding slot);
    ``accept_lens`` ``[N]`` (accepted tokens incl. the bonus one); ``steps`` = 1 + num_spec and
    ``ring_len`` = L, as in the verify."""
    idx = slot_indices.clamp(min=0).long()
    p = record_cursor[idx]
    base = torch.where(p + steps > ring_len, torch.zeros_like(p), p)
    new = torch.where(slot_indices >= 0, base + accept_lens.to(p.dtype).clamp(0, steps), p)
    record_cursor.index_put_((idx,), new)
    return base
