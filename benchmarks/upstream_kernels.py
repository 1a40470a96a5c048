"""Load sglang 0.5.23's Triton KDA kernels (and fla-core's decode) for side-by-side timing.

Where ``sglang`` is importable with its kernels the real modules are used. Otherwise the files that
``benchmarks/prepare_upstream.sh`` staged under ``.whl/upstream`` are imported with the few runtime
helpers they need (``sglang.kernels.jit.utils``, ``sglang.srt.utils``) stubbed, which is how the
GPU machine (no sglang, no package index) runs them. fla-core comes from ``.whl/fla_core-*.whl``
(unzipped to a temp dir) or an installed ``fla``.

Every loader returns ``None`` plus a note when the kernel is unavailable; the harness then skips it.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
import tempfile
import types
import zipfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# module name -> file below <root>/sglang
FILES = {
    "conv": "sglang.kernels.ops.mamba.causal_conv1d_triton",
    "recurrent": "sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",
    "fused_verify": "sglang.kernels.ops.attention.linear.fused_kda_conv_recurrent_verify",
    "fold": "sglang.kernels.ops.attention.linear.kda_replayssm_spec_decode",
    "replayssm_decode": "sglang.kernels.ops.attention.linear.fused_recurrent_linear_replayssm",
    "packed_decode": "sglang.kernels.ops.attention.fla.fused_recurrent",
    "norm_gate": "sglang.kernels.ops.attention.fla.fused_norm_gate",  # Kimi-K3's o_norm
}


def _stub(name, **attrs):
    mod = sys.modules.get(name) or types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


def _install_stubs():
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 9
    sm = (torch.cuda.get_device_capability()[0] * 10 + torch.cuda.get_device_capability()[1]
          if torch.cuda.is_available() else 90)
    _stub("sglang.kernels.jit")
    cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    ju = _stub("sglang.kernels.jit.utils", is_arch_support_pdl=lambda: major >= 9, is_hip_runtime=lambda: False,
               get_jit_cuda_arch=lambda: types.SimpleNamespace(major=cap[0], minor=cap[1]))
    sys.modules["sglang.kernels.jit"].utils = ju
    _stub("sglang.srt")
    su = _stub("sglang.srt.utils", get_device_sm=lambda: sm, is_cuda=lambda: True, is_gfx95_supported=lambda: False,
               is_hip=lambda: False, is_sm90_supported=lambda: major == 9, is_cpu=lambda: False,
               is_npu=lambda: False, is_xpu=lambda: False, cpu_has_amx_support=lambda: False,
               cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda n: 1 << (max(n, 1) - 1).bit_length())
    rel = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    sc = _stub("sglang.srt.utils.common", torch_release=rel)
    su.common = sc
    sys.modules["sglang.srt"].utils = su
    # sglang's CUDA JIT packed decode (tvm_ffi) is not available here: keep the Triton path.
    _stub("sglang.kernels.ops.attention.kda_packed_decode", covered=lambda *a, **k: False)


def load_sglang(root: str | None = None):
    """Return ``(modules: dict, source: str)``; ``modules`` maps the keys of FILES to modules."""
    root = root or os.path.join(ROOT, ".whl", "upstream")
    mods, errors = {}, []
    staged = os.path.isdir(os.path.join(root, "sglang"))
    if staged:
        for name in list(sys.modules):
            if name == "sglang" or name.startswith("sglang."):
                del sys.modules[name]
        sys.path.insert(0, root)
        _install_stubs()
        source = f"staged sglang kernels ({open(os.path.join(root, 'SOURCE')).read().strip()})" \
            if os.path.exists(os.path.join(root, "SOURCE")) else f"staged sglang kernels in {root}"
    else:
        source = "installed sglang"
    for key, name in FILES.items():
        try:
            mods[key] = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{key}: {type(e).__name__}: {str(e)[:200]}")
    if staged:
        # the stub for the CUDA packed decode must win over anything an import created
        sys.modules["sglang.kernels.ops.attention.kda_packed_decode"].covered = lambda *a, **k: False
    return mods, source, errors


def load_fla():
    """fla-core's ``fused_recurrent_kda_fwd`` or ``(None, note)``."""
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: F401
        return fused_recurrent_kda_fwd, "installed fla"
    except Exception:  # noqa: BLE001
        pass
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "fla_core-*.whl")))
    if not wheels:
        return None, "fla-core not available (no installed fla, no .whl/fla_core-*.whl)"
    dest = tempfile.mkdtemp(prefix="fla_")
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(dest)
    sys.path.insert(0, dest)
    try:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        return fused_recurrent_kda_fwd, os.path.basename(wheels[-1])
    except Exception as e:  # noqa: BLE001
        return None, f"fla import failed: {type(e).__name__}: {str(e)[:200]}"
