"""Shared test setup.

Without a GPU, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` must be set
before any ``@triton.jit`` function is defined, so it is set here, before test modules import
the kernels. ``gpu`` tests are skipped without CUDA.
"""

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/sglang_kit.py is imported by several test folders.
sys.path.insert(0, os.path.dirname(__file__))


# DSPARK_GPU_E2E_ON_CPU=1: dry-run the GPU end-to-end harness (tests/gpu) on CPU, tiny model only.
GPU_E2E_DRY_RUN = os.environ.get("DSPARK_GPU_E2E_ON_CPU") == "1"
GPU_E2E_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if GPU_E2E_DRY_RUN and str(item.fspath).startswith(GPU_E2E_DIR):
            continue
        if "gpu" in item.keywords:
            item.add_marker(skip)
