"""Shape, dtype and stride checks shared by the kernel wrappers.

Everything here looks at tensor *metadata* only (shape, dtype, stride, device): no value is read,
so the checks never synchronise the host with the device and are safe inside CUDA-graph capture.

Each distinct problem has its own stable code in the ``DSPARK-E1xx`` range (see
``docs/reference/errors.md``; ``docs/reference/kernel-api.md`` says which wrapper raises which);
every error is a :class:`~sglang_dspark_plugin.errors.DSparkError` (a ``ValueError``) whose
message says what was expected, what was given and the fix.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang_dspark_plugin.errors import dspark_error
from sglang_dspark_plugin.settings import ACTIVATION_DTYPES, CONV_WIDTH, HEAD_DIM

INDEX_DTYPE = torch.int32

# One code per distinct problem; docs/reference/errors.md has an entry for each.
E_ACT_SHAPE = "DSPARK-E101"  # q/k/v/a not [1, T, H, 128] or not matching each other
E_BETA_SHAPE = "DSPARK-E102"  # b not [1, T, H]
E_HEAD_DIM = "DSPARK-E103"  # head_dim != 128
E_TOKENS = "DSPARK-E104"  # T != N*(1+num_spec) (verify) / T != B (decode)
E_SSM = "DSPARK-E105"  # recurrent state shape / dtype / layout
E_CONV = "DSPARK-E106"  # conv state shape / dtype / layout
E_DTYPE = "DSPARK-E107"  # activation dtypes (q/k/v/a/b/out)
E_STRIDE = "DSPARK-E108"  # last dim of an activation / output not contiguous
E_RING = "DSPARK-E109"  # ReplaySSM ring shape / dtype / layout / length
E_MODE = "DSPARK-E110"  # neither or both of snapshot and ring mode, or a partial ring set
E_INDEX = "DSPARK-E111"  # index tensor (slots, cu_seqlens, rows, accept lens, track) dtype/shape
E_CONV_W = "DSPARK-E112"  # conv weight shape / dtype / layout
E_GATE_PARAM = "DSPARK-E113"  # A_log / dt_bias shape / dtype
E_ICONV = "DSPARK-E114"  # intermediate conv window buffer shape / dtype / layout
E_ISSM = "DSPARK-E115"  # intermediate (snapshot) state buffer shape / dtype / layout
E_NUM_SPEC = "DSPARK-E116"  # num_spec not a non-negative Python int
E_DEVICE = "DSPARK-E117"  # tensors on different devices
E_OUT = "DSPARK-E118"  # out buffer shape / dtype / layout
E_FOLD_ARGS = "DSPARK-E119"  # fold: partial conv-roll / track argument set, layer mismatch
E_SCALAR = "DSPARK-E120"  # lower_bound / scale not a Python number (a tensor would need a host sync)
E_BLOCK_V = "DSPARK-E121"  # block_v not a power of two in 1..128
E_BLOCK_K = "DSPARK-E122"  # block_k (the chunked verify's K-chunk) not a power of two in 16..128
E_IMPL = "DSPARK-E123"  # impl names no kernel of the wrapper
E_OUTPUT_GATE = "DSPARK-E124"  # output gate (K3's o_norm) arguments: partial set, shape, dtype, layout, eps, workspace


def _shape(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}"


def _desc(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}, dtype {t.dtype}, stride {list(t.stride())}"


def check_tensor(name: str, t, code: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise dspark_error(
            code, name, expected="a torch.Tensor", got=type(t).__name__,
            fix=f"pass {name} as a tensor on the same device as q",
        )
    return t


def check_device(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise dspark_error(
                E_DEVICE, name, expected=f"a tensor on {device} (the device of q)", got=f"device {t.device}",
                fix=f"move {name} to {device} once at allocation time (not per call)",
            )


def check_num_spec(num_spec) -> int:
    if isinstance(num_spec, bool) or not isinstance(num_spec, int) or num_spec < 0:
        raise dspark_error(
            E_NUM_SPEC, "num_spec", expected="a Python int >= 0 (draft tokens per request, without the anchor)",
            got=repr(num_spec),
            fix="pass spec_info.draft_token_num - 1 as a plain int (it selects the compiled kernel)",
        )
    return num_spec


def check_scalar(name: str, value, allow_none: bool) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise dspark_error(
            E_SCALAR, name, expected="a Python float" + (" or None" if allow_none else ""),
            got=type(value).__name__,
            fix=f"pass {name} as a Python number (e.g. float(layer.{name})); a tensor would need a host sync",
        )
    return float(value)


def _power_of_two_upto_head_dim(value) -> bool:
    return isinstance(value, int) and 1 <= value <= HEAD_DIM and not value & (value - 1)


def check_block_v(block_v: int) -> int:
    if not _power_of_two_upto_head_dim(block_v):
        raise dspark_error(
            E_BLOCK_V, "block_v", expected="a power of two in 1..128", got=repr(block_v),
            fix="leave block_v=None for the launch table's choice, or pass 16, 32, 64 or 128",
        )
    return block_v


def check_block_k(block_k: int) -> int:
    """The chunked verify's ``tl.dot`` K-chunk; values below 16 (tl.dot's minimum) are raised to 16
    by the launcher, as before."""
    if not _power_of_two_upto_head_dim(block_k):
        raise dspark_error(
            E_BLOCK_K, "block_k", expected="a power of two in 1..128 (16..128 are used; smaller values run as 16)",
            got=repr(block_k), fix="leave block_k=None for the launch table's choice, or pass 16, 32, 64 or 128",
        )
    return block_k


def check_impl(impl, choices: Sequence[Optional[str]]) -> None:
    """``impl`` is one of the wrapper's ``choices`` (None and "auto" = the launch table's choice)."""
    if impl not in choices:
        names = ["None" if c is None else f'"{c}"' for c in choices]
        raise dspark_error(
            E_IMPL, "impl", expected=", ".join(names[:-1]) + " or " + names[-1], got=repr(impl),
            fix="leave impl=None (the launch table's choice for these shapes)",
        )


def check_activations(tensors: Sequence[tuple]) -> tuple[int, int, torch.dtype]:
    """Check q/k/v(/a)-style activations: ``[1, T, H, 128]``, last dim contiguous.

    ``tensors`` is a sequence of ``(name, tensor, require_same_dtype_as_first)``.
    Returns ``(T, H, dtype_of_first)``.
    """
    T = H = None
    dtype0 = None
    first = None
    for name, t, same_dtype in tensors:
        check_tensor(name, t, E_ACT_SHAPE)
        if t.dim() != 4 or t.shape[0] != 1:
            if t.dim() == 3:
                fix = f"a 3-D [T, H, 128] tensor becomes [1, T, H, 128] with {name}.unsqueeze(0)"
            elif t.dim() == 2:
                fix = (f"a 2-D [T, H*128] tensor becomes [1, T, H, 128] with "
                       f"{name}.view(1, T, H, 128) (or .unflatten(-1, (H, 128)).unsqueeze(0))")
            else:
                fix = f"reshape {name} to [1, T, H, 128] (batch dim 1, tokens flattened)"
            raise dspark_error(E_ACT_SHAPE, name, expected="a 4-D tensor [1, T, H, 128]", got=_shape(t), fix=fix)
        if t.shape[3] != HEAD_DIM:
            raise dspark_error(
                E_HEAD_DIM, name, expected=f"head_dim == {HEAD_DIM} (last dim of [1, T, H, 128])",
                got=f"head_dim {t.shape[3]} ({_shape(t)})",
                fix="these kernels are specialised for K = V = 128; use SGLang's generic KDA path "
                    "(the dspark backend falls back to it automatically for other head sizes)",
            )
        if t.dtype not in ACTIVATION_DTYPES:
            raise dspark_error(
                E_DTYPE, name, expected="bfloat16 or float32", got=str(t.dtype),
                fix=f"cast {name} to the model's activation dtype (bf16 in SGLang)",
            )
        if first is None:
            first, T, H, dtype0 = name, t.shape[1], t.shape[2], t.dtype
        else:
            if t.shape[1] != T or t.shape[2] != H:
                raise dspark_error(
                    E_ACT_SHAPE, name, expected=f"[1, {T}, {H}, 128] like {first}", got=_shape(t),
                    fix=f"pass {name} for the same tokens and heads as {first}",
                )
            if same_dtype and t.dtype != dtype0:
                raise dspark_error(
                    E_DTYPE, name, expected=f"dtype {dtype0} (same as {first})", got=str(t.dtype),
                    fix=f"q, k and v must share one activation dtype: {name}.to({dtype0})",
                )
        if t.stride(3) != 1:
            raise dspark_error(
                E_STRIDE, name, expected="stride(-1) == 1 (channels contiguous; token/head strides are free)",
                got=f"stride {list(t.stride())}",
                fix=f"pass {name}.contiguous(), or a view of a buffer whose last dim is contiguous",
            )
    return T, H, dtype0


def check_beta(b, T: int, H: int) -> None:
    check_tensor("b", b, E_BETA_SHAPE)
    if b.dim() != 3 or b.shape[0] != 1 or b.shape[1] != T or b.shape[2] != H:
        fix = "a 2-D [T, H] tensor becomes [1, T, H] with b.unsqueeze(0)" if b.dim() == 2 else \
            f"reshape b to [1, {T}, {H}] (raw beta logits, one per token and head)"
        raise dspark_error(E_BETA_SHAPE, "b", expected=f"[1, {T}, {H}] (raw beta logits)", got=_shape(b), fix=fix)
    if b.dtype not in ACTIVATION_DTYPES:
        raise dspark_error(E_DTYPE, "b", expected="bfloat16 or float32", got=str(b.dtype),
                           fix="cast b to the activation dtype")


def check_out(out, T: int, H: int, dtype: torch.dtype) -> None:
    check_tensor("out", out, E_OUT)
    if tuple(out.shape) != (1, T, H, HEAD_DIM) or out.dtype != dtype:
        raise dspark_error(
            E_OUT, "out", expected=f"[1, {T}, {H}, 128] of dtype {dtype}", got=f"{_shape(out)}, dtype {out.dtype}",
            fix="pass out=None to allocate, or torch.empty_like(q) for a contiguous q",
        )
    if out.stride(3) != 1:
        raise dspark_error(E_STRIDE, "out", expected="stride(-1) == 1", got=f"stride {list(out.stride())}",
                           fix="pass a buffer whose last dim is contiguous (e.g. torch.empty_like)")


def check_conv_weight(w, H: int) -> None:
    D = 3 * H * HEAD_DIM
    check_tensor("conv_weight", w, E_CONV_W)
    if w.dim() == 3 and w.shape[1] == 1:
        fix = "SGLang's [D, 1, 4] conv1d weight becomes [D, 4] with conv_weight.squeeze(1)"
    else:
        fix = f"pass the layer's conv weights as [D={D}, 4] float32 (q | k | v channel groups)"
    if w.dim() != 2 or w.shape[0] != D or w.shape[1] != CONV_WIDTH:
        raise dspark_error(E_CONV_W, "conv_weight", expected=f"[{D}, 4] (D = 3*H*128)", got=_shape(w), fix=fix)
    if w.dtype != torch.float32:
        raise dspark_error(E_CONV_W, "conv_weight", expected="float32", got=str(w.dtype),
                           fix="keep the conv weights in float32 (SGLang's qkv_conv1d params_dtype)")
    if w.stride(1) != 1:
        raise dspark_error(E_CONV_W, "conv_weight", expected="stride(-1) == 1", got=f"stride {list(w.stride())}",
                           fix="pass conv_weight.contiguous() once at load time")


def check_gate_params(A_log, dt_bias, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    check_tensor("A_log", A_log, E_GATE_PARAM)
    check_tensor("dt_bias", dt_bias, E_GATE_PARAM)
    if A_log.numel() != H or A_log.dtype != torch.float32:
        raise dspark_error(
            E_GATE_PARAM, "A_log", expected=f"{H} float32 values (any shape, e.g. [H] or [1, 1, H, 1])",
            got=f"{_shape(A_log)}, dtype {A_log.dtype}", fix="pass layer.A_log (float32, one per head)",
        )
    if dt_bias.numel() != H * HEAD_DIM or dt_bias.dtype != torch.float32:
        raise dspark_error(
            E_GATE_PARAM, "dt_bias", expected=f"{H * HEAD_DIM} float32 values ([H*128])",
            got=f"{_shape(dt_bias)}, dtype {dt_bias.dtype}", fix="pass layer.dt_bias (float32, [H*128])",
        )
    A_flat = A_log.reshape(-1)
    dt_flat = dt_bias.reshape(-1)
    if A_flat.stride(0) != 1 or dt_flat.stride(0) != 1:
        raise dspark_error(E_GATE_PARAM, "A_log/dt_bias", expected="contiguous tensors",
                           got=f"strides {list(A_log.stride())} / {list(dt_bias.stride())}",
                           fix="pass .contiguous() copies made once at load time")
    return A_flat, dt_flat


def check_index(name: str, t, n: Optional[int], *, what: str) -> int:
    """Check a 1-D contiguous int32 index tensor (of length ``n`` unless None); returns its length."""
    check_tensor(name, t, E_INDEX)
    bad = t.dtype != INDEX_DTYPE or t.dim() != 1
    bad = bad or (n is not None and t.shape[0] != n) or (t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1)
    if bad:
        length = "" if n is None else f" of length {n}"
        raise dspark_error(
            E_INDEX, name, expected=f"a contiguous 1-D int32 tensor{length} ({what})",
            got=_desc(t), fix=f"pass {name}.to(torch.int32).contiguous() (built once per batch, not per layer)",
        )
    return t.shape[0]


def check_decode_ring(ring_d, ring_k, ring_g, write_pos, H: int, slots: int, B: int) -> int:
    """Check SGLang's decode ring (``--enable-linear-replayssm``) for buffered decode: the three
    per-layer rings ``[slots, H, L, 128]`` fp32 and the per-request ``write_pos``; returns ``L``.
    All or none of them (none: plain decode)."""
    given = [t is not None for t in (ring_d, ring_k, ring_g, write_pos)]
    if any(given) and not all(given):
        raise dspark_error(
            E_MODE, "ring_d/ring_k/ring_g/write_pos", expected="all four (buffered decode) or none (plain decode)",
            got=f"{sum(given)} of 4", fix="pass the layer's replayssm_d/k/g and the metadata's replayssm_write_pos together",
        )
    if not any(given):
        return 0
    for name, t in (("ring_d", ring_d), ("ring_k", ring_k), ("ring_g", ring_g)):
        check_tensor(name, t, E_RING)
    L = ring_d.shape[2] if ring_d.dim() == 4 else -1
    exp = f"[{slots} (slots), {H}, L, 128] float32, last dim contiguous, L >= 1 (all three rings share L)"
    for name, t in (("ring_d", ring_d), ("ring_k", ring_k), ("ring_g", ring_g)):
        if t.dim() != 4 or tuple(t.shape) != (slots, H, L, HEAD_DIM) or L < 1:
            raise dspark_error(E_RING, name, expected=exp, got=_shape(t),
                               fix="pass the layer's decode rings (pool replayssm_d / replayssm_k / replayssm_g)")
        if t.dtype != torch.float32 or t.stride(-1) != 1:
            raise dspark_error(E_RING, name, expected=exp, got=_desc(t),
                               fix="serve with an fp32 recurrent state (--mamba-ssm-dtype float32): SGLang "
                               "allocates the decode rings in the state dtype")
    check_index("write_pos", write_pos, B, what="ring rows already buffered per request, 0 .. L-1")
    return L


def check_ssm_state(name: str, s, H: int, *, layered: bool) -> None:
    check_tensor(name, s, E_SSM)
    nd = 5 if layered else 4
    lead = "[layers, slots, " if layered else "[slots, "
    exp = f"{lead}{H}, 128, 128] float32 ([V, K], K contiguous)"
    if s.dim() != nd or s.shape[-3] != H or s.shape[-2] != HEAD_DIM or s.shape[-1] != HEAD_DIM:
        if s.dim() == nd and (s.shape[-1] != HEAD_DIM or s.shape[-2] != HEAD_DIM):
            raise dspark_error(E_HEAD_DIM, name, expected=exp, got=_shape(s),
                               fix="head_dim must be 128; use SGLang's generic KDA path for other sizes")
        raise dspark_error(E_SSM, name, expected=exp, got=_shape(s),
                           fix="pass the pool's temporal state (per layer: temporal[layer_id])")
    if s.dtype != torch.float32:
        raise dspark_error(E_SSM, name, expected="float32", got=str(s.dtype),
                           fix="run with --mamba-ssm-dtype float32 (ReplaySSM forces it too)")
    if s.stride(-1) != 1 or s.stride(-2) != HEAD_DIM or s.stride(-3) != HEAD_DIM * HEAD_DIM:
        raise dspark_error(E_SSM, name, expected="each slot's [H, 128, 128] block contiguous",
                           got=f"stride {list(s.stride())}",
                           fix="pass the pool tensor itself (or a slot/layer slice of it), not a transposed view")


def check_conv_state(name: str, c, H: int, dtype: torch.dtype, *, layered: bool) -> None:
    D = 3 * H * HEAD_DIM
    check_tensor(name, c, E_CONV)
    nd = 4 if layered else 3
    lead = "[layers, slots, " if layered else "[slots, "
    if c.dim() != nd or c.shape[-2] != CONV_WIDTH - 1 or c.shape[-1] != D:
        fix = (f"SGLang's KDA pool stores conv[0][layer] as [slots, 3, D]; if you hold the transposed "
               f"[slots, D, 3] view, pass {name}.transpose(-1, -2)")
        raise dspark_error(E_CONV, name, expected=f"{lead}3, {D}] (3 previous inputs, row 0 oldest; D = 3*H*128)",
                           got=_shape(c), fix=fix)
    if c.dtype != dtype:
        raise dspark_error(E_CONV, name, expected=f"dtype {dtype} (the activation dtype)", got=str(c.dtype),
                           fix="allocate the conv state in the activation dtype (SGLANG_MAMBA_CONV_DTYPE=bf16 for bf16)")
    if c.stride(-1) != 1:
        raise dspark_error(E_CONV, name, expected="stride(-1) == 1 (D contiguous)", got=f"stride {list(c.stride())}",
                           fix="pass the [slots, 3, D] pool tensor, not its [slots, D, 3] transpose")


def check_intermediate_conv(ic, H: int, steps: int, dtype: torch.dtype, *, layered: bool) -> None:
    D = 3 * H * HEAD_DIM
    name = "intermediate_conv"
    check_tensor(name, ic, E_ICONV)
    nd = 5 if layered else 4
    lead = "[layers, rows, " if layered else "[rows, "
    exp = f"{lead}>={steps}, 3, {D}] of dtype {dtype}, D contiguous"
    if ic.dim() != nd or ic.shape[-3] < steps or ic.shape[-2] != CONV_WIDTH - 1 or ic.shape[-1] != D:
        raise dspark_error(E_ICONV, name, expected=exp, got=_shape(ic),
                           fix="pass intermediate_conv_window[0] (per layer for verify) with the step dim >= 1+num_spec; "
                               "if you hold the [.., D, 3] transpose, pass .transpose(-1, -2)")
    if ic.dtype != dtype or ic.stride(-1) != 1:
        raise dspark_error(E_ICONV, name, expected=exp, got=_desc(ic),
                           fix="allocate it in the activation dtype with D contiguous")


def check_intermediate_ssm(iss, H: int, steps: int) -> None:
    name = "intermediate_ssm"
    check_tensor(name, iss, E_ISSM)
    exp = f"[rows, >={steps}, {H}, 128, 128] float32, each [H, 128, 128] block contiguous"
    if iss.dim() != 5 or iss.shape[1] < steps or iss.shape[2] != H or iss.shape[3] != HEAD_DIM \
            or iss.shape[4] != HEAD_DIM:
        raise dspark_error(E_ISSM, name, expected=exp, got=_shape(iss),
                           fix="pass the pool's intermediate_ssm[layer] with a step dim >= 1+num_spec")
    if iss.dtype != torch.float32 or iss.stride(4) != 1 or iss.stride(3) != HEAD_DIM \
            or iss.stride(2) != HEAD_DIM * HEAD_DIM:
        raise dspark_error(E_ISSM, name, expected=exp, got=_desc(iss),
                           fix="allocate it float32 with contiguous [H, 128, 128] blocks")


def check_rings(rawv, rawk, g, beta, H: int, min_len: int, dtype: torch.dtype, *, layered: bool,
                slots: Optional[int] = None, layers: Optional[int] = None) -> int:
    """Check the four ReplaySSM rings; returns the ring length L."""
    nd = 5 if layered else 4
    lead = "[layers, slots, " if layered else "[slots, "
    for name, t in (("ring_rawv", rawv), ("ring_rawk", rawk), ("ring_g", g), ("ring_beta", beta)):
        check_tensor(name, t, E_RING)
    L = rawv.shape[-2] if rawv.dim() == nd else -1
    for name, t, want_dtype, with_dim in (
        ("ring_rawv", rawv, dtype, True), ("ring_rawk", rawk, dtype, True),
        ("ring_g", g, torch.float32, True), ("ring_beta", beta, torch.float32, False),
    ):
        exp = f"{lead}{H}, L, 128]" if with_dim else f"{lead}{H}, L]"
        exp += f" of dtype {want_dtype} with L >= {min_len}" + (", last dim contiguous" if with_dim else "")
        want_nd = nd if with_dim else nd - 1
        bad = t.dim() != want_nd
        if not bad:
            hdim = t.shape[-3] if with_dim else t.shape[-2]
            ldim = t.shape[-2] if with_dim else t.shape[-1]
            bad = hdim != H or ldim != L or (with_dim and t.shape[-1] != HEAD_DIM)
            bad = bad or t.shape[:nd - 2] != rawv.shape[:nd - 2]
            if slots is not None and not bad:
                bad = t.shape[1 if layered else 0] != slots
            if layers is not None and not bad:
                bad = t.shape[0] != layers
        if bad:
            raise dspark_error(E_RING, name, expected=exp + " (all four rings share slots and L)",
                               got=_shape(t), fix="pass the pool's replayssm_* rings (per layer for verify)")
        if t.dtype != want_dtype or (with_dim and t.stride(-1) != 1):
            raise dspark_error(E_RING, name, expected=exp, got=_desc(t),
                               fix=f"allocate {name} as {want_dtype}" + (" with the last dim contiguous" if with_dim else ""))
    if L < min_len:
        raise dspark_error(E_RING, "ring length L", expected=f"L >= {min_len} (1 + num_spec)", got=f"L = {L}",
                           fix="raise --linear-replayssm-cache-len (a power of two >= 2*(1+num_spec))")
    return L


def check_lazy_ring(record_cursor, ring_delta, ring_rawk, slots: int, ring: bool):
    """Check the lazy record ring's arguments of a verify (both or neither; ring mode only) and
    return :func:`check_delta_ring`'s ``(hi, lo)``, or None when the ring is not lazy."""
    if (record_cursor is None) != (ring_delta is None):
        raise dspark_error(
            E_MODE, "record_cursor/ring_delta", expected="both (lazy record ring) or neither",
            got="only record_cursor" if ring_delta is None else "only ring_delta",
            fix="pass the pool's dspark_record_cursor with the delta ring(s), or neither",
        )
    if record_cursor is None:
        return None
    if not ring:
        raise dspark_error(
            E_MODE, "record_cursor", expected="ring mode (the four replayssm_* rings) for the lazy record ring",
            got="snapshot mode", fix="pass the rings, or leave record_cursor/ring_delta out",
        )
    check_index("record_cursor", record_cursor, slots, what="pending records per slot")
    return check_delta_ring(ring_delta, ring_rawk)


