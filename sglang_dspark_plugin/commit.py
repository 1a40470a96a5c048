"""Commit after verify: make the recurrent and conv state of each request reflect exactly its
accepted tokens.

SGLang's DSPARK worker calls ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``
with ``last_correct_step_indices = commit_lens - 1`` (commit_lens counts the bonus token).

- ReplaySSM (``--enable-linear-replayssm-spec``): the verify wrote per-step raw k/v/g/β to
  per-slot rings and no state snapshots; ``kernels.replayssm_fold`` replays exactly the accepted
  prefix into the fp32 state in place, for all KDA layers in one launch, rolls the conv window
  forward to the accepted step and writes SGLang's radix "track" snapshot (state and conv) when
  asked.
- Snapshot mode: the verify wrote the state after every step; SGLang's own snapshot scatter
  (the parent method) copies the accepted step's state and conv window, track included.

The plugin's verify writes rings and snapshots in SGLang's layout and semantics, so SGLang's own
commit is also correct for them; it is used for the snapshot path and the pipeline-parallel
stable-rows variant.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.layers.attention.linear.utils import pp_spec_stable_rows_enabled

from .kernels import replayssm_fold
from .kernels.conv_window import copy_conv_windows


def commit_verified_states(
    linear_backend,
    last_correct_step_indices: torch.Tensor,
    mamba_track_indices: Optional[torch.Tensor],
    mamba_steps_to_track: Optional[torch.Tensor],
    req_pool_indices: Optional[torch.Tensor] = None,
) -> bool:
    """Commit through ``replayssm_fold``; return False when SGLang's own commit must run.

    ``linear_backend`` is the ``DSparkKDAAttnBackend`` whose verify just ran (its
    ``forward_metadata`` still describes the verify batch).
    """
    if not getattr(linear_backend, "last_verify_used_plugin", False):
        return False  # SGLang's verify ran: its commit must match
    if pp_spec_stable_rows_enabled() and req_pool_indices is not None:
        return False
    pool = linear_backend.req_to_token_pool
    if not getattr(pool.mamba_pool, "replayssm_is_kda", False):
        return False  # snapshot mode: SGLang's scatter is exactly the snapshot commit

    caches = pool.get_speculative_mamba2_params_all_layers()
    num_requests = last_correct_step_indices.shape[0]
    slots = linear_backend.forward_metadata.mamba_cache_indices[:num_requests]
    rows = linear_backend.verify_intermediate_state_indices[:num_requests]
    track_slots = track_steps = None
    if mamba_track_indices is not None:
        track_slots = linear_backend._translate_mamba_indices(mamba_track_indices)
        track_slots = track_slots[:num_requests].to(torch.int32)
        track_steps = mamba_steps_to_track[:num_requests].to(torch.int32)
    replayssm_fold(
        caches.temporal,
        caches.replayssm_rawv,
        caches.replayssm_rawk,
        caches.replayssm_g,
        caches.replayssm_beta,
        slots.to(torch.int32),
        (last_correct_step_indices + 1).to(torch.int32),
        conv_state=caches.conv[0],
        intermediate_conv=caches.intermediate_conv_window[0],
        intermediate_rows=rows.to(torch.int32),
        track_slot_indices=track_slots,
        track_steps=track_steps,
    )
    if track_slots is not None:
        # The fold wrote the track slot's state; its conv window comes from the same step.
        copy_conv_windows(
            caches.conv[0], caches.intermediate_conv_window[0], track_slots, rows.to(torch.int32), track_steps
        )
    return True
