"""Launch configurations of the bundled kernels, keyed on (heads, batch, window).

A small static table (no runtime autotuning: every call must be CUDA-graph capturable and
host-sync free). The wrappers use it unless the caller passes ``block_v`` / ``block_k`` /
``num_warps`` explicitly. Numbers come from ``benchmarks/bench_kernels.py --sweep`` on an H200
(see docs/benchmarks.md); under the Triton interpreter (CPU tests) the largest tiles are used,
because the interpreter's cost is per program, not per element.

Each function returns a dict with ``block_v``, ``block_k`` and ``num_warps`` (and ``num_stages``
where it matters).
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pdl_kwargs(device) -> dict:
    """Programmatic dependent launch (sm90+, compiled only): the kernel's grid is scheduled while
    the previous kernel on the stream finishes; the kernels wait (``gdc_wait``) before any access."""
    if interpreting() or device.type != "cuda":
        return {}
    import torch

    if torch.cuda.get_device_capability(device)[0] < 9 or os.environ.get("DSPARK_KERNELS_PDL", "1") == "0":
        return {}
    return dict(USE_PDL=True, launch_pdl=True)


def _programs(N: int, H: int) -> int:
    return max(1, N) * max(1, H)


def verify_ring_impl(steps: int) -> str:
    """Ring-mode kernel. "rows": the recurrent [block_v, 128] kernel (default: fastest measured on
    the H200, see docs/benchmarks.md); "wy": the chunked form (opt-in, ``impl="wy"``)."""
    return "rows"


def verify_ring(H: int, N: int, steps: int) -> dict:
    """Chunked (WY) ring-mode verify, when asked for with ``impl="wy"``."""
    if interpreting():
        return dict(block_v=128, block_k=64, num_warps=4, num_stages=1)
    nh = _programs(N, H)
    if nh <= 128:
        return dict(block_v=32, block_k=32, num_warps=4, num_stages=2)
    if nh <= 1024:
        return dict(block_v=64, block_k=32, num_warps=4, num_stages=1)
    return dict(block_v=128, block_k=32, num_warps=8, num_stages=1)


def verify_snapshot(H: int, N: int, steps: int) -> dict:
    """Recurrent verify (snapshot mode, and ring mode with the "rows" kernel)."""
    return dict(block_v=32, block_k=16, num_warps=4)


def snapshot_impl() -> str:
    """Snapshot-mode kernel: "rows" (default) or the K-tiled "tiled" (opt-in, slower on the H200)."""
    return "rows"


def fold_impl() -> str:
    """Fold kernel: "rows" (default), "tiled" / "tiled_b" (opt-in, slower on the H200)."""
    return "rows"


def fold(H: int, N: int, layers: int) -> dict:
    """ReplaySSM fold: one program per (request, layer, head, V-tile)."""
    if interpreting():
        return dict(block_v=32, block_k=16, num_warps=4)
    return dict(block_v=16, block_k=16, num_warps=4)


def decode_impl() -> str:
    """Decode kernel: "rows" (default) or the K-tiled "tiled" (opt-in, slower on the H200)."""
    return "rows"


def decode(H: int, N: int) -> dict:
    """Decode: one program per (request, head), looping over V-tiles of ``block_v`` rows."""
    if interpreting():
        return dict(block_v=32, block_k=16, num_warps=4)
    return dict(block_v=32, block_k=16, num_warps=1)
