"""Everything a CPU-only (no GPU) run of SGLang + this plugin needs, in one place.

SGLang 0.5.23 and its Triton kernels target GPUs. On a machine without one, the whole serving
chain (scheduler -> KDA backend -> Triton kernels, DSPARK draft/verify/commit) still runs when

1. Triton runs in its interpreter (``TRITON_INTERPRET=1``; numpy executes every program) with a
   few fixes to the interpreter (``_install_triton_interpreter_shims``: six fixes, three speed-ups), and
2. eleven small device gates in SGLang let a plain CPU host through (the sixth only for
   ``--tp-size > 1``, the seventh and eighth only for the ``extra_buffer`` Mamba radix cache, the
   last three only for Kimi-K3 models) (``_install_sglang_device_gate_patches``).

``apply()`` installs both; it returns at once, changing nothing, when ``torch.cuda.is_available()``,
and it is idempotent. Nothing here edits SGLang's or Triton's files on disk: every change is a
runtime patch of a function, method or module attribute, installed right after the owning module is
imported (or at once if it already was).

**Opt-in only.** Installing the plugin must not change SGLang for anyone who does not run our CPU
path (SGLang's own CPU engine, NPU/XPU hosts, any other backend). So nothing here runs unless asked
for: the package's second ``sglang.srt.plugins`` entry point, ``dspark_cpu``, calls
``apply_if_requested()`` in every SGLang process, and that does nothing unless
``SGLANG_DSPARK_CPU=1`` is in the environment. The harness sets it: the server launcher
(``serving.cpu_env()``, inherited by SGLang's spawned processes), hence the demo and the e2e tests;
in-process tests call ``apply()`` themselves.

The interpreter shims patch private Triton 3.8.0 internals (``triton.runtime.interpreter``); the
project pins ``triton==3.8.0``. They are installed only when ``TRITON_INTERPRET=1`` (``apply()``
sets it when it is unset and there is no GPU; it must be in the environment before Triton kernels
are *decorated*, i.e. before the kernel modules are imported, so the server launcher in
``serving.py`` puts it into the server's environment and SGLang's spawned processes inherit it).

Background, every shim and gate with its symptom, and measurements: docs/guide/cpu-testing.md.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from typing import Callable, Dict, List

from ..settings import cpu_requested, gpu_available

logger = logging.getLogger("sglang_dspark_plugin.harness.cpu_support")

_lock = threading.Lock()
_applied = False
_installed: List[str] = []  # names of the patches installed in this process, for diagnostics


def apply_if_requested() -> bool:
    """Entry point ``dspark_cpu`` (``sglang.srt.plugins``): ``apply()`` when ``SGLANG_DSPARK_CPU=1``,
    else nothing at all (no environment change, no patch). Returns whether the patches are installed."""
    if not cpu_requested():
        return False
    return apply()


def apply() -> bool:
    """Install the CPU-only patches in this process. Returns True when they are (now or already)
    installed, False on a CUDA machine, where nothing is touched. Idempotent and thread-safe."""
    global _applied
    if gpu_available():
        return False
    with _lock:
        if _applied:
            return True
        if os.environ.get("TRITON_INTERPRET") is None:
            # Without a GPU Triton has no driver ("0 active drivers"); the interpreter is the only
            # way to run its kernels. Processes SGLang spawns from here inherit this.
            os.environ["TRITON_INTERPRET"] = "1"
        if os.environ.get("TRITON_INTERPRET") == "1":
            _install_triton_interpreter_shims()
        _install_sglang_device_gate_patches()
        _applied = True
    logger.info(
        "dspark cpu_support: no GPU; CPU-only patches installed: %s (more are installed when "
        "their SGLang modules are imported: %s)",
        ", ".join(_installed) or "none",
        ", ".join(sorted(_pending)) or "none",
    )
    return True


def installed_patches() -> List[str]:
    """Names of the patches installed in this process (empty on CUDA or before ``apply()``)."""
    return list(_installed)


# ----------------------------------------------------------------------------------------------
# Small helpers: patch a module right after it is imported, rebind stale copies of a function
# ----------------------------------------------------------------------------------------------

_pending: Dict[str, List[Callable]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Meta-path finder that runs callbacks on a module right after it has been executed."""

    def find_spec(self, name, path, target=None):
        if name not in _pending:
            return None
        # Let the normal finders locate the module, then wrap its loader.
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module, _run=run, _name=name):
            _run(module)
            for callback in _pending.pop(_name, []):
                callback(module)

        loader.exec_module = exec_module
        return spec


