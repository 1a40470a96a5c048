"""The plugin's KDA attention backend: routing of the linear (KDA) layers per forward mode.

``plugin.py`` makes SGLang build ``DSparkHybridLinearAttnBackend(full, DSparkKDAAttnBackend, ...)``
for Kimi-style models served with ``--attention-backend dspark``. Per forward mode:

| forward mode (SGLang)        | path                                                            |
|------------------------------|-----------------------------------------------------------------|
| TARGET_VERIFY, num_spec >= 1 | ``layout.densify_verify_batch`` -> ``kernels.mtp_verify`` (ring mode under ``--enable-linear-replayssm-spec``, snapshot mode otherwise) -> back to SGLang's token order |
| DECODE (num_spec == 0)       | ``kernels.decode`` (conv + recurrence, in place; buffered in SGLang's decode ring under ``--enable-linear-replayssm``) + SGLang's radix track bookkeeping |
| EXTEND / prefill             | SGLang's own chunked prefill (``KDAAttnBackend.forward_extend``) |
| commit after verify          | ``commit.commit_verified_states`` (lazy record ring: cursor advance + conv roll; ReplaySSM fold; or SGLang's snapshot scatter) |

Lazy record ring (``--enable-linear-replayssm-spec``, docs/design/lazy-record-ring.md): where it is safe
(:meth:`DSparkKDAAttnBackend._lazy_records_off_reason`), the pool's state is a checkpoint and the
rings keep records of the accepted tokens since; the verify rebuilds its start state from them and
flushes inside its state pass, and the commit only moves a per-slot cursor. The cursor
(``mamba_pool.dspark_record_cursor``, allocated here, with the marker ``dspark_lazy_records`` on the
pool so that every backend on the pool agrees) is reset in stream order by every prefill of its
slot (:meth:`DSparkKDAAttnBackend._restart_records`): a slot becomes a request's working slot only
through a prefill, and only working slots' cursors are read. It is not SGLang's decode cursor
``replayssm_write_pos``: with that allocated, SGLang's ``HybridReqToTokenPool.alloc`` zeroes it at
a 0-dim CUDA index, an ``.item()`` host sync per admitted request that stalls the overlap
scheduler (docs/design/lazy-record-ring.md). The corrected deltas go to
the pool's ``replayssm_d`` / ``replayssm_k``, which SGLang allocates and leaves unused under the
speculative ring.

Kimi-K3's output gate: a K3 KDA layer with 12 heads per rank offers its ``o_norm`` gate to the
backend for decode and verify forwards (``layer._k3_onorm_gate``; ``o_norm``'s weight and eps in
``layer._k3_fused_decode_args[5:7]``) and skips its own ``o_norm`` kernel when the backend marks it
consumed (``layer._k3_onorm_consumed``; SGLang's ``kimi_k3.py``). The backend passes it to the
kernels, which apply the gated RMSNorm in their epilogue, and marks it consumed; anything outside
the kernels' contract, or ``SGLANG_DSPARK_OUTPUT_GATE=0``, leaves it to the model (logged once).

Layers the fast path cannot take (head_dim != 128, unequal q/k/v head counts, conv width != 4,
conv bias, non-fp32 recurrent state, fp16 activations, tree verify with topk > 1, FlashInfer
fused-accept verify)
run SGLang's parent implementation, with one warning per process naming the reason.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
from sglang.srt.layers.attention.linear.utils import select_verify_intermediate_state_indices
from sglang.srt.runtime_context import get_spec

from .commit import commit_verified_states, delta_ring
from .errors import dspark_error
from .kernels import decode, mtp_verify
from .kernels.mtp_verify import gluon_stream_supported
from .layout import as_dense_beta, as_dense_heads, densify_verify_batch, split_mixed_qkv
from .settings import (ACTIVATION_DTYPES, CONV_WIDTH, HEAD_DIM, LAZY_RECORDS_ENV, LAZY_RECORDS_MAX_WINDOW,
                       LAZY_RECORDS_TESTED_WINDOW, OUTPUT_GATE_ENV, buffered_decode_impl, lazy_records_any_window,
                       lazy_records_enabled, lazy_records_setting, output_gate_enabled, verify_impl)

logger = logging.getLogger("sglang_dspark_plugin")

_warned_reasons: set[str] = set()


def _warn_fallback_once(reason: str) -> None:
    if reason not in _warned_reasons:
        _warned_reasons.add(reason)
        logger.warning("dspark: KDA layers fall back to SGLang's own KDA path: %s", reason)


_kernels_in_use: set[str] = set()


def _log_kernel_first_use(kernel: str) -> None:
    """One INFO line per process the first time a plugin kernel path runs (under CUDA graphs: when
    it is captured). Served tests assert on it: the plugin's kernels really ran."""
    if kernel not in _kernels_in_use:
        _kernels_in_use.add(kernel)
        logger.info("dspark: KDA kernel in use: %s", kernel)


