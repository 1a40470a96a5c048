"""Kernel tests: run compiled on CUDA when present, else under the Triton interpreter on CPU.

``TRITON_INTERPRET=1`` must be set before any ``@triton.jit`` function is decorated, i.e. before
``sglang_dspark_plugin.kernels`` is imported; this conftest sets it (only when no CUDA device is
visible) and reloads the kernel modules if something imported them earlier in compiled mode.
"""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    _mods = ["sglang_dspark_plugin.kernels.common", "sglang_dspark_plugin.kernels.mtp_verify_chunked",
             "sglang_dspark_plugin.kernels.mtp_verify",
             "sglang_dspark_plugin.kernels.decode", "sglang_dspark_plugin.kernels.conv_window",
             "sglang_dspark_plugin.kernels.replayssm_fold", "sglang_dspark_plugin.kernels.record_ring",
             "sglang_dspark_plugin.kernels"]
    _mv = sys.modules.get("sglang_dspark_plugin.kernels.mtp_verify")
    if _mv is not None and type(_mv._mtp_verify_kernel).__name__ != "InterpretedFunction":
        for _m in _mods:
            if _m in sys.modules:
                importlib.reload(sys.modules[_m])

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
