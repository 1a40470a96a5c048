"""Commit after verify: make the recurrent and conv state of each request reflect exactly its
accepted tokens.

SGLang's DSPARK worker calls ``HybridLinearAttnBackend.update_mamba_state_after_mtp_verify``
with ``last_correct_step_indices = commit_lens - 1`` (commit_lens counts the bonus token).

- Lazy record ring (``--enable-linear-replayssm-spec`` where the backend turned it on;
  docs/design/lazy-record-ring.md): the verify left each window token's record behind the slot's pending ones;
  the commit only moves the slot's cursor past the accepted tokens (``record_ring.commit_records``)
  and rolls the conv window; a radix "track" snapshot is materialised from the checkpoint and the
  records (``record_ring.materialize_records``). No state is read or written otherwise.
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

from .kernels import replayssm_fold
from .kernels.conv_window import copy_conv_windows
from .kernels.record_ring import commit_records, materialize_records


def delta_ring(cache):
    """The lazy ring's corrected deltas in a layer's (or the all-layer) pool state: ``replayssm_d``
    when it is fp32, else the pair ``(replayssm_d, replayssm_k)`` holding each fp32 value's high
    and low halves (the kernels' ``ring_delta``)."""
    if cache.replayssm_d.dtype == torch.float32:
        return cache.replayssm_d
    return cache.replayssm_d, cache.replayssm_k


def commit_verified_states(
    linear_backend,
    last_correct_step_indices: torch.Tensor,
    mamba_track_indices: Optional[torch.Tensor],
    mamba_steps_to_track: Optional[torch.Tensor],
    req_pool_indices: Optional[torch.Tensor] = None,
) -> Optional[str]:
    """Commit through the plugin's kernels and return the name of the path that ran (the lazy
    record ring's commit, or ``replayssm_fold``); None when SGLang's own commit must run.

    ``linear_backend`` is the ``DSparkKDAAttnBackend`` whose verify just ran (its
    ``forward_metadata`` still describes the verify batch).
    """
    if not getattr(linear_backend, "last_verify_used_plugin", False):
        return None  # SGLang's verify ran: its commit must match
    lazy = getattr(linear_backend, "record_cursor", None) is not None  # (never with PP stable rows)
    # imported here: the commit's kernel paths (and their GPU tests) need no SGLang
    from sglang.srt.layers.attention.linear.utils import pp_spec_stable_rows_enabled

    if not lazy and pp_spec_stable_rows_enabled() and req_pool_indices is not None:
        return None
    pool = linear_backend.req_to_token_pool
    if not getattr(pool.mamba_pool, "replayssm_is_kda", False):
        return None  # snapshot mode: SGLang's scatter is exactly the snapshot commit

    caches = pool.get_speculative_mamba2_params_all_layers()
    num_requests = last_correct_step_indices.shape[0]
    slots = linear_backend.forward_metadata.mamba_cache_indices[:num_requests].to(torch.int32)
    rows = linear_backend.verify_intermediate_state_indices[:num_requests].to(torch.int32)
    accept_lens = (last_correct_step_indices + 1).to(torch.int32)
    track_slots = track_steps = None
    if mamba_track_indices is not None:
        track_slots = linear_backend._translate_mamba_indices(mamba_track_indices)
        track_slots = track_slots[:num_requests].to(torch.int32)
        track_steps = mamba_steps_to_track[:num_requests].to(torch.int32)
    if lazy:
        _commit_lazy_records(linear_backend.record_cursor, caches, slots, rows, accept_lens, track_slots,
                             track_steps, steps=linear_backend.num_draft_tokens)
        return "lazy records commit"
    replayssm_fold(
        caches.temporal,
        caches.replayssm_rawv,
        caches.replayssm_rawk,
        caches.replayssm_g,
        caches.replayssm_beta,
        slots,
        accept_lens,
        conv_state=caches.conv[0],
        intermediate_conv=caches.intermediate_conv_window[0],
        intermediate_rows=rows,
        track_slot_indices=track_slots,
        track_steps=track_steps,
    )
    if track_slots is not None:
        # The fold wrote the track slot's state; its conv window comes from the same step.
        copy_conv_windows(caches.conv[0], caches.intermediate_conv_window[0], track_slots, rows, track_steps)
    return "replayssm_fold"


def _commit_lazy_records(cursor, caches, slots, rows, accept_lens, track_slots, track_steps, *, steps: int) -> None:
    """The lazy record ring's commit, all layers: one launch for the cursor advance and the conv
    roll to the last accepted token (and the radix track snapshot's conv window and cursor reset),
    one more for the track snapshot's state, materialised from the checkpoint and the records.
    Few host ops: the served model is partly host-bound (docs/design/lazy-record-ring.md)."""
    track = commit_records(cursor, slots, accept_lens, caches.conv[0], caches.intermediate_conv_window[0], rows,
                           steps=steps, ring_len=caches.replayssm_rawk.shape[-2], track_slot_indices=track_slots,
                           track_steps=track_steps)
    if track is not None:
        counts, dst = track
        materialize_records(caches.temporal, caches.replayssm_rawk, caches.replayssm_g, caches.replayssm_beta,
                            delta_ring(caches), slots, counts, dst)