_logged_once: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged_once:
        _logged_once.add(message)
        logger.info(message)


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def _layer_state_args(layer, cache) -> dict:
    """Kernel arguments shared by decode and verify: the layer's weights and its pool state."""
    return dict(
        conv_weight=layer.conv_weights,
        A_log=layer.A_log,
        dt_bias=layer.dt_bias,
        lower_bound=layer.lower_bound,
        scale=layer.head_k_dim**-0.5,
        ssm_state=cache.temporal,
        conv_state=cache.conv[0],
    )


def output_gate_off_reason(layer, gate, num_tokens: int) -> Optional[str]:
    """Why the output gate a Kimi-K3 layer offers (``gate``, its ``_k3_onorm_gate``) cannot go to
    the kernels for a forward of ``num_tokens`` tokens, or None. The model then applies its own
    ``o_norm``, as with SGLang's backend."""
    if not output_gate_enabled():
        return f"{OUTPUT_GATE_ENV}=0"
    static = getattr(layer, "_k3_fused_decode_args", None)
    if not isinstance(static, tuple) or len(static) != 7:
        return "the layer published no o_norm weight and eps (_k3_fused_decode_args)"
    weight, eps = static[5], static[6]
    if (not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (HEAD_DIM,)
            or weight.dtype not in ACTIVATION_DTYPES or weight.stride(0) != 1):
        return f"o_norm weight {getattr(weight, 'shape', None)} / {getattr(weight, 'dtype', None)} (expected [128] fp32)"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        return f"o_norm eps {eps!r}"
    width = layer.num_v_heads * HEAD_DIM
    if (not isinstance(gate, torch.Tensor) or gate.dim() != 2 or tuple(gate.shape) != (num_tokens, width)
            or gate.stride(-1) != 1 or gate.dtype not in ACTIVATION_DTYPES):
        return (f"gate {getattr(gate, 'shape', None)} / {getattr(gate, 'dtype', None)} "
                f"(expected [{num_tokens}, {width}] bf16 with contiguous channels)")
    return None


def layer_fallback_reason(layer, cache) -> Optional[str]:
    """Why a KDA layer (``RadixLinearAttention``) with its pool state is outside the kernels'
    contract, or None: the part of the fallback check that holds for every forward."""
    dims = (layer.head_q_dim, layer.head_k_dim, layer.head_v_dim)
    if any(d != HEAD_DIM for d in dims):
        return f"head_dim {dims} != {HEAD_DIM}"
    if not layer.num_q_heads == layer.num_k_heads == layer.num_v_heads:
        return (
            f"unequal q/k/v head counts ({layer.num_q_heads}, {layer.num_k_heads}, "
            f"{layer.num_v_heads})"
        )
    if layer.conv_weights.shape[-1] != CONV_WIDTH:
        return f"conv width {layer.conv_weights.shape[-1]} != {CONV_WIDTH}"
    if layer.bias is not None:
        return "conv bias is set"
    if cache.temporal.shape[-3] != layer.num_v_heads or cache.conv[0].shape[-1] != layer.conv_weights.shape[0]:
        # e.g. data-parallel attention, where SGLang shards Kimi-Linear's KDA layer over the
        # TP group but sizes the state pool by the attention-TP group
        return (
            f"state pool for {cache.temporal.shape[-3]} heads / {cache.conv[0].shape[-1]} conv channels, "
            f"layer with {layer.num_v_heads} heads / {layer.conv_weights.shape[0]} channels"
        )
    state_dtype = cache.temporal.dtype
    if state_dtype != torch.float32:
        return f"recurrent state dtype {state_dtype} (the dspark kernels keep fp32 state)"
    return None