def check_delta_ring(ring_delta, ring_rawk):
    """The lazy ring's corrected deltas as ``(hi, lo)``: one fp32 ring and None, or the two 16-bit
    halves as int16 views. ``ring_delta`` is an fp32 tensor of ``ring_rawk``'s shape, or a pair of
    2-byte tensors of that shape and the same strides (high halves first)."""
    pair = tuple(ring_delta) if isinstance(ring_delta, (tuple, list)) else (ring_delta, None)
    if len(pair) != 2:
        raise dspark_error(E_RING, "ring_delta", expected="a tensor or a pair (high, low) of tensors",
                           got=f"{len(pair)} tensors", fix="pass replayssm_d, or (replayssm_d, replayssm_k)")
    hi, lo = pair
    for name, t in (("ring_delta", hi), ("ring_delta[1]", lo)):
        if t is None and name == "ring_delta[1]":
            continue
        check_tensor(name, t, E_RING)
        if t.shape != ring_rawk.shape or t.stride(-1) != 1:
            raise dspark_error(E_RING, name, expected=f"{list(ring_rawk.shape)} like ring_rawk, last dim contiguous",
                               got=_desc(t), fix="pass the pool's replayssm_d (and replayssm_k) of the same layer(s)")
    if lo is None:
        if hi.dtype != torch.float32:
            raise dspark_error(E_RING, "ring_delta", expected="one float32 ring, or a pair of 16-bit rings",
                               got=_desc(hi), fix="pass (replayssm_d, replayssm_k) when they are bfloat16")
        return hi, None
    if hi.element_size() != 2 or lo.element_size() != 2 or hi.stride() != lo.stride():
        raise dspark_error(E_RING, "ring_delta", expected="two 2-byte rings with equal strides (high, low halves)",
                           got=f"{_desc(hi)} / {_desc(lo)}", fix="pass (replayssm_d, replayssm_k) of one layer")
    return hi.view(torch.int16), lo.view(torch.int16)


