"""Real SGLang objects for model-free tests: a KDA model runner with SGLang's own
``HybridReqToTokenPool`` (mamba pool with conv/temporal state, verify intermediates or
ReplaySSM rings) and token pool, as SGLang's test kits build them
(``sglang.test.kits.attention_unittest``), but for Kimi's real KDA geometry
(head_dim 128, conv width 4) and a ``KimiLinearConfig`` so that SGLang's
``kimi_linear_config()`` recognises the model.

Nothing of SGLang is mocked except the model runner shell itself (a ``ModelRunner`` subclass
whose ``__init__`` sets the fields the attention backends read).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch

from sglang.srt.configs.kimi_linear import KimiLinearConfig
from sglang.srt.configs.mamba_utils import (
    KimiLinearCacheParams,
    KimiLinearStateShape,
    Mamba2StateDType,
)
from sglang.srt.configs.model_config import AttentionArch
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool
from sglang.srt.model_executor.cuda_graph_config import Backend, CudaGraphConfig, PhaseConfig
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.runtime_context import get_context, get_parallel
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_dspark_plugin.settings import HEAD_DIM

_parallel = get_parallel().override(attn_tp_size=1, attn_dcp_rank=0, attn_dcp_size=1, attn_tp_rank=0)
_parallel.__enter__()


def tiny_kimi_hf_config(num_heads: int = 2, lower_bound: float | None = None) -> KimiLinearConfig:
    """A 2-layer Kimi-Linear config (layer 0 KDA, layer 1 MLA), as SGLang parses one."""
    linear = {
        "kda_layers": [1],
        "full_attn_layers": [2],
        "num_heads": num_heads,
        "head_dim": HEAD_DIM,
        "short_conv_kernel_size": 4,
    }
    if lower_bound is not None:
        linear["gate_lower_bound"] = lower_bound
    return KimiLinearConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=HEAD_DIM,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mla_use_nope=True,
        num_experts=4,
        num_experts_per_token=2,
        moe_intermediate_size=64,
        num_shared_experts=1,
        first_k_dense_replace=2,
        linear_attn_config=linear,
    )


class TinyModelConfig:
    """The ``ModelConfig`` fields the attention backends read."""

    def __init__(self, hf_config, num_heads: int, context_len: int):
        self.attention_arch = AttentionArch.MHA
        self.context_len = context_len
        self.num_attention_heads = num_heads
        self.num_key_value_heads = num_heads
        self.head_dim = HEAD_DIM
        self.v_head_dim = HEAD_DIM
        self.swa_v_head_dim = HEAD_DIM
        self.is_encoder_decoder = False
        self.is_multimodal = False
        self.model_is_mrope = False
        self.is_generation = True
        self.is_draft_model = False
        self.quantization = None
        self.is_hybrid_swa = False
        self.is_local_attention_model = False
        self.attention_chunk_size = None
        self.sliding_window_size = None
        self.hf_config = hf_config
        self.hf_text_config = hf_config
        self.linear_attn_registry_result = None

    def get_max_num_attention_heads(self) -> int:
        return self.num_attention_heads

    def get_num_kv_heads(self, tp_size: int, dcp_size: int = 1) -> int:
        return self.num_key_value_heads


class KDARunner(ModelRunner):
    """A model-runner shell around SGLang's real pools for one KDA layer (layer id 0)."""

    def __init__(
        self,
        *,
        backend: str = "dspark",
        num_heads: int = 2,
        pool_size: int = 4,
        num_draft_tokens: int = 0,
        replayssm: bool = False,
        decode_ring: bool = False,
        ring_len: int = 16,
        hf_config=None,
        device: str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        max_context_len: int = 64,
        disable_radix_cache: bool = False,
        server_args: Optional[dict] = None,
    ):
        """``server_args``: more SGLang server arguments for the published config (a serving mode
        such as ``disaggregation_mode="decode"``), over the ones set here."""
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = dtype
        self.kv_cache_dtype_str = "auto"
        self.prefill_attention_backend_str = backend
        self.decode_attention_backend_str = backend
        self.draft_attention_backend = None
        self.gpu_id = 0
        self.spec_algorithm = (
            SpeculativeAlgorithm.DSPARK if num_draft_tokens else SpeculativeAlgorithm.NONE
        )
        self.canary_manager = None
        self.page_size = 1
        hf_config = hf_config if hf_config is not None else tiny_kimi_hf_config(num_heads)
        self.model_config = TinyModelConfig(hf_config, num_heads, max_context_len)
        fields = dict(
            attention_backend=backend,
            chunked_prefill_size=-1,
            disable_radix_cache=disable_radix_cache,
            cuda_graph_config=CudaGraphConfig(
                decode=PhaseConfig(backend=Backend.DISABLED),
                prefill=PhaseConfig(backend=Backend.DISABLED),
            ),
            dllm_algorithm=None,
            dllm_algorithm_config=None,
            enable_deterministic_inference=False,
            enable_mis=False,
            linear_attn_backend="triton",
            linear_attn_decode_backend=None,
            linear_attn_prefill_backend=None,
            linear_attn_verify_backend=None,
            enable_linear_replayssm_spec=replayssm,
            enable_linear_replayssm=decode_ring,
            linear_replayssm_cache_len=ring_len,
            max_running_requests=None,
            revision=None,
            speculative_algorithm="DSPARK" if num_draft_tokens else None,
            speculative_eagle_topk=1 if num_draft_tokens else 0,
            speculative_num_draft_tokens=num_draft_tokens,
            speculative_num_steps=1 if num_draft_tokens else 0,
            triton_attention_num_kv_splits=8,
            triton_attention_split_tile_size=None,
            _mamba_cache_chunk_size=64,
        )
        fields.update(server_args or {})
        self._server_args_override = get_context().override_server_args(**fields)
        self.server_args = self._server_args_override.install()
        shape = KimiLinearStateShape.create(
            tp_world_size=1,
            num_heads=num_heads,
            head_dim=HEAD_DIM,
            conv_kernel_size=4,
            num_spec=max(num_draft_tokens - 1, 0),
        )
        cache_params = KimiLinearCacheParams(
            shape=shape,
            layers=[0],
            dtype=Mamba2StateDType(conv=dtype, temporal=torch.float32),
        )
        self.req_to_token_pool = HybridReqToTokenPool(
            size=pool_size,
            mamba_size=pool_size,
            mamba_spec_state_size=pool_size,
            max_context_len=max_context_len,
            device=device,
            enable_memory_saver=False,
            cache_params=cache_params,
            mamba_layer_ids=[0],
            enable_mamba_extra_buffer=False,
            speculative_num_draft_tokens=num_draft_tokens or None,
            enable_overlap_schedule=False,
            enable_linear_replayssm_spec=replayssm,
            enable_linear_replayssm=decode_ring,
            linear_replayssm_cache_len=ring_len,
        )
        self.token_to_kv_pool = MHATokenToKVPool(
            size=pool_size * max_context_len + 2,
            page_size=1,
            dtype=dtype,
            head_num=num_heads,
            head_dim=HEAD_DIM,
            layer_num=1,
            device=device,
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        self.token_to_kv_pool_allocator = SimpleNamespace(page_size=1)
        self.is_draft_worker = False
        self.init_kv_index_translator()
        self.attention_chunk_size = None
        self.hisparse_coordinator = None
        self.init_new_workspace = False
        self.is_hybrid_swa = False
        self.sliding_window_size = None
        self.use_mla_backend = False
        self._kernel_warmed_up = True

    def close(self) -> None:
        self._server_args_override.restore()


# --- forward batches ------------------------------------------------------------------------------


def bind_requests(runner: KDARunner, num_requests: int, prefix_len: int = 4):
    """Map request-pool rows 0..n-1 to mamba slots 1..n and give them KV locations."""
    device = runner.device
    req_pool_indices = torch.arange(num_requests, dtype=torch.int32, device=device)
    pool = runner.req_to_token_pool
    pool.req_index_to_mamba_index_mapping[req_pool_indices] = torch.arange(
        1, num_requests + 1, dtype=torch.int32, device=device
    )
    for r in range(num_requests):
        pool.req_to_token[r, : prefix_len + 16] = torch.arange(
            1 + r * 32, 1 + r * 32 + prefix_len + 16, dtype=pool.req_to_token.dtype
        )
    return req_pool_indices


def make_forward_batch(runner, mode, req_pool_indices, token_counts, prefix_len=4, spec_info=None):
    """A real ``ForwardBatch`` for ``mode`` with ``token_counts[i]`` tokens of request i."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    device = runner.device
    bs = len(token_counts)
    total = int(sum(token_counts))
    seq_lens = [prefix_len + (1 if mode.is_decode() else 0)] * bs
    positions = torch.cat(
        [torch.arange(prefix_len, prefix_len + n, dtype=torch.int64) for n in token_counts]
    ).to(device)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.arange(total, dtype=torch.int64, device=device),
        req_pool_indices=req_pool_indices,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        out_cache_loc=torch.arange(1, total + 1, dtype=torch.int64, device=device),
        seq_lens_sum=sum(seq_lens),
        positions=positions,
    )
    runner.kv_index_translator.bind_own_plan(batch)
    batch.spec_info = spec_info
    return batch


def dflash_verify_input(batch, draft_token_num: int, verify_lens=None, graph_num_tokens=None):
    """DSPARK's verify input (``DFlashVerifyInput``); ``verify_lens`` makes it compact/ragged."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput
    from sglang.srt.speculative.ragged_verify import RaggedVerifyLayout

    layout = None
    if verify_lens is not None:
        lens = torch.tensor(verify_lens, dtype=torch.int32, device=batch.input_ids.device)
        indptr = torch.zeros(len(verify_lens) + 1, dtype=torch.int32, device=lens.device)
        indptr[1:] = torch.cumsum(lens, 0)
        layout = RaggedVerifyLayout(
            verify_lens=lens,
            graph_num_tokens=graph_num_tokens or int(sum(verify_lens)),
            extend_start_loc=indptr[:-1].clone(),
            qo_indptr_device=indptr,
            verify_lens_cpu=list(verify_lens),
            total_verify_tokens=int(sum(verify_lens)),
            cap=draft_token_num,
        )
    return DFlashVerifyInput(
        draft_token=batch.input_ids,
        positions=batch.positions,
        draft_token_num=draft_token_num,
        topk=1,
        custom_mask=None,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        ragged_verify_layout=layout,
    )