def _serving_mode_off_reason() -> Optional[str]:
    """Why the server's scheduling mode keeps the lazy record ring off, or None. The ring needs
    every request's first forward on its slot to be an extend of this backend, ordered on one
    stream after the slot's previous owner's last commit, and the commit to run on the backend
    whose verify wrote the records."""
    from sglang.srt.runtime_context import get_disagg, get_exec, get_parallel, get_schedule, get_serving

    disagg = get_disagg()
    mode = disagg.disaggregation_mode or "null"
    if mode == "decode":
        return ("PD disaggregation, decode side (a request's first forward here is PREBUILT, not an extend: "
                "its state arrives from the prefill server and nothing restarts the slot's records)")
    if mode != "null":
        return (f"PD disaggregation, {mode} side (this server runs no verify, so the ring has nothing to "
                "defer; its slots' states go to the decode server as they are)")
    if disagg.enable_pdmux:
        return ("PD multiplexing (--enable-pdmux: prefills run on their own stream beside the decode stream, "
                "so a prefill's cursor reset is not ordered after the slot's previous owner's commit)")
    if get_exec().overlap.enable_two_batch_overlap:  # (TBO wraps the target's backends only, as this one)
        return ("two-batch overlap (--enable-two-batch-overlap: the verify runs on TBO's two child backends "
                "and the commit on its primary backend, which did not run that verify)")
    if (get_parallel().pp_size or 1) > 1:
        return "pipeline parallelism (SGLang commits stable rows itself)"
    if get_schedule().enable_mixed_chunk:
        return ("mixed chunks (--enable-mixed-chunk: a running request's extend would start from a "
                "checkpoint with pending records)")
    if get_serving().enable_streaming_session:
        return ("streaming sessions (--enable-streaming-session: a session's next turn extends its slot "
                "from a checkpoint with pending records)")
    if (get_spec().speculative_eagle_topk or 1) > 1:
        return "tree verify (speculative topk > 1)"
    return None