_after_import_finder = _AfterImport()


def _when_imported(module_name: str, callback: Callable) -> None:
    """Run ``callback(module)`` now if ``module_name`` is imported, else right after its import."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    _pending.setdefault(module_name, []).append(callback)
    if _after_import_finder not in sys.meta_path:
        sys.meta_path.insert(0, _after_import_finder)


def _rebind(module, name: str, new) -> None:
    """Set ``module.name = new`` and rebind every ``from module import name`` copy already made
    in other loaded modules (so callers that imported the name earlier see the patch too)."""
    old = getattr(module, name)
    setattr(module, name, new)
    for other in list(sys.modules.values()):
        namespace = getattr(other, "__dict__", None)
        if not namespace or other is module:
            continue
        try:
            if namespace.get(name) is old:
                setattr(other, name, new)
        except Exception:  # exotic modules with odd __dict__s
            pass


# ----------------------------------------------------------------------------------------------
# Triton interpreter shims (TRITON_INTERPRET=1, triton 3.8.0)
# ----------------------------------------------------------------------------------------------


def _install_triton_interpreter_shims() -> None:
    _shim_autotune_first_config()
    _shim_loop_index_is_tensor()
    _shim_module_level_builtin_aliases()
    _shim_libdevice_to_tl_math()
    _shim_bf16_math_in_fp32()
    _when_imported("sglang.kernels.ops.attention.fla.utils", _shim_fla_device_ctx)
    if patch_language_once_per_launch():
        _installed.append("triton: language patched once per launch")
    if convert_bf16_by_bits():
        _installed.append("triton: bf16 <-> fp32 conversions by bits")
    if numpy_dtype_table_once():
        _installed.append("triton: numpy dtype table built once")


def _shim_autotune_first_config() -> None:
    """1. Autotuned kernels: keep the first config, never benchmark.

    The autotuner times every config with ``do_bench``, which needs a GPU driver ("0 active
    drivers"). Under the interpreter timings mean nothing anyway, so only the first config (after
    the kernel's own pruning) is ever run on CPU."""
    import triton.runtime.autotuner as autotuner

    prune = autotuner.Autotuner.prune_configs

    def prune_configs(self, kwargs):
        return prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = prune_configs
    _installed.append("triton: autotune first config")


def _shim_loop_index_is_tensor() -> None:
    """2. ``for i in range(...)`` loop indices become interpreter tensors.

    Compiled Triton gives loop indices tensor semantics (``i_t.to(tl.int64)`` is common in fla and
    SGLang kernels); the interpreter leaves them Python ints (``'int' object has no attribute
    'to'``). The interpreter already rewrites each kernel's AST (``ASTTransformer``); we add a
    ``name = interpreter_semantic.to_tensor(name, False)`` at the top of every ``for`` body."""
    from triton.runtime import interpreter

    def visit_For(self, node):
        self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            name = node.target.id
            convert = ast.parse(f"{name} = interpreter_semantic.to_tensor({name}, False)").body[0]
            node.body.insert(0, convert)
        return node

    interpreter.ASTTransformer.visit_For = visit_For
    _installed.append("triton: loop index as tensor")


def _shim_module_level_builtin_aliases() -> None:
    """3. Module-level aliases of ``tl`` builtins (``exp = tl.exp``) work inside kernels.

    Before each launch the interpreter swaps the builtins on ``triton.language`` for numpy
    implementations, but a module that did ``exp = tl.exp`` keeps the compiled-mode builtin
    ("Did you forget to add @triton.jit ?"). We find such aliases in every loaded non-Triton
    module and let the interpreter patch (and afterwards restore) them like ``tl.*``. Entries are
    only ever added (a module seen once stays tracked), and the scan reruns only when the number of
    loaded modules changed."""
    import triton.language as tl
    from triton.runtime import interpreter

    aliases: Dict[tuple, tuple] = {}
    scanned_module_count = [-1]

    def builtin_aliases():
        if scanned_module_count[0] != len(sys.modules):
            for module_name, module in list(sys.modules.items()):
                if module is None or module_name.startswith(("triton", "torch", "numpy")):
                    continue
                for attr, value in list(getattr(module, "__dict__", {}).items()):
                    try:
                        if tl.core.is_builtin(value):
                            aliases.setdefault((module_name, attr), (module, attr, value))
                    except Exception:
                        pass
            scanned_module_count[0] = len(sys.modules)
        return list(aliases.values())

    patch_lang = interpreter._patch_lang

    def _patch_lang(fn):
        scope = patch_lang(fn)
        for module, attr, value in builtin_aliases():
            interpreter._patch_attr(module, attr, value, interpreter.interpreter_builder, scope)
        return scope

    interpreter._patch_lang = _patch_lang
    _installed.append("triton: tl builtin aliases")


def _shim_libdevice_to_tl_math() -> None:
    """4. ``triton.language.extra.libdevice`` functions map to ``tl.math``.

    In the interpreter the libdevice entry points are empty stubs returning None
    (``unsupported operand type(s) for +: 'float' and 'NoneType'``). Each one with a ``tl.math``
    counterpart (``fast_expf`` -> ``exp`` and so on) is redirected to it."""
    import triton.language as tl
    from triton.language.extra import libdevice

    renames = {"fast_expf": "exp", "fast_logf": "log", "fast_log2f": "log2"}

    def redirect(target):
        def fn(*args, **kwargs):
            return getattr(tl.math, target)(*args)

        return fn

    for name in [n for n in dir(libdevice) if not n.startswith("_")]:
        target = renames.get(name, name)
        if callable(getattr(tl.math, target, None)):
            setattr(libdevice, name, redirect(target))
    _installed.append("triton: libdevice -> tl.math")


def _shim_bf16_math_in_fp32() -> None:
    """5. bf16 arithmetic and ``tl.dot`` on bf16 compute in fp32.

    The Triton 3.8 interpreter stores bf16 values as raw uint16 bit patterns, and its binary ops,
    unary ops and ``tl.dot`` then operate on those *bits*: a kernel that casts to bf16 before a
    ``tl.dot`` silently returns garbage (1.5e+35 errors measured on SGLang's chunk_kda). It also
    lacks ``get_bf16`` (bf16 scalar constants). We decode bf16 operands to fp32, compute, and
    round results back to bf16 (float results) or keep them (comparisons, integer results); a bf16
    ``tl.dot`` multiplies in fp32 and accumulates into the accumulator's dtype, like the GPU."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    BF16 = tl.bfloat16
    Builder, Handle = interpreter.InterpreterBuilder, interpreter.TensorHandle

    # the interpreter's conversion looked up per call: shim 8 replaces it after this one
    def to_f32(handle):
        if handle.dtype.scalar == BF16:
            return interpreter._convert_float(handle.data, BF16, tl.float32, None).view(np.float32)
        return handle.data

    def to_bf16_bits(array):
        fp32 = np.ascontiguousarray(array, np.float32)
        return interpreter._convert_float(fp32, tl.float32, BF16, None).view(np.uint16).reshape(np.shape(array))

    binary_op, unary_op, create_dot = Builder.binary_op, Builder.unary_op, Builder.create_dot

    def get_bf16(self, value):
        return Handle(to_bf16_bits(np.array([value], np.float32)), BF16)

    def bf16_binary_op(self, lhs, rhs, op):
        if BF16 not in (lhs.dtype.scalar, rhs.dtype.scalar):
            return binary_op(self, lhs, rhs, op)
        out = op(to_f32(lhs), to_f32(rhs))
        if out.dtype.kind == "f":
            return Handle(to_bf16_bits(out), BF16)
        return Handle(out, tl.int1 if out.dtype == np.bool_ else lhs.dtype.scalar)

    def bf16_unary_op(self, arg, op):
        if arg.dtype.scalar == BF16:
            return Handle(to_bf16_bits(op(to_f32(arg))), BF16)
        return unary_op(self, arg, op)

    def bf16_create_dot(self, a, b, d, *rest):
        if BF16 not in (a.dtype.scalar, b.dtype.scalar):
            return create_dot(self, a, b, d, *rest)
        product = np.matmul(to_f32(a), to_f32(b)).astype(d.data.dtype)
        return Handle(product + d.data, d.dtype.scalar)

    Builder.get_bf16 = get_bf16
    Builder.binary_op = bf16_binary_op
    Builder.unary_op = bf16_unary_op
    Builder.create_dot = bf16_create_dot
    _installed.append("triton: bf16 math in fp32")


def _shim_fla_device_ctx(module) -> None:
    """6. SGLang's vendored fla ``custom_device_ctx`` becomes a no-op context.

    ``sglang.kernels.ops.attention.fla.utils`` enters ``torch.<device>.device(index)`` around every
    kernel call; ``torch.cpu.device`` does not exist. There is only one device on CPU."""
    module.custom_device_ctx = lambda index: contextlib.nullcontext()
    _installed.append("fla: custom_device_ctx no-op")


def patch_language_once_per_launch() -> bool:
    """7. The interpreter patches ``triton.language`` once per kernel launch, not again at every
    call of a ``@triton.jit`` helper inside the kernel. A speed-up only: nothing computed changes.

    Before a launch the interpreter swaps the language modules' builtins for numpy implementations
    and restores them afterwards; each helper call inside the kernel runs the same patching again
    (in a scope that is never restored). For the modules the launch already patched that changes
    nothing (the swapped functions are no longer builtins, the rest is set to equal replacements),
    and it took a quarter to a third of the interpreter's time in kernels with helpers. A helper
    whose module sees a language module the kernel's does not (``triton.language.core`` for
    ``tl.sum``) is patched as before at its first call in the launch; that patching is never
    undone, so later calls skip it too.

    Also installed on its own by the tests (tests/conftest.py) for the kernels they interpret.
    Idempotent; returns whether this call installed it."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter.GridExecutor.__call__, "_dspark_cpu_patch", False):
        return False
    launches: List[set] = []  # per running launch: the language modules it patched
    launch = interpreter.GridExecutor.__call__
    helper_call = interpreter.InterpretedFunction.__call__

    def language_modules(fn) -> set:
        return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}

    def launch_patching_once(self, *args, **kwargs):
        launches.append(language_modules(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    def helper_call_in_patched_launch(self, *args, **kwargs):
        needed = language_modules(self.fn)
        if not launches or not needed <= launches[-1]:
            if launches:  # the interpreter's own call patches them first, for the rest of the launch
                launches[-1].update(needed)
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()  # the rest of the interpreter's own helper call
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    launch_patching_once._dspark_cpu_patch = True
    interpreter.GridExecutor.__call__ = launch_patching_once
    interpreter.InterpretedFunction.__call__ = helper_call_in_patched_launch
    return True


def convert_bf16_by_bits() -> bool:
    """8. The interpreter's bf16 <-> fp32 conversions as bit operations. A speed-up only: the same
    bits come out for every input but fp32 subnormals, which it mangled (below).

    The interpreter converts floats with one generic routine (``_convert_float``: sign, exponent and
    mantissa unpacked into separate arrays, subnormals normalised in a loop over the mantissa bits),
    and with bf16 held as raw bits (shim 5) every bf16 load, store and operation goes through it: a
    fifth of a CPU server's time. bf16 is the upper half of fp32, so widening is a 16-bit shift and
    the interpreter's narrowing (it truncates; a GPU rounds to nearest even) drops the lower half.
    An fp32 subnormal narrowed by the generic routine kept its normalised mantissa with a zero
    exponent (a different value); here it truncates like every other input. Other conversions
    (fp16, fp8, explicit rounding modes) still take the generic routine.

    Also installed on its own by the tests (tests/conftest.py). Idempotent; returns whether this
    call installed it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    generic = interpreter._convert_float
    if getattr(generic, "_dspark_cpu_patch", False):
        return False
    BF16, FP32 = tl.bfloat16, tl.float32

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        data = np.ascontiguousarray(input).reshape(-1)
        if input_dtype == BF16 and output_dtype == FP32 and data.dtype.itemsize == 2:
            bits = data.view(np.uint16).astype(np.uint32) << np.uint32(16)
        elif input_dtype == FP32 and output_dtype == BF16 and rounding_mode is None and data.dtype.itemsize == 4:
            bits = (data.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        else:
            return generic(input, input_dtype, output_dtype, rounding_mode)
        return bits.reshape(np.shape(input))

    convert_float._dspark_cpu_patch = True
    convert_float.generic = generic
    interpreter._convert_float = convert_float
    return True


def numpy_dtype_table_once() -> bool:
    """9. The interpreter's Triton -> numpy dtype lookup from a table built once. A speed-up only:
    the same dtype for every input.

    ``_get_np_dtype`` builds a 19-entry dict of ``np.dtype`` objects, hashing Triton dtypes in
    Python, at every call, and the interpreter calls it for nearly every operation of every program
    (8 % of a CPU server's time). Here the table is keyed on the dtype's name and built at install;
    a dtype not in it takes the interpreter's own function (and its error).

    Also installed on its own by the tests (tests/conftest.py). Idempotent; returns whether this
    call installed it."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    generic = interpreter._get_np_dtype
    if getattr(generic, "_dspark_cpu_patch", False):
        return False
    scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32,
               tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv,
               tl.float8e4b8, tl.float8e4b15]
    table = {dtype.name: generic(dtype) for dtype in scalars}
    address = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return address
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, tl.pointer_type):
                return address
        found = table.get(getattr(tt_dtype, "name", None))
        return found if found is not None else generic(tt_dtype)

    get_np_dtype._dspark_cpu_patch = True
    get_np_dtype.generic = generic
    interpreter._get_np_dtype = get_np_dtype
    return True


# ----------------------------------------------------------------------------------------------
# The SGLang device gates (1-5: serving with DSPARK; 6: tensor parallelism; 7-8: the Mamba radix
# cache's extra_buffer strategy; docs/guide/cpu-testing.md lists each with its symptom)
# ----------------------------------------------------------------------------------------------
#
# SGLang's "CPU" (``is_cpu()``) means its own CPU engine (``SGLANG_USE_CPU_ENGINE=1`` with a
# source-built CPU sgl-kernel and AMX). A plain CPU host is neither that nor CUDA, and a few code
# paths then have no branch at all. Each patch below is installed only by ``apply()``, i.e. only
# on request (``SGLANG_DSPARK_CPU=1`` or a direct call) and only when ``torch.cuda.is_available()``
# is False, so none of them can change CUDA behaviour; in addition each one only acts on CPU
# tensors / the ``cpu`` device itself.


def _install_sglang_device_gate_patches() -> None:
    _when_imported("sglang.srt.arg_groups.speculative_hook", _gate_dspark_device_check)
    _when_imported("sglang.srt.layers.rotary_embedding.base", _gate_rotary_native_path)
    _gate_record_stream_cpu()
    _when_imported("sglang.kernels.ops.speculative.cache_locs", _gate_cache_locs_triton_branch)
    _when_imported("sglang.kernels.ops.mamba.mamba_state_scatter_triton", _gate_mamba_scatter_cpu)
    _when_imported("sglang.srt.distributed.parallel_state", _gate_pynccl_off_on_cpu)
    _when_imported("sglang.srt.arg_groups.mamba_hook", _gate_mamba_extra_buffer_on_cpu)
    _gate_pin_memory_cpu()
    _when_imported("sglang.srt.models.kimi_k3", _gate_kimi_k3_streams_cpu)
    _when_imported("sglang.kernels.ops.gemm.kimi_k3", _gate_kimi_k3_tiny_gemm_cpu)
    _when_imported("sglang.kernels.ops.attention.kda_fused_decode", _gate_kimi_k3_fused_decode_cpu)


def _gate_dspark_device_check(speculative_hook) -> None:
    """Gate 1: ``_handle_dspark`` refuses ``--device cpu``.

    ``arg_groups/speculative_hook.py`` raises "DSpark speculative decoding only supports CUDA,
    NPU or XPU device." It is a policy check on the device *name* only: nothing else in
    ``_handle_dspark`` reads the device. While ``_handle_dspark`` runs for ``device == "cpu"`` the
    read-only config view it builds reports ``cuda`` for ``.device`` (to that one function frame
    only), so the rest of DSPARK's argument resolution runs unchanged. CUDA/NPU/XPU devices pass
    straight through."""
    original = speculative_hook._handle_dspark
    if getattr(original, "_dspark_cpu_patch", False):
        return
    original_code = original.__code__

    class _DeviceAsCuda:
        __slots__ = ("_view",)

        def __init__(self, view):
            object.__setattr__(self, "_view", view)

        def __getattr__(self, name):
            value = getattr(object.__getattribute__(self, "_view"), name)
            if name == "device" and value == "cpu":
                return "cuda"
            return value

    def _handle_dspark(server_args):
        device = getattr(server_args, "device", None)
        if device != "cpu":
            return original(server_args)
        resolving_view = speculative_hook.resolving_view

        def view_for_handle_dspark(args):
            view = resolving_view(args)
            if sys._getframe(1).f_code is original_code:
                return _DeviceAsCuda(view)
            return view

        speculative_hook.resolving_view = view_for_handle_dspark
        try:
            return original(server_args)
        finally:
            speculative_hook.resolving_view = resolving_view

    _handle_dspark._dspark_cpu_patch = True
    _handle_dspark.__wrapped__ = original
    speculative_hook._handle_dspark = _handle_dspark
    _installed.append("sglang: DSPARK accepts --device cpu")


def _gate_rotary_native_path(rotary_base) -> None:
    """Gate 2: ``RotaryEmbedding`` imports ``vllm._custom_ops`` on a plain CPU host.

    ``layers/rotary_embedding/base.py`` picks a "fallback kernel" for any platform that is not
    CUDA, ``is_cpu()``, XPU, NPU, MUSA, MPS or out-of-tree, and imports it from vllm
    (``No module named 'vllm'``; the DSPARK draft's RoPE hits this). The module's ``_is_cpu``
    flag is read only in that condition; setting it makes a plain CPU host take the same branch as
    SGLang's CPU engine: no fallback kernel, and forward dispatch (no platform key on a plain host)
    goes to ``forward_native``, the pure-PyTorch RoPE."""
    rotary_base._is_cpu = True
    _installed.append("sglang: RoPE forward_native")


def _gate_record_stream_cpu() -> None:
    """Gate 3: ``Tensor.record_stream`` on a CPU tensor.

    ``DSparkWorkerV2._forward_decode`` calls ``batch.seq_lens.record_stream(
    torch.get_device_module(device).current_stream())``; for ``cpu`` torch raises
    ``RuntimeError: unknown parameter type``. ``record_stream`` only informs the device's caching
    allocator, which CPU tensors do not use, so for CPU tensors it becomes a no-op; every other
    device keeps torch's own method."""
    import torch

    original = torch.Tensor.record_stream
    if getattr(original, "_dspark_cpu_patch", False):
        return

    def record_stream(self, stream):
        if self.device.type != "cpu":
            return original(self, stream)
        return None

    record_stream._dspark_cpu_patch = True
    torch.Tensor.record_stream = record_stream
    _installed.append("torch: record_stream no-op on CPU tensors")


def _gate_cache_locs_triton_branch(cache_locs) -> None:
    """Gate 4: the verify-window cache locations come back as ``None`` on a plain CPU host.

    ``kernels/ops/speculative/cache_locs.py`` (``assign_extend_cache_locs_uniform_func`` and
    ``assign_extend_cache_locs_func``) launch their Triton kernel under
    ``if _is_cuda or _is_hip or _is_musa or _is_xpu``, have NPU and ``is_cpu()`` branches, and
    otherwise fall through returning None (``'NoneType' object has no attribute 'view'`` in
    ``dspark_planner.py``). The module's ``_is_cuda`` is read only in those two "launch the Triton
    kernel" conditions, so we set it: under ``TRITON_INTERPRET=1`` the Triton kernel runs on CPU
    tensors."""
    cache_locs._is_cuda = True
    _installed.append("sglang: cache_locs Triton branch")


def _gate_mamba_scatter_cpu(scatter) -> None:
    """Gate 5: the mamba-state commit scatters reject CPU tensors.

    ``kernels/ops/mamba/mamba_state_scatter_triton.py``: ``fused_mamba_state_scatter_with_mask``
    and ``fused_conv_window_scatter_with_mask`` raise "only supports CUDA/XPU tensors" (reached
    from the DSPARK commit, ``update_mamba_state_after_mtp_verify``). For CPU tensors we run the
    same gather-scatter in PyTorch, with the kernels' semantics: for each request ``i`` whose step
    is ``>= 0`` and whose indices are in range, ``dst[:, dst_idx[i]] = src[:, src_row[i],
    step[i]]`` (``src_row`` defaults to ``i``). Tensors on any other device go to SGLang's
    original function unchanged."""

    def make(original, check_src_nonnegative: bool):
        if getattr(original, "_dspark_cpu_patch", False):
            return original

        def scatter_fn(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None):
            if dst.device.type != "cpu" or src.device.type != "cpu":
                return original(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw)
            _torch_state_scatter(
                dst, src, dst_indices_raw, step_indices_raw, src_indices_raw, check_src_nonnegative
            )

        scatter_fn._dspark_cpu_patch = True
        scatter_fn.__wrapped__ = original
        scatter_fn.__name__ = original.__name__
        scatter_fn.__doc__ = original.__doc__
        return scatter_fn

    _rebind(
        scatter,
        "fused_mamba_state_scatter_with_mask",
        make(scatter.fused_mamba_state_scatter_with_mask, True),
    )
    _rebind(
        scatter,
        "fused_conv_window_scatter_with_mask",
        make(scatter.fused_conv_window_scatter_with_mask, False),
    )
    _installed.append("sglang: mamba state scatter on CPU")


def _gate_pynccl_off_on_cpu(parallel_state) -> None:
    """Gate 6 (tensor parallelism, ``--tp-size > 1``): process groups ask for PyNccl on a plain CPU host.

    ``distributed/parallel_state.py``'s ``init_model_parallel_group`` turns PyNccl on for every
    platform but NPU / XPU / an out-of-tree one without it, and ``GroupCoordinator`` then enters
    ``torch.cuda.device("cpu")`` ("Expected a cuda device, but got: cpu"). Without a GPU there is
    no NCCL: the groups' collectives on CPU tensors already go to ``torch.distributed`` over gloo
    (``all_reduce``'s ``input_.is_cpu`` branch), so the default becomes "no PyNccl". A caller that
    asks for PyNccl explicitly is left as it is."""
    original = parallel_state.init_model_parallel_group
    if getattr(original, "_dspark_cpu_patch", False):
        return

    def init_model_parallel_group(*args, **kwargs):
        if kwargs.get("use_pynccl") is None and len(args) < 4:
            kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    init_model_parallel_group._dspark_cpu_patch = True
    init_model_parallel_group.__wrapped__ = original
    parallel_state.init_model_parallel_group = init_model_parallel_group
    _installed.append("sglang: no PyNccl on CPU process groups")


def _gate_mamba_extra_buffer_on_cpu(mamba_hook) -> None:
    """Gate 7 (``--mamba-radix-cache-strategy extra_buffer``): refused on a plain CPU host.

    ``arg_groups/mamba_hook.py``'s ``validate_mamba_extra_buffer`` asserts
    ``_platform_supports_mamba_cache_extra_buffer()``, which is true for CUDA, MUSA, NPU, HIP,
    XPU and out-of-tree platforms that say so, and false here. It is a policy check: the
    strategy's state snapshots (track slots, copies between slots) are tensor indexing and
    SGLang's mamba scatters (gate 5), which run on CPU tensors. The check is the function's only
    use, so it answers True; ``cpu_flags`` still selects ``no_buffer`` unless a caller asks for
    ``extra_buffer`` (``tests/e2e/test_prefix_cache_e2e.py``)."""
    original = mamba_hook._platform_supports_mamba_cache_extra_buffer
    if getattr(original, "_dspark_cpu_patch", False):
        return

    def _platform_supports_mamba_cache_extra_buffer() -> bool:
        return True

    _platform_supports_mamba_cache_extra_buffer._dspark_cpu_patch = True
    _platform_supports_mamba_cache_extra_buffer.__wrapped__ = original
    mamba_hook._platform_supports_mamba_cache_extra_buffer = _platform_supports_mamba_cache_extra_buffer
    _installed.append("sglang: Mamba radix extra_buffer on CPU")


def _gate_pin_memory_cpu() -> None:
    """Gate 8 (plain decode with ``extra_buffer``): ``Tensor.pin_memory`` without a CUDA driver.

    ``ScheduleBatch.prepare_for_decode`` copies the radix track mask with
    ``track_mask_cpu.pin_memory().to(device, non_blocking=True)``; without a CUDA driver torch
    raises "Found no NVIDIA driver on your system". Pinned host memory only speeds up copies to a
    device, and the copy here goes to ``cpu``, so on a host without CUDA ``pin_memory`` returns
    the tensor itself (this patch is installed only there: ``apply()``)."""
    import torch

    original = torch.Tensor.pin_memory
    if getattr(original, "_dspark_cpu_patch", False):
        return

    def pin_memory(self, *args, **kwargs):
        if self.device.type == "cpu" and not torch.cuda.is_available():
            return self
        return original(self, *args, **kwargs)

    pin_memory._dspark_cpu_patch = True
    pin_memory.__wrapped__ = original
    torch.Tensor.pin_memory = pin_memory
    _installed.append("torch: pin_memory is the tensor itself without CUDA")


def _gate_kimi_k3_streams_cpu(kimi_k3) -> None:
    """Gate 9 (Kimi-K3 models): ``KimiK3LinearModel`` creates three CUDA streams unconditionally.

    ``models/kimi_k3.py`` builds ``self.alt_streams = [torch.cuda.Stream() for _ in range(3)]``
    (off only on HIP); without a CUDA driver that raises "CUDA driver version is insufficient".
    Every consumer of those streams checks ``stream is not None`` (and uses them only under CUDA
    graph capture), so while the model's ``__init__`` runs on a host without CUDA,
    ``torch.cuda.Stream()`` gives None: the K3 layers take their one-stream paths."""
    import torch

    model_cls = kimi_k3.KimiK3LinearModel
    original = model_cls.__init__
    if getattr(original, "_dspark_cpu_patch", False):
        return

    def __init__(self, *args, **kwargs):
        if torch.cuda.is_available():
            return original(self, *args, **kwargs)
        stream_cls = torch.cuda.Stream
        torch.cuda.Stream = lambda *a, **k: None
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.Stream = stream_cls

    __init__._dspark_cpu_patch = True
    __init__.__wrapped__ = original
    model_cls.__init__ = __init__
    _installed.append("sglang: Kimi-K3 without alt streams on CPU")


def _gate_kimi_k3_tiny_gemm_cpu(k3_gemm) -> None:
    """Gate 10 (Kimi-K3 models): K3's small projections launch a CUDA JIT GEMM.

    ``kernels/ops/gemm/kimi_k3.py``'s ``kimi_k3_tiny_gemm`` sends shapes it has tuned (K3's
    ``f_b`` projection of 12 heads among them) with a few tokens to ``tiny_gemm_bf16``, a CUDA JIT
    kernel that reads the SM count ("Found no NVIDIA driver"); everything else goes to
    ``torch.nn.functional.linear``. The module's ``_is_npu`` is read only in that condition (NPU
    hosts take the torch path), so we set it: a CPU host takes the torch path too."""
    k3_gemm._is_npu = True
    _installed.append("sglang: Kimi-K3 tiny GEMM through torch")


def _gate_kimi_k3_fused_decode_cpu(kda_fused_decode) -> None:
    """Gate 11 (Kimi-K3 models, stock SGLang's decode): the K3 fused decode is a CUDA JIT kernel.

    For a K3 layer of 12 heads per rank, SGLang's ``KDAAttnBackend.forward_decode`` runs
    ``kda_fused_decode.kda_fused_decode`` (conv, recurrence and gated RMSNorm in one CUDA kernel)
    whenever ``kda_fused_decode.covered(...)`` accepts the shapes; building it needs nvcc and a GPU
    ("Failed to build JIT module"). ``covered`` is SGLang's own gate for that kernel: answering
    False for CPU tensors sends decode down SGLang's unfused Triton chain, and the model applies
    ``o_norm`` itself (the path SGLang takes for any shape the kernel does not cover)."""
    original = kda_fused_decode.covered
    if getattr(original, "_dspark_cpu_patch", False):
        return

    def covered(mixed_qkv, *args, **kwargs):
        if mixed_qkv.device.type == "cpu":
            return False
        return original(mixed_qkv, *args, **kwargs)

    covered._dspark_cpu_patch = True
    covered.__wrapped__ = original
    kda_fused_decode.covered = covered
    _installed.append("sglang: Kimi-K3 fused decode off for CPU tensors")


def _torch_state_scatter(dst, src, dst_indices, step_indices, src_rows, check_src_nonnegative):
    """``dst[:, dst_indices[i]] = src[:, src_rows[i], step_indices[i]]`` for the valid ``i``."""
    import torch

    n = step_indices.shape[0]
    if n == 0 or dst.numel() == 0:
        return
    steps = step_indices.to(torch.int64)
    dsts = dst_indices.to(torch.int64)
    rows = torch.arange(n, dtype=torch.int64) if src_rows is None else src_rows.to(torch.int64)
    valid = (steps >= 0) & (dsts >= 0) & (dsts < dst.shape[1])
    valid &= (rows < src.shape[1]) & (steps < src.shape[2])
    if check_src_nonnegative:
        valid &= rows >= 0
    if not bool(valid.any()):
        return
    dsts, rows, steps = dsts[valid], rows[valid], steps[valid]
    dst[:, dsts] = src[:, rows, steps].to(dst.dtype)
