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

from typing import Optional

from ..settings import interpreting, pdl_enabled


def pdl_kwargs(device) -> dict:
    """Programmatic dependent launch (sm90+, compiled only): the kernel's grid is scheduled while
    the previous kernel on the stream finishes; the kernels wait (``gdc_wait``) before any access."""
    if interpreting() or device.type != "cuda":
        return {}
    import torch

    if torch.cuda.get_device_capability(device)[0] < 9 or not pdl_enabled():
        return {}
    return dict(USE_PDL=True, launch_pdl=True)


def _programs(N: int, H: int) -> int:
    return max(1, N) * max(1, H)


def verify_ring(H: int, N: int, steps: int, impl: Optional[str] = None) -> dict:
    """Ring-mode (ReplaySSM) verify: ``impl`` "chunked" (prep + streaming tl.dot kernels,
    mtp_verify_chunked.py) or "rows" (the recurrent kernel), with its tiles. ``impl`` given:
    that kernel's tiles (a forced "chunked" below the table's threshold takes the large-batch tiles).

    H200 sweeps (docs/benchmarks.md): the chunked kernels win from N*H = 384 at windows up to 4
    tokens (H=12, N=32, T=4: 22.8 against 33.1 us; N=16: 18.8 against 18.2), with the finish
    kernel from N*H = 128 at 5..8 tokens (H=12, N=16, T=8: 24.9 against 30.1; N=8: 20.8 against
    18.0) and from N*H = 96 above (H=12, N=8, T=16: 25.9 against 31.8); below that the single
    recurrent launch has less latency.
    Prep (one program per request, head and channel chunk), fourth-session probes at H=32 and H=12,
    N=64/256: 64-channel chunks up to 8-token windows, 32 above (H=32, N=64, T=16: 219.6 us against
    266.6 with 16-channel chunks and 328.9 with 64), one warp each, two above 8 tokens from
    N*H = 1024 (fifth session, T=16: H=32, N=256: 668.0 against 701.1 us; H=12, N=128: 144.1
    against 146.6; but H=12, N=64: 85.1 against 81.8; at T=8 and T=4 two warps measured no better
    or slower: 391.7 against 393.0 at N=256, 82.6 against 77.7 at N=64). Sixth session, after the
    prep issues all its loads first: 32-channel chunks at every window (H=32, N=64: 76.1 / 107.5 us
    at T=4 / 8 against 77.8 / 109.3 with 64; H=12, N=64, T=8: 50.0 against 52.0), 64 channels with
    two warps at 16-token windows from N*H = 4096 (H=32, N=256: 653.6 against 673.1). Windows of 5+ tokens
    (``finish``, fifth session): a finish kernel per (request, head) takes the window's ``T x T``
    algebra out of the streaming kernel, whose programs then take 64 V rows with 2 warps (H=32,
    N=256: 540 -> 423 us at 8-token windows, 884 -> 742 at 16); up to 4 tokens the extra launch
    costs more than it saves (H=32, N=64, T=4: 78.8 against 76.8 us), and the streaming kernel
    multiplies the state with q and k stacked in one ``tl.dot``. The finish kernel takes one warp
    per head at 8-token windows and from N*H = 1024 (H=32, N=64, T=8 / 16: 111.4 / 193.4 us against
    122.0 / 209.1 with 4 warps), 4 warps at 16-token windows of smaller batches (H=12, N=32: 45.8
    against 48.7 with one)."""
    if impl == "rows":
        return dict(impl="rows", **verify_rows(H, N, steps))
    finish = steps > 4
    nh = _programs(N, H)
    prep = dict(prep_block_k=64 if (steps > 8 and nh >= 4096) else 32,
                prep_num_warps=2 if (steps > 8 and nh >= 1024) else 1,
                finish=finish,
                finish_num_warps=1 if (steps <= 8 or nh >= 1024) else 4)
    if interpreting():
        return dict(impl="chunked", block_v=128, block_k=64, num_warps=4,
                    **dict(prep, prep_block_k=64, prep_num_warps=4))
    min_chunked = 384 if steps <= 4 else (128 if steps <= 8 else 96)
    if impl is None and nh < min_chunked:
        return dict(impl="rows", **verify_rows(H, N, steps))
    if finish:
        return dict(impl="chunked", block_v=64, block_k=32, num_warps=2, num_stages=3, **prep)
    return dict(impl="chunked", block_v=128, block_k=32, num_warps=4, num_stages=3, **prep)


def verify_rows(H: int, N: int, steps: int) -> dict:
    """Recurrent verify (snapshot mode, and ring mode with ``impl="rows"``).

    H200 sweeps, 2026-11-30 (third session, kernel with the one-token input prefetch;
    docs/benchmarks.md): 64 rows x 2 warps from N*H >= 128 in both modes (H=32 snapshot mode at
    N=64: 202 / 360 us at 4 / 8-token windows against 287 / 516 with (32, 4) and 386 / 713 with
    (64, 4); ring mode at N=8: 19.0 / 31.2 against 26.9 / 45.7 with (32, 4); H=12, N=16: 18.2 /
    30.2 against 19.8 / 33.3); (32, 4) below (H=12, N=8, ring mode: 11.2 us at T=4 against 13.2
    with (64, 2))."""
    if _programs(N, H) < 128:
        return dict(block_v=32, num_warps=4)
    return dict(block_v=64, num_warps=2)


def fold(H: int, N: int, layers: int) -> dict:
    """ReplaySSM fold: one program per (request, layer, head, V-tile) of ``block_v`` rows.

    H200 probe, 2026-11-30 (fifth session, with the conv roll as in serving): one warp per tile of
    16 rows from N*layers*H > 384 (H=32, N=256: 353.9 / 409.8 / 560.8 us at 4 / 8 / 16-token
    windows against 384.9 / 477.7 / 705.5 with 8 rows, the third session's choice; N=32, T=4: 51.0
    against 55.7; 32 or 64 rows, or two warps, slower), 4 rows per warp at smaller batches
    (third session, H=32, N=8: 13.1 / 16.8 / 25.8 us). Sixth session, after the conv roll's loads
    moved first: 4 rows only up to N*layers*H = 192 (H=32, N=8: 13.6 / 17.7 / 26.3 us at 4 / 8 /
    16-token windows with 16 rows against 14.7 / 18.4 / 27.6 with 4; H=12, N=16, T=8: 15.4 with 4
    rows against 16.0)."""
    if interpreting():
        return dict(block_v=32, num_warps=4)
    if _programs(N, H) * max(1, layers) <= 192:
        return dict(block_v=4, num_warps=1)
    return dict(block_v=16, num_warps=1)


def decode(H: int, N: int) -> dict:
    """Decode: one program per (request, head), looping over V-tiles of ``block_v`` rows.
    H200 sweep: the whole 128-row tile with 4 warps while N*H <= 1024 (latency-bound: 13.1 vs
    19.9 us at N=8, H=32), 32-row tiles with 1 warp above (81.1 / 302.2 us at N=64 / 256)."""
    if interpreting():
        return dict(block_v=32, num_warps=4)
    if _programs(N, H) <= 1024:
        return dict(block_v=128, num_warps=4)
    return dict(block_v=32, num_warps=1)