class DSparkKDAAttnBackend(KDAAttnBackend):
    """KDA backend for ``--attention-backend dspark``: dense MTP verify, decode, ReplaySSM."""

    # Compact (ragged) verify is densified with shapes fixed per captured bucket and no host sync.
    supports_ragged_verify_graph: bool = True
    needs_cpu_seq_lens: bool = False

    def __init__(self, model_runner):
        super().__init__(model_runner)
        spec = get_spec()
        # N = 1 + num_spec tokens per verified request; SGLang resolves it from
        # --speculative-dspark-block-size (gamma) as gamma + 1.
        self.num_draft_tokens: Optional[int] = (
            spec.speculative_num_draft_tokens if spec.speculative_algorithm else None
        )
        block_size = getattr(spec, "speculative_dspark_block_size", None)
        if block_size and self.num_draft_tokens and block_size + 1 != self.num_draft_tokens:
            raise dspark_error(
                "DSPARK-E207",
                "--speculative-dspark-block-size",
                expected=f"gamma + 1 == speculative_num_draft_tokens ({self.num_draft_tokens})",
                got=f"gamma = {block_size}",
                fix="set only --speculative-dspark-block-size (SGLang derives the draft token count "
                "from it), or make --speculative-num-draft-tokens equal gamma + 1",
            )
        # The buffered decode kernel (SGLANG_DSPARK_BUFFERED_DECODE), read once: a bad value stops
        # the server at start, not at its first decode ring step.
        self.buffered_decode_impl = buffered_decode_impl()
        lazy_records_enabled()  # likewise SGLANG_DSPARK_LAZY_RECORDS, read again where the ring is decided
        output_gate_enabled()  # and SGLANG_DSPARK_OUTPUT_GATE
        # SGLANG_DSPARK_VERIFY_IMPL: with "gluon", ring verifies without the lazy ring take the Hopper
        # stream where the pool allows it (decided at the first such verify: device and pool layout
        # do not change)
        self.verify_impl = verify_impl()
        self._gluon_stream: Optional[bool] = None
        # The fused output gate's arrival counters ([requests * heads] int32 zeros, which the verify
        # kernels leave zero): sized for the CUDA-graph batch in init_cuda_graph_state, grown here
        # otherwise (outside a capture).
        self.output_gate_counters: Optional[torch.Tensor] = None
        # Which verify implementation ran last: the commit must match it.
        self.last_verify_used_plugin = False
        # The lazy record ring's cursor (the pool's dspark_record_cursor), or None: fold every commit.
        self.record_cursor: Optional[torch.Tensor] = None
        self._init_lazy_records(model_runner)

    # --- lazy record ring -----------------------------------------------------------------------

    def _lazy_records_off_reason(self, mamba_pool, model_runner) -> Optional[str]:
        """Why the lazy record ring cannot run here, or None. Every condition is one of
        docs/design/lazy-record-ring.md's: a path that would read a slot's state behind the plugin's back, or
        a KDA layer whose verify and commit would be SGLang's (they cannot continue from records)."""
        if not lazy_records_enabled():
            return f"{LAZY_RECORDS_ENV}={lazy_records_setting()}"
        from sglang.srt.layers.attention.linear.utils import pp_spec_stable_rows_enabled
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
        from sglang.srt.mem_cache.memory_pool import MambaPool

        if type(mamba_pool) is not MambaPool:
            return f"pool type {type(mamba_pool).__name__} (the lazy ring is checked on SGLang's MambaPool only)"
        if getattr(mamba_pool, "replayssm_write_pos", None) is not None:
            return "SGLang's decode ring is on (its replayssm_write_pos is allocated; it uses the delta rings)"
        model = getattr(model_runner, "model", None)
        for layer in model.modules() if isinstance(model, torch.nn.Module) else ():
            if isinstance(layer, RadixLinearAttention):
                reason = layer_fallback_reason(layer, self.req_to_token_pool.mamba2_layer_cache(layer.layer_id))
                if reason is not None:
                    return f"KDA layer {layer.layer_id} falls back to SGLang's path ({reason})"
        dtype = getattr(model_runner, "dtype", None)
        if isinstance(dtype, torch.dtype) and dtype not in ACTIVATION_DTYPES:
            return f"activation dtype {dtype} (the dspark kernels take bf16 or fp32)"
        if pp_spec_stable_rows_enabled():
            return "pipeline-parallel stable rows (SGLang commits them itself)"
        cache = mamba_pool.mamba_cache
        rawk, d, k = cache.replayssm_rawk, cache.replayssm_d, cache.replayssm_k
        if d is None or k is None or d.shape != rawk.shape or k.shape != rawk.shape or d.stride() != k.stride():
            return "the pool has no spare replayssm_d / replayssm_k rings of the records' shape"
        if d.dtype != torch.float32 and (d.element_size() != 2 or k.element_size() != 2):
            return f"replayssm_d dtype {d.dtype} (fp32, or two 16-bit rings, hold the fp32 deltas)"
        if cache.temporal.dtype != torch.float32:
            return f"recurrent state dtype {cache.temporal.dtype}"
        if self.accept_lens_pool is not None:
            return "FlashInfer fused-accept verify backend selected"
        if self.num_draft_tokens > LAZY_RECORDS_MAX_WINDOW and not lazy_records_any_window():
            return (f"windows of {self.num_draft_tokens} tokens (its verify is slower than verify + fold "
                    f"above {LAZY_RECORDS_MAX_WINDOW} on the H200: docs/design/lazy-record-ring.md; "
                    f"{LAZY_RECORDS_ENV}=all turns it on)")
        if self.num_draft_tokens > LAZY_RECORDS_TESTED_WINDOW:
            return f"windows of {self.num_draft_tokens} tokens (the lazy kernels are tested up to {LAZY_RECORDS_TESTED_WINDOW})"
        if rawk.shape[-2] < 2 * self.num_draft_tokens:
            return f"ring length {rawk.shape[-2]} < 2 windows"
        reason = _serving_mode_off_reason()
        if reason is not None:
            return reason
        from sglang.srt.runtime_context import get_memory

        if not getattr(self.req_to_token_pool, "enable_mamba_extra_buffer", False) and not get_memory().disable_radix_cache:
            return ("no_buffer radix cache (SGLang's finish path would cache the checkpoint under a key "
                    "shortened by the pending records, with the latest conv window)")
        return None

    def _init_lazy_records(self, model_runner) -> None:
        mamba_pool = getattr(self.req_to_token_pool, "mamba_pool", None)
        if self.num_draft_tokens is None or not getattr(mamba_pool, "replayssm_is_kda", False):
            return  # no speculative KDA ring: nothing to decide
        decided = getattr(mamba_pool, "dspark_lazy_records", None)
        if decided is not None:  # another backend on the same pool decided: verify and commit must agree
            self.record_cursor = mamba_pool.dspark_record_cursor if decided else None
            return
        reason = self._lazy_records_off_reason(mamba_pool, model_runner)
        mamba_pool.dspark_lazy_records = reason is None
        if reason is not None:
            logger.info("dspark: lazy record ring off: %s; every commit folds the accepted tokens", reason)
            return
        temporal = mamba_pool.mamba_cache.temporal
        mamba_pool.dspark_record_cursor = torch.zeros(temporal.shape[1], dtype=torch.int32, device=temporal.device)
        self.record_cursor = mamba_pool.dspark_record_cursor
        logger.info("dspark: lazy record ring on (ring length %d)", mamba_pool.mamba_cache.replayssm_rawk.shape[-2])

    def _restart_records(self, forward_batch) -> None:
        """A prefill starts its slots' records afresh, in stream order (after any in-flight commit of
        the slot's previous owner under the overlap scheduler, and after a prefix-cache copy into
        the slot): the cursor's only reset, since a slot becomes a request's working slot only
        through a prefill. Extends never continue from pending records here (mixed chunks and
        streaming sessions keep the lazy ring off). Called from every eager metadata hook of an
        extend: the eager path, the breakable prefill graph's refresh and the full graph's."""
        mode = forward_batch.forward_mode
        # (is_extend() includes the target verify, and leaves out the draft's extend)
        if self.record_cursor is None or not mode.is_extend() or mode.is_target_verify():
            return
        slots = self._translate_mamba_indices(self.req_to_token_pool.get_mamba_indices(forward_batch.req_pool_indices))
        self.record_cursor.index_fill_(0, slots.clamp(min=0).long(), 0)  # not `[i] = 0`: a host copy, a sync

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self._restart_records(forward_batch)

    def refresh_prefill_graph_metadata(self, meta, forward_batch) -> None:
        super().refresh_prefill_graph_metadata(meta, forward_batch)
        self._restart_records(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if not in_capture:
            self._restart_records(forward_batch)

    # --- routing ------------------------------------------------------------------------------

    def _fallback_reason(self, layer, mixed_qkv, cache, *, verify: bool) -> Optional[str]:
        if not isinstance(mixed_qkv, torch.Tensor):
            return "mixed_qkv is not one tensor"
        if mixed_qkv.dtype not in ACTIVATION_DTYPES:
            return f"activation dtype {mixed_qkv.dtype} (the dspark kernels take bf16 or fp32)"
        reason = layer_fallback_reason(layer, cache)
        if reason is None and verify:
            if self.forward_metadata.retrieve_parent_token is not None:
                return "tree verify (speculative topk > 1)"
            if self.accept_lens_pool is not None:
                return "FlashInfer fused-accept verify backend selected"
        return reason

    def _check_window(self, draft_token_num: int) -> None:
        if self.num_draft_tokens is not None and draft_token_num != self.num_draft_tokens:
            raise dspark_error(
                "DSPARK-E208",
                "spec_info.draft_token_num",
                expected=f"{self.num_draft_tokens} (1 + --speculative-dspark-block-size)",
                got=str(draft_token_num),
                fix="every verify batch must use the configured block size; restart the server "
                "with the draft's block size in --speculative-dspark-block-size",
            )

    # --- Kimi-K3 output gate --------------------------------------------------------------------

    def _output_gate(self, layer, num_tokens: int):
        """The gate the layer offers for this forward when the kernels can apply it (a
        ``[num_tokens, H*128]`` tensor), else None: no offer (not a K3 layer with 12 heads per
        rank), or a reason to leave it to the model (logged once)."""
        gate = getattr(layer, "_k3_onorm_gate", None)
        if gate is None:
            return None
        reason = output_gate_off_reason(layer, gate, num_tokens)
        if reason is not None:
            _log_once(f"dspark: Kimi-K3 output gate left to the model's o_norm: {reason}")
            return None
        return gate

    @staticmethod
    def _output_gate_kwargs(layer, gate: torch.Tensor) -> dict:
        """The kernels' output gate arguments for a dense ``[1, T, H, 128]`` ``gate``."""
        static = layer._k3_fused_decode_args
        return dict(output_gate=gate, output_norm_weight=static[5], output_norm_eps=float(static[6]))

    def _output_gate_workspace(self, num_requests: int, heads: int) -> Optional[torch.Tensor]:
        counters = self.output_gate_counters
        if counters is None or counters.numel() < num_requests * heads:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return None  # no allocation of ours in a capture: the kernel allocates its own
            device = self.req_to_token_pool.mamba_pool.mamba_cache.temporal.device
            counters = torch.zeros(max(num_requests, 1) * heads, dtype=torch.int32, device=device)
            self.output_gate_counters = counters
        return counters

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        mamba_pool = getattr(self.req_to_token_pool, "mamba_pool", None)
        if mamba_pool is not None:
            self._output_gate_workspace(max_bs, mamba_pool.mamba_cache.temporal.shape[-3])

    # --- DECODE (num_spec == 0) -----------------------------------------------------------------

    def forward_decode(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
        if self.record_cursor is not None:
            # SGLang's DSPARK worker runs no plain DECODE forward of the target; one would update
            # the checkpoint in place and skip the slot's pending records
            raise dspark_error(
                "DSPARK-E209", f"KDA layer {layer.layer_id}",
                expected="no plain DECODE forward of the target under the lazy record ring",
                got="a DECODE forward", fix=f"set {LAZY_RECORDS_ENV}=0 for this deployment",
            )
        cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
        reason = self._fallback_reason(layer, mixed_qkv, cache, verify=False)
        fm = self.forward_metadata
        # SGLang's decode ring (--enable-linear-replayssm): the pool state is a checkpoint and the
        # ring buffers the tokens since; SGLang snapshots and advances the per-request cursor.
        # (Under --enable-linear-replayssm-spec the pool also has replayssm_d, unused by decode.)
        ring = cache.replayssm_d is not None and self.num_draft_tokens is None
        if reason is None and ring and getattr(fm, "replayssm_write_pos", None) is None:
            reason = "ReplaySSM decode ring without a write_pos in the forward metadata"
        if reason is not None:
            _warn_fallback_once(reason)
            return super().forward_decode(layer, forward_batch, mixed_qkv, a, b, **kwargs)

        num_tokens, heads = mixed_qkv.shape[0], layer.num_v_heads
        slots = fm.mamba_cache_indices
        buffered = {}
        if ring:
            buffered = dict(
                ring_d=cache.replayssm_d,
                ring_k=cache.replayssm_k,
                ring_g=cache.replayssm_g,
                write_pos=_as_int32(fm.replayssm_write_pos[:num_tokens]),
                force_flush=None if fm.replayssm_force_flush is None else _as_int32(fm.replayssm_force_flush[:num_tokens]),
                impl=self.buffered_decode_impl,
            )
        q, k, v = split_mixed_qkv(mixed_qkv, heads)
        gate = self._output_gate(layer, num_tokens)
        gate_kwargs = {} if gate is None else self._output_gate_kwargs(
            layer, as_dense_heads(gate, "output_gate", num_tokens, heads))
        out = decode(
            q, k, v,
            as_dense_heads(a, "a (gate input)", num_tokens, heads),
            as_dense_beta(b, num_tokens, heads),
            slot_indices=_as_int32(slots[:num_tokens]),
            **_layer_state_args(layer, cache),
            **buffered,
            **gate_kwargs,
        )
        if gate is not None:
            layer._k3_onorm_consumed = True
        self._track_mamba_state_decode(
            forward_batch, cache.conv[0], cache.temporal, slots, layer.layer_id
        )
        kernel = f"decode (buffered, {self.buffered_decode_impl})" if ring else "decode"
        _log_kernel_first_use(kernel + (" + output gate" if gate is not None else ""))
        return out

    # --- TARGET_VERIFY ----------------------------------------------------------------------------

    def _forward_target_verify(self, layer, forward_batch, mixed_qkv, a, b):
        cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
        reason = self._fallback_reason(layer, mixed_qkv, cache, verify=True)
        if reason is not None and self.record_cursor is not None:
            raise dspark_error(
                "DSPARK-E209", f"KDA layer {layer.layer_id}",
                expected="the plugin's verify on every KDA layer under the lazy record ring",
                got=f"a fallback to SGLang's verify ({reason})",
                fix=f"set {LAZY_RECORDS_ENV}=0 (every commit folds; SGLang's verify and commit then run for "
                "such layers)",
            )
        if reason is not None:
            _warn_fallback_once(reason)
            self.last_verify_used_plugin = False
            return super()._forward_target_verify(layer, forward_batch, mixed_qkv, a, b)

        fm = self.forward_metadata
        spec_info = forward_batch.spec_info
        window = spec_info.draft_token_num
        self._check_window(window)
        gate = self._output_gate(layer, mixed_qkv.shape[0])
        batch = densify_verify_batch(
            mixed_qkv, a, b,
            num_heads=layer.num_v_heads,
            window=window,
            query_start_loc=fm.query_start_loc,
            ragged=getattr(spec_info, "ragged_verify_layout", None) is not None,
            output_gate=gate,
        )
        num_requests = batch.num_requests
        slots = _as_int32(fm.mamba_cache_indices[:num_requests])
        rows = select_verify_intermediate_state_indices(
            self.verify_intermediate_state_indices,
            forward_batch.req_pool_indices,
            slots >= 0,
            self.req_to_token_pool.size,
        )
        if cache.replayssm_rawv is not None:
            mode = dict(
                ring_rawv=cache.replayssm_rawv,
                ring_rawk=cache.replayssm_rawk,
                ring_g=cache.replayssm_g,
                ring_beta=cache.replayssm_beta,
            )
            if self.record_cursor is not None:
                mode.update(record_cursor=self.record_cursor, ring_delta=delta_ring(cache))
            elif self.verify_impl == "gluon":
                if self._gluon_stream is None:
                    self._gluon_stream = gluon_stream_supported(cache.temporal)
                if self._gluon_stream:
                    mode.update(impl="gluon")
        else:
            mode = dict(intermediate_ssm=cache.intermediate_ssm)
        if gate is not None:
            mode.update(self._output_gate_kwargs(layer, batch.output_gate),
                        output_gate_workspace=self._output_gate_workspace(num_requests, layer.num_v_heads))
        out = mtp_verify(
            batch.q, batch.k, batch.v, batch.a, batch.b,
            slot_indices=slots,
            cu_seqlens=batch.cu_seqlens,
            num_spec=window - 1,
            intermediate_conv=cache.intermediate_conv_window[0],
            intermediate_rows=_as_int32(rows[:num_requests]),
            **_layer_state_args(layer, cache),
            **mode,
        )
        self.last_verify_used_plugin = True
        if gate is not None:
            layer._k3_onorm_consumed = True
        kernel = ("mtp_verify (ring, lazy records)" if "record_cursor" in mode
                  else "mtp_verify (ring, gluon stream)" if mode.get("impl") == "gluon"
                  else "mtp_verify (ring)" if "ring_rawv" in mode else "mtp_verify (snapshot)")
        _log_kernel_first_use(kernel + (" + output gate" if gate is not None else ""))
        return batch.to_packed(out)


class DSparkHybridLinearAttnBackend(HybridLinearAttnBackend):
    """SGLang's full + linear hybrid, committing verified KDA state through the plugin."""

    def update_mamba_state_after_mtp_verify(
        self,
        last_correct_step_indices,
        mamba_track_indices,
        mamba_steps_to_track,
        model,
        req_pool_indices=None,
    ):
        linear = self.linear_attn_backend
        committed = commit_verified_states(
            linear,
            last_correct_step_indices,
            mamba_track_indices,
            mamba_steps_to_track,
            req_pool_indices,
        )
        if committed is not None:
            _log_kernel_first_use(committed)
        else:
            super().update_mamba_state_after_mtp_verify(
                last_correct_step_indices,
                mamba_track_indices,
                mamba_steps_to_track,
                model,
                req_pool_indices,
            )
