"""Verify-batch layout: SGLang's (possibly ragged) token batch <-> the dense ``[1, T, H, 128]``
layout of the MTP verify kernel (T = N·(1+num_spec), N requests, batch dim 1, head dim 128).

Where SGLang hands tensors over (per KDA layer, see docs/design/architecture.md):

- ``mixed_qkv [T_phys, 3·H·128]``: the pre-conv q|k|v projection; last dim contiguous, the row
  stride may be larger (a slice of a fused GEMM output);
- ``a``: ``[T_phys, H·128]`` (Kimi-Linear decode/verify) or ``[1, T_phys, H, 128]`` (K3, extend);
- ``b``: ``[1, T_phys, H]`` (or ``[T_phys, H]``).

In static and cap-accept modes ``T_phys == N·(1+num_spec)`` and the dense views are built
without copies. In compact mode (``SGLANG_RAGGED_VERIFY_MODE=compact``) request i brings
``verify_len_i <= 1+num_spec`` packed tokens: they are scattered into their step slots of a
zero-padded dense batch, and the outputs gathered back. Padded steps see zero inputs (finite
gates), cannot influence real tokens (causality) and are never committed (commit length <=
verify length). Shapes depend only on ``(T_phys, N, 1+num_spec)``, so every step is CUDA-graph
safe: fixed shapes per captured bucket, no host syncs.

Anything that cannot be converted raises a ``DSparkError`` (E2xx) saying what is wrong and how to
fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .errors import dspark_error
from .settings import HEAD_DIM


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def split_mixed_qkv(mixed_qkv: torch.Tensor, num_heads: int):
    """``[T, 3·H·128]`` -> three ``[1, T, H, 128]`` views (q, k, v), no copy."""
    width = 3 * num_heads * HEAD_DIM
    if mixed_qkv.dim() != 2 or mixed_qkv.shape[-1] != width:
        raise dspark_error(
            "DSPARK-E201",
            "mixed_qkv",
            expected=f"a 2-D [T, 3*H*128] = [T, {width}] tensor (q|k|v channels, H={num_heads})",
            got=f"shape {_shape(mixed_qkv)}",
            fix="pass the model's pre-conv projection as [T, q_dim+k_dim+v_dim]; a "
            "[1, T, D] tensor can be passed as x[0], a [T, 3, H, 128] one as x.flatten(1)",
        )
    if mixed_qkv.stride(-1) != 1:
        raise dspark_error(
            "DSPARK-E202",
            "mixed_qkv",
            expected="a contiguous last dimension (stride(-1) == 1)",
            got=f"strides {mixed_qkv.stride()}",
            fix="call mixed_qkv.contiguous() (a larger row stride is fine, a strided channel axis is not)",
        )
    heads = mixed_qkv.unflatten(-1, (3 * num_heads, HEAD_DIM))  # [T, 3H, 128], a view
    q, k, v = heads.split(num_heads, dim=1)
    return q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)


def as_dense_heads(x: torch.Tensor, name: str, num_tokens: int, num_heads: int) -> torch.Tensor:
    """Accept ``[T, H·128]``, ``[T, H, 128]`` or ``[1, T, H, 128]``; return ``[1, T, H, 128]``.

    ``name`` is how messages call the tensor, e.g. ``"a (gate input)"``; its first word is the
    variable name used in the fix."""
    target = (1, num_tokens, num_heads, HEAD_DIM)
    if tuple(x.shape) == target:
        return x
    if x.dim() == 2 and tuple(x.shape) == (num_tokens, num_heads * HEAD_DIM) and x.stride(-1) == 1:
        return x.unflatten(-1, (num_heads, HEAD_DIM)).unsqueeze(0)
    if x.dim() == 3 and tuple(x.shape) == (num_tokens, num_heads, HEAD_DIM):
        return x.unsqueeze(0)
    head_dim = x.shape[-1] if x.dim() in (3, 4) else None
    if head_dim is not None and head_dim != HEAD_DIM:
        raise dspark_error(
            "DSPARK-E203",
            name,
            expected=f"head_dim {HEAD_DIM}",
            got=f"shape {_shape(x)} (head_dim {head_dim})",
            fix="the dspark kernels are specialised for head_dim 128; other head sizes run on "
            "SGLang's generic KDA path (the backend falls back automatically for such layers)",
        )
    raise dspark_error(
        "DSPARK-E204",
        name,
        expected=f"(1, T, H, 128) = {target}, or [T, H*128] / [T, H, 128] with T={num_tokens}, H={num_heads}",
        got=f"shape {_shape(x)}",
        fix=f"reshape with {name.split()[0]}.view(1, {num_tokens}, {num_heads}, {HEAD_DIM}); check that T and H "
        "match mixed_qkv and the layer's head count",
    )


def as_dense_beta(b: torch.Tensor, num_tokens: int, num_heads: int) -> torch.Tensor:
    """Accept ``[1, T, H]`` or ``[T, H]``; return ``[1, T, H]``."""
    if tuple(b.shape) == (1, num_tokens, num_heads):
        return b
    if tuple(b.shape) == (num_tokens, num_heads):
        return b.unsqueeze(0)
    raise dspark_error(
        "DSPARK-E205",
        "b (beta logits)",
        expected=f"(1, T, H) = (1, {num_tokens}, {num_heads}) or [T, H]",
        got=f"shape {_shape(b)}",
        fix=f"pass b.view(1, {num_tokens}, {num_heads}); beta has one logit per token and head",
    )


def check_dense_token_count(num_tokens: int, num_requests: int, window: int) -> None:
    """Static / cap-accept verify: every request brings exactly ``window`` = 1+num_spec tokens."""
    if num_tokens != num_requests * window:
        raise dspark_error(
            "DSPARK-E206",
            "verify batch",
            expected=f"T = N*(1+num_spec) = {num_requests}*{window} = {num_requests * window} tokens "
            "(dense verify layout)",
            got=f"T = {num_tokens}",
            fix="T must be a multiple of the number of requests N; a ragged batch must carry "
            "spec_info.ragged_verify_layout (SGLANG_RAGGED_VERIFY_MODE=compact) so it is densified, "
            "and --speculative-dspark-block-size must match the draft's block size",
        )


def ragged_to_dense_index(query_start_loc: torch.Tensor, num_tokens: int, window: int) -> torch.Tensor:
    """Dense position of each packed token: ``row·window + step`` (int64 ``[num_tokens]``).

    Tokens outside the layout (past the last row, or past ``window`` in their row: a graph
    bucket's leftover tokens) map to the ghost position ``N·window``, whose values are never
    read back as real outputs.
    """
    num_requests = query_start_loc.shape[0] - 1
    ghost = num_requests * window
    pos = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    row = torch.searchsorted(query_start_loc[1:], pos, right=True)
    row_clamped = row.clamp(max=max(num_requests - 1, 0))
    step = (pos - query_start_loc[row_clamped]).to(torch.int64)
    dense = row.to(torch.int64) * window + step
    inside = (row < num_requests) & (step < window)
    return torch.where(inside, dense, torch.full_like(dense, ghost))


def scatter_rows(x: torch.Tensor, index: torch.Tensor, num_dense: int) -> torch.Tensor:
    """``x [T_phys, W] -> [num_dense, W]``: row i goes to ``index[i]``; unfilled rows are zero."""
    dense = x.new_zeros(num_dense + 1, x.shape[-1])  # +1: the ghost row
    dense.index_copy_(0, index, x)
    return dense[:num_dense]


def gather_rows(dense: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``[num_dense, ...] -> [T_phys, ...]``; tokens mapped to the ghost row get zeros."""
    ghost = dense.new_zeros((1,) + tuple(dense.shape[1:]))
    return torch.cat([dense, ghost], dim=0)[index]


@dataclass
class DenseVerifyBatch:
    """Kernel-ready verify inputs. ``index`` is None when the batch was already dense."""

    q: torch.Tensor  # [1, T, H, 128]
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor  # [1, T, H, 128]
    b: torch.Tensor  # [1, T, H]
    cu_seqlens: torch.Tensor  # [N+1] int32, arange(0, T+1, 1+num_spec)
    num_requests: int
    index: Optional[torch.Tensor]  # [T_phys] int64 dense position per packed token (compact)
    output_gate: Optional[torch.Tensor] = None  # [1, T, H, 128] (Kimi-K3's o_norm gate), when given

    def to_packed(self, out_dense: torch.Tensor) -> torch.Tensor:
        """Dense kernel output ``[1, T, H, 128]`` -> SGLang's ``[1, T_phys, H, 128]``."""
        if self.index is None:
            return out_dense
        return gather_rows(out_dense[0], self.index).unsqueeze(0)


def densify_verify_batch(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    num_heads: int,
    window: int,
    query_start_loc: torch.Tensor,
    ragged: bool,
    output_gate: Optional[torch.Tensor] = None,
) -> DenseVerifyBatch:
    """Build the dense ``[1, T, H, 128]`` verify batch from SGLang's verify tensors.

    ``window`` = 1+num_spec; ``query_start_loc [N+1]`` are SGLang's per-request token offsets;
    ``ragged`` is True when SGLang packed the requests (``spec_info.ragged_verify_layout``).
    ``output_gate`` (Kimi-K3's ``o_norm`` gate, ``[T_phys, H·128]``): laid out like the outputs.
    """
    num_requests = query_start_loc.shape[0] - 1
    num_tokens = mixed_qkv.shape[0]
    num_dense = num_requests * window
    index = None
    if ragged:
        index = ragged_to_dense_index(query_start_loc, num_tokens, window)
        a2 = as_dense_heads(a, "a (gate input)", num_tokens, num_heads)[0].flatten(1)
        b2 = as_dense_beta(b, num_tokens, num_heads)[0]
        mixed_qkv = scatter_rows(mixed_qkv, index, num_dense)
        a = scatter_rows(a2, index, num_dense)
        b = scatter_rows(b2, index, num_dense)
        if output_gate is not None:
            gate2 = as_dense_heads(output_gate, "output_gate", num_tokens, num_heads)[0].flatten(1)
            output_gate = scatter_rows(gate2, index, num_dense)
        num_tokens = num_dense
    else:
        check_dense_token_count(num_tokens, num_requests, window)
    q, k, v = split_mixed_qkv(mixed_qkv, num_heads)
    cu_seqlens = torch.arange(
        0, num_dense + 1, window, dtype=torch.int32, device=mixed_qkv.device
    )
    return DenseVerifyBatch(
        q=q,
        k=k,
        v=v,
        a=as_dense_heads(a, "a (gate input)", num_tokens, num_heads),
        b=as_dense_beta(b, num_tokens, num_heads),
        cu_seqlens=cu_seqlens,
        num_requests=num_requests,
        index=index,
        output_gate=None if output_gate is None else as_dense_heads(output_gate, "output_gate", num_tokens, num_heads),
    )
