"""Copy verify conv windows into persistent conv slots (all layers, one launch).

Used at commit time for SGLang's radix "track" snapshot: the conv window after step ``t`` of
request ``n`` (written by :func:`mtp_verify` into ``intermediate_conv[layer, row, t]``) becomes
``conv_state[layer, slot]``. Rows with ``slot < 0`` or ``t < 0`` are skipped. No host sync.
The accepted-step roll of each request's own slot is done inside :func:`replayssm_fold` (or, under
the lazy record ring, :func:`record_ring.commit_records`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import validation as V

BLOCK = 512


@triton.jit
def _copy_window(dst, src, s_dst_row, s_src_row, ch, mask):
    """Channels ``ch`` of one conv window's 3 rows: ``dst[r, ch] = src[r, ch]``."""
    for r in tl.static_range(3):
        tl.store(dst + r * s_dst_row + ch, tl.load(src + r * s_src_row + ch, mask=mask), mask=mask)


@triton.jit
def _copy_conv_windows_kernel(
    conv_ptr, icw_ptr, slot_ptr, row_ptr, step_ptr,
    D,
    s_conv_layer, s_conv_slot, s_conv_row,
    s_icw_layer, s_icw_row, s_icw_step, s_icw_win,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(2)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    step = tl.load(step_ptr + n).to(tl.int64)
    if (slot >= 0) & (step >= 0):
        row = tl.load(row_ptr + n).to(tl.int64)
        ch = blk * BLOCK + tl.arange(0, BLOCK)
        mask = ch < D
        src = icw_ptr + layer * s_icw_layer + row * s_icw_row + step * s_icw_step
        dst = conv_ptr + layer * s_conv_layer + slot * s_conv_slot
        _copy_window(dst, src, s_conv_row, s_icw_win, ch, mask)


def check_conv_pair(conv_state: torch.Tensor, intermediate_conv: torch.Tensor) -> None:
    """Check the all-layer conv pool ``[layers, slots, 3, D]`` and the verify's conv windows
    ``[layers, rows, steps, 3, D]`` (same layers, dtype and D, D contiguous)."""
    for name, t in (("conv_state", conv_state), ("intermediate_conv", intermediate_conv)):
        V.check_tensor(name, t, V.E_CONV)
    if (
        conv_state.dim() != 4
        or intermediate_conv.dim() != 5
        or conv_state.shape[0] != intermediate_conv.shape[0]
        or conv_state.shape[2:] != intermediate_conv.shape[3:]
        or conv_state.dtype != intermediate_conv.dtype
        or conv_state.stride(-1) != 1
        or intermediate_conv.stride(-1) != 1
    ):
        raise V.dspark_error(
            V.E_CONV, "conv_state/intermediate_conv",
            expected="[layers, slots, 3, D] and [layers, rows, steps, 3, D], same layers, dtype and D, "
            "D contiguous",
            got=f"{list(conv_state.shape)} {conv_state.dtype} / {list(intermediate_conv.shape)} "
            f"{intermediate_conv.dtype}",
            fix="pass SGLang's all-layer pool tensors conv[0] and intermediate_conv_window[0]",
        )


def copy_conv_windows(
    conv_state: torch.Tensor,
    intermediate_conv: torch.Tensor,
    slot_indices: torch.Tensor,
    intermediate_rows: torch.Tensor,
    steps: torch.Tensor,
) -> torch.Tensor:
    """``conv_state[:, slot_indices[n]] = intermediate_conv[:, intermediate_rows[n], steps[n]]``.

    Parameters
    ----------
    conv_state : torch.Tensor
        ``[layers, slots, 3, D]`` (activation dtype, D contiguous), updated in place.
    intermediate_conv : torch.Tensor
        ``[layers, rows, steps, 3, D]``, same dtype, D contiguous.
    slot_indices, intermediate_rows, steps : torch.Tensor
        ``[N]`` int32 each: destination slot (``-1`` = skip), scratch row, step (``< 0`` = skip).
    """
    check_conv_pair(conv_state, intermediate_conv)
    n = V.check_index("slot_indices", slot_indices, None, what="destination slot, -1 = skip")
    V.check_index("intermediate_rows", intermediate_rows, n, what="scratch row per request")
    V.check_index("steps", steps, n, what="verify step to copy, < 0 = skip")
    V.check_device(conv_state.device, intermediate_conv=intermediate_conv, slot_indices=slot_indices,
                   intermediate_rows=intermediate_rows, steps=steps)
    layers, D = conv_state.shape[0], conv_state.shape[-1]
    if n == 0 or layers == 0:
        return conv_state
    grid = (n, layers, triton.cdiv(D, BLOCK))
    _copy_conv_windows_kernel[grid](
        conv_state, intermediate_conv, slot_indices, intermediate_rows, steps,
        D,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        intermediate_conv.stride(0), intermediate_conv.stride(1), intermediate_conv.stride(2),
        intermediate_conv.stride(3),
        BLOCK=BLOCK,
    )
    return conv_state

