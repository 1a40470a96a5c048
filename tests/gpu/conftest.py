"""GPU end-to-end tests (marked ``gpu``: skipped without CUDA by tests/conftest.py;
``DSPARK_GPU_E2E_ON_CPU=1`` dry-runs the harness on CPU instead). Run on the GPU rig:
docs/guide/gpu-serving.md."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def fleet():
    """Every configuration of both models served once (gpu_kit.run_fleet)."""
    from gpu_kit import MODELS, run_fleet

    return run_fleet(MODELS)
