"""cpu_support: the CPU-only patches install on request, are idempotent and do what they claim.

The checks run in a fresh subprocess: ``apply()`` patches process-wide state (the Triton
interpreter's bf16 arithmetic, ``torch.Tensor.record_stream``), which must not leak into the
kernel tests that share this pytest process. That nothing is installed without the request is
tested in tests/test_plugin.py (``test_entry_points_register_dspark_and_change_nothing_else``)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from sglang_dspark_plugin.harness import cpu_support

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only patches; apply() is a no-op with CUDA")

CHECKS = textwrap.dedent(
    r'''
    import logging, os, torch
    logging.basicConfig(level=logging.INFO)
    assert os.environ.get("TRITON_INTERPRET") is None  # apply() must set it itself
    from sglang_dspark_plugin.harness import cpu_support
    # The dspark_cpu entry point, with SGLANG_DSPARK_CPU=1 (the harness's opt-in) in the environment.
    assert cpu_support.apply_if_requested() is True and cpu_support.apply() is True
    assert os.environ["TRITON_INTERPRET"] == "1"
    first = cpu_support.installed_patches()
    # SGLang's plugin loading runs both entry points (dspark_cpu: apply_if_requested again, a no-op).
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    assert "dspark" in ATTENTION_BACKENDS

    # Gate 3 acts on CPU tensors only: other devices keep torch's own method (and its error).
    try:
        torch.empty(2, device="meta").record_stream(torch.cpu.current_stream())
        raise AssertionError("record_stream on a meta tensor was swallowed")
    except RuntimeError as exc:
        assert "unknown parameter type" in str(exc), exc

    # Gate 3: record_stream on a CPU tensor is a no-op (torch raises "unknown parameter type").
    torch.zeros(2).record_stream(torch.cpu.current_stream())

    # Gates installed on import: RoPE native path, cache_locs Triton branch, scatter on CPU.
    import sglang.srt.layers.rotary_embedding.base as rope
    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    import sglang.kernels.ops.mamba.mamba_state_scatter_triton as scatter
    import sglang.srt.layers.attention.hybrid_linear_attn_backend as hybrid
    assert rope._is_cpu and cache_locs._is_cuda
    assert hybrid.fused_mamba_state_scatter_with_mask is scatter.fused_mamba_state_scatter_with_mask
    assert getattr(scatter.fused_conv_window_scatter_with_mask, "_dspark_cpu_patch", False)

    # Gate 4: the Triton kernel (interpreted) fills the verify window's cache locations.
    req_to_token = torch.arange(3 * 16, dtype=torch.int32).view(3, 16)
    out = cache_locs.assign_extend_cache_locs_func(
        req_pool_indices=torch.tensor([2, 0]), req_to_token=req_to_token,
        start_offset=torch.tensor([5, 1]), end_offset=torch.tensor([9, 5]),
        batch_size=2, draft_token_num=4, device="cpu")
    assert out.tolist() == [37, 38, 39, 40, 1, 2, 3, 4], out

    # Gate 5: CPU scatter == the kernels' documented semantics.
    dst = torch.zeros(2, 5, 3, 2); src = torch.randn(2, 4, 3, 3, 2)
    dst_idx = torch.tensor([1, 3, -1, 4]); steps = torch.tensor([2, -1, 0, 7])
    scatter.fused_mamba_state_scatter_with_mask(dst, src, dst_idx, steps)
    want = torch.zeros_like(dst); want[:, 1] = src[:, 0, 2]
    assert torch.equal(dst, want)
    rows = torch.tensor([3, 0, 0, 0])
    dst.zero_(); scatter.fused_mamba_state_scatter_with_mask(dst, src, dst_idx, steps, rows)
    want.zero_(); want[:, 1] = src[:, 3, 2]
    assert torch.equal(dst, want)

    # Gate 1: DSPARK accepts --device cpu (the device check is skipped, nothing else changes).
    import types
    import sglang.srt.arg_groups.speculative_hook as hook
    try:
        hook._handle_dspark(types.SimpleNamespace(device="cpu"))
    except ValueError as exc:
        assert "only supports CUDA" not in str(exc), exc
    except Exception:
        pass  # the fake args lack fields; what matters is that the device gate let it through
    assert hook.resolving_view.__name__ == "resolving_view"  # restored after the call

    # Gate 6: CPU process groups are built without PyNccl unless a caller asks for it.
    import sglang.srt.distributed.parallel_state as ps
    real_coordinator = ps.GroupCoordinator
    ps.GroupCoordinator = lambda **kwargs: kwargs  # what init_model_parallel_group would build
    try:
        assert ps.init_model_parallel_group([[0, 1]], 0, "gloo")["use_pynccl"] is False
        assert ps.init_model_parallel_group([[0, 1]], 0, "gloo", use_pynccl=True)["use_pynccl"] is True
    finally:
        ps.GroupCoordinator = real_coordinator

    # Gate 7: the extra_buffer Mamba radix cache passes the platform check (False before it).
    import sglang.srt.arg_groups.mamba_hook as mamba_hook
    assert mamba_hook._platform_supports_mamba_cache_extra_buffer() is True
    assert mamba_hook._platform_supports_mamba_cache_extra_buffer.__wrapped__() is False

    # Gate 8: without CUDA, pin_memory of a CPU tensor is the tensor (torch raises "no NVIDIA driver").
    t = torch.arange(3)
    assert t.pin_memory() is t
    try:
        torch.Tensor.pin_memory.__wrapped__(t)
        raise AssertionError("torch's own pin_memory worked without CUDA: gate 8 is not needed")
    except RuntimeError:
        pass

    # Gates 9-11 (Kimi-K3): no alt CUDA streams, K3's tiny GEMM through torch, and SGLang's K3
    # fused decode (a CUDA JIT kernel) not offered CPU tensors -- GPU tensors still are.
    import sglang.srt.models.kimi_k3 as kimi_k3
    import sglang.kernels.ops.gemm.kimi_k3 as k3_gemm
    import sglang.kernels.ops.attention.kda_fused_decode as k3_decode
    assert getattr(kimi_k3.KimiK3LinearModel.__init__, "_dspark_cpu_patch", False)
    try:
        torch.cuda.Stream()
        raise AssertionError("a CUDA stream was created without CUDA: gate 9 is not needed")
    except (RuntimeError, AssertionError) as exc:
        assert "gate 9" not in str(exc), exc
    assert k3_gemm._is_npu is True
    x, w = torch.randn(3, 128, dtype=torch.bfloat16), torch.randn(1536, 128, dtype=torch.bfloat16)
    assert torch.equal(k3_gemm.kimi_k3_tiny_gemm(x, w), torch.nn.functional.linear(x, w))
    H = 12
    args = (torch.zeros(2, 3 * H * 128), torch.zeros(2, H * 128), torch.zeros(2, H),
            torch.zeros(4, 3, 3 * H * 128), torch.zeros(4, H, 128, 128), torch.zeros(2, dtype=torch.int32),
            torch.zeros(2, H * 128))
    assert k3_decode.covered(*args) is False
    meta = [a.to("meta") for a in args]
    assert k3_decode.covered(*meta) == k3_decode.covered.__wrapped__(*meta)

    # Shim 6: fla's custom_device_ctx is a no-op context on CPU.
    import sglang.kernels.ops.attention.fla.utils as fla_utils
    with fla_utils.custom_device_ctx(0):
        pass
    assert set(first) <= set(cpu_support.installed_patches())
    print("OK", len(cpu_support.installed_patches()), "patches")
    '''
)


def test_apply_installs_every_patch_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["SGLANG_DSPARK_CPU"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK 20 patches" in proc.stdout, proc.stdout[-2000:]  # 9 interpreter shims, 11 device gates
    assert "Executed general plugin: dspark_cpu" in proc.stderr


@triton.jit
def _double(x):
    return x * 2


@triton.jit
def _quadruple_kernel(x_ptr, y_ptr):
    i = tl.arange(0, 4)
    tl.store(y_ptr + i, _double(_double(tl.load(x_ptr + i))))


def test_the_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """Shim 7 (installed in this process by tests/conftest.py): a launch patches ``triton.language``
    once, its helper calls not again, and they compute as before."""
    from triton.runtime import interpreter

    assert cpu_support.patch_language_once_per_launch() is False  # already installed: idempotent
    patched = []
    patch_lang = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patched.append(fn.__name__) or patch_lang(fn))
    x = torch.arange(4.0)
    y = torch.empty(4)
    _quadruple_kernel[(1,)](x, y)
    assert torch.equal(y, 4 * x)
    assert patched == ["_quadruple_kernel"]


def test_bf16_conversions_by_bits_match_the_interpreter_and_torch():
    """Shim 8 (installed in this process by tests/conftest.py): every bf16 bit pattern widens to
    the fp32 torch gives; every fp32 pattern that is not subnormal narrows to the bits of the
    interpreter's own routine (truncation), and subnormals to the bf16 value truncation defines
    (the largest bf16 magnitude not above the input's, from torch's exact widening)."""
    from triton.runtime import interpreter

    convert = interpreter._convert_float
    assert getattr(convert, "_dspark_cpu_patch", False) and cpu_support.convert_bf16_by_bits() is False
    generic = convert.generic

    bf16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    wide = convert(bf16, tl.bfloat16, tl.float32, None)
    assert wide.dtype == np.uint32 and wide.shape == bf16.shape
    expected = torch.from_numpy(bf16.astype(np.int16)).view(torch.bfloat16).float()
    got = torch.from_numpy(wide.view(np.float32))
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])

    rng = np.random.default_rng(0)
    fp32 = rng.integers(0, 1 << 32, size=(64, 1000), dtype=np.uint64).astype(np.uint32)
    fp32[0, :8] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x3F800000, 0x0000FFFF, 0x007FFFFF]
    narrow = convert(fp32.view(np.float32), tl.float32, tl.bfloat16, None)
    assert narrow.dtype == np.uint16 and narrow.shape == fp32.shape
    subnormal = ((fp32 >> 23) & 0xFF == 0) & (fp32 & 0x7FFFFF != 0)
    reference = generic(fp32.view(np.float32), tl.float32, tl.bfloat16, None)
    assert np.array_equal(narrow[~subnormal], reference[~subnormal])
    x = torch.from_numpy(fp32[subnormal].view(np.float32)).double()
    r = torch.from_numpy(narrow[subnormal].astype(np.int16)).view(torch.bfloat16).double()
    ulp = 2.0 ** -133  # the spacing of bf16 subnormals
    assert subnormal.any() and bool(((r.abs() <= x.abs()) & (x.abs() < r.abs() + ulp) & (r * x >= 0)).all())

    # a 0-d array keeps its shape; other conversions take the interpreter's routine
    assert convert(np.array(1.5, np.float32), tl.float32, tl.bfloat16, None).shape == ()
    half = np.array([1.0, -2.5], np.float32)
    assert np.array_equal(convert(half, tl.float32, tl.float16, None), generic(half, tl.float32, tl.float16, None))


def test_numpy_dtype_table_matches_the_interpreter():
    """Shim 9 (installed in this process by tests/conftest.py): every scalar, block and pointer
    dtype maps to the numpy dtype of the interpreter's own function; others raise as it does."""
    from triton.runtime import interpreter

    lookup = interpreter._get_np_dtype
    assert getattr(lookup, "_dspark_cpu_patch", False) and cpu_support.numpy_dtype_table_once() is False
    generic = lookup.generic
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
               tl.float8e4b8, tl.float8e4b15]
    for dtype in scalars:
        for ty in (dtype, tl.block_type(dtype, [4, 2]), tl.pointer_type(dtype), tl.block_type(tl.pointer_type(dtype), [8])):
            assert lookup(ty) == generic(ty), ty
    assert lookup(tl.bfloat16) == np.dtype(np.uint16)  # bf16 held as raw bits
    with pytest.raises(KeyError):
        generic(tl.void)
    with pytest.raises(KeyError):
        lookup(tl.void)