def check_output_gate(gate, weight, eps, workspace, T: int, H: int, N: int):
    """The output gate arguments (Kimi-K3's gated RMSNorm fused into the epilogue), all or none:
    ``gate [1, T, H, 128]`` bf16 / fp32 with the last dim contiguous (token and head strides free:
    a view of the model's fused projection), ``weight [128]`` fp32 or bf16 contiguous, ``eps`` a
    positive Python float and, where the kernel needs one (``N`` not None), ``workspace``: None
    or an int32 tensor of at least ``N * H`` zeros. Returns ``(eps, workspace)`` or None."""
    given = {"output_gate": gate, "output_norm_weight": weight, "output_norm_eps": eps}
    missing = [name for name, value in given.items() if value is None]
    if len(missing) == 3:
        if workspace is not None:
            raise dspark_error(E_OUTPUT_GATE, "output_gate_workspace", expected="no workspace without an output gate",
                               got="a workspace", fix="pass output_gate_workspace only with the output gate")
        return None
    if missing:
        raise dspark_error(
            E_OUTPUT_GATE, "/".join(missing), expected="all three output gate arguments or none",
            got=f"{3 - len(missing)} of 3 (missing {', '.join(missing)})",
            fix="pass output_gate, output_norm_weight and output_norm_eps together (the model's o_norm gate, "
                "o_norm.weight and o_norm.eps), or none of them",
        )
    check_tensor("output_gate", gate, E_OUTPUT_GATE)
    if gate.dim() != 4 or tuple(gate.shape) != (1, T, H, HEAD_DIM):
        raise dspark_error(
            E_OUTPUT_GATE, "output_gate", expected=f"[1, {T}, {H}, 128] (one gate per output element)",
            got=_shape(gate), fix="pass the gate projection of the same tokens as q, viewed as [1, T, H, 128]",
        )
    if gate.dtype not in ACTIVATION_DTYPES or gate.stride(3) != 1:
        raise dspark_error(
            E_OUTPUT_GATE, "output_gate", expected="bfloat16 or float32 with stride(-1) == 1", got=_desc(gate),
            fix="pass the model's gate projection (bf16), a view whose last dim is contiguous",
        )
    check_tensor("output_norm_weight", weight, E_OUTPUT_GATE)
    if tuple(weight.shape) != (HEAD_DIM,) or weight.dtype not in ACTIVATION_DTYPES or weight.stride(0) != 1:
        raise dspark_error(
            E_OUTPUT_GATE, "output_norm_weight", expected="a contiguous [128] float32 or bfloat16 tensor",
            got=_desc(weight), fix="pass o_norm.weight (one weight per channel of a head), e.g. .float().contiguous()",
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise dspark_error(
            E_OUTPUT_GATE, "output_norm_eps", expected="a positive Python float", got=repr(eps),
            fix="pass float(o_norm.eps)",
        )
    if N is not None and workspace is not None:
        check_tensor("output_gate_workspace", workspace, E_OUTPUT_GATE)
        if workspace.dtype != INDEX_DTYPE or workspace.dim() != 1 or workspace.numel() < N * H:
            raise dspark_error(
                E_OUTPUT_GATE, "output_gate_workspace",
                expected=f"a 1-D int32 tensor of at least N*H = {N * H} zeros", got=_desc(workspace),
                fix="allocate torch.zeros(max_requests * H, dtype=torch.int32) once and pass it to every call "
                    "(the kernel leaves it zero), or pass None",
            )
    return float(eps), workspace
