"""Launch configurations of the bundled kernels, keyed on (heads, batch, window).

A small static table (no runtime autotuning: every call must be CUDA-graph capturable and
host-sync free). The wrappers use it unless the caller passes ``block_v`` / ``block_k`` /
``num_warps`` explicitly. Numbers come from ``benchmarks/bench_kernels.py --sweep`` on an H200
(the table's choice was also the best or within 2 % on an H100); the rules are in
docs/design/architecture.md ("Launch table"). Under the Triton interpreter (CPU tests) the
largest tiles are used, because the interpreter's cost is per program, not per element.

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


def verify_ring(H: int, N: int, steps: int, impl: Optional[str] = None, lazy: bool = False) -> dict:
    """Ring-mode (ReplaySSM) verify: ``impl`` "chunked" (prep + streaming tl.dot kernels,
    mtp_verify_chunked.py) or "rows" (the recurrent kernel), with its tiles. ``impl`` given:
    that kernel's tiles (a forced "chunked" below the table's threshold takes the large-batch tiles).

    The chunked kernels win from N*H = 384 at windows up to 4 tokens, 128 at 5..8 and 96 above;
    below, the single recurrent launch has less latency. Windows of 5+ tokens run the finish
    kernel (the window's ``T x T`` algebra once per head), whose streaming kernel then takes 64 V
    rows with 2 warps; up to 4 tokens the extra launch costs more than it saves. Prep: 32-channel
    chunks with one warp, 64 channels with two warps at 16-token windows of large batches (H200
    sweeps).

    ``lazy`` (the lazy record ring): always the chunked kernels (the only ones that keep records),
    with the same tiles, except 4 warps for the finished streaming kernel (windows of 5+ tokens):
    with its 16-wide epilogue products it needs 236 registers with 2 (``benchmarks/sass_report.py
    --lazy``, 8-token windows; 164 with 4). Such windows keep the lazy ring off by default: its step
    is still slower there than verify + fold (docs/design/lazy-record-ring.md)."""
    if lazy:
        cfg = verify_ring(H, N, steps, "chunked")
        return dict(cfg, num_warps=4) if cfg["finish"] else cfg
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
    """Recurrent verify (snapshot mode, and ring mode with ``impl="rows"``): 64 rows x 2 warps
    from N*H >= 128 in both modes, 32 rows x 4 warps below (H200 sweeps)."""
    if interpreting():
        return dict(block_v=128, num_warps=4)
    if _programs(N, H) < 128:
        return dict(block_v=32, num_warps=4)
    return dict(block_v=64, num_warps=2)


def fold(H: int, N: int, layers: int) -> dict:
    """ReplaySSM fold: one program per (request, layer, head, V-tile) of ``block_v`` rows, one warp:
    4-row tiles up to N*layers*H = 192, 16-row tiles above (H200 probes with the conv roll as in
    serving)."""
    if interpreting():
        return dict(block_v=128, num_warps=4)
    if _programs(N, H) * max(1, layers) <= 192:
        return dict(block_v=4, num_warps=1)
    return dict(block_v=16, num_warps=1)


def decode(H: int, N: int, buffered: bool = False, factored: bool = False) -> dict:
    """Decode: one program per (request, head), looping over V-tiles of ``block_v`` rows: the whole
    128-row tile with 4 warps while N*H <= 1024 (latency-bound), 32-row tiles with 1 warp above
    (H200 sweep).
    Buffered (SGLang's decode ring): 32-row tiles with 4 warps at every size, the only tile of
    those tried that compiles for sm_90 without spills (the ring's 16 x 128 carried keys and the
    ``tl.dot`` operands stay live across the V loop; 1 warp spills 976 B, 128 rows 464 B:
    ``benchmarks/sass_report.py decode --buffered``). The factored buffered step (``impl="factored"``)
    keeps no ring tile live across the V loop and has no ``tl.dot`` (no spills at 1 warp):
    the whole tile with 4 warps while N*H <= 256, 32-row tiles with 1 warp above (H200
    sweep of 7 tiles at N = 8, 32, 64, 256, H=32, 2026-12-04)."""
    if interpreting():
        return dict(block_v=128, num_warps=4)
    if buffered and factored:
        return dict(block_v=128, num_warps=4) if _programs(N, H) <= 256 else dict(block_v=32, num_warps=1)
    if buffered:
        return dict(block_v=32, num_warps=4)
    if _programs(N, H) <= 1024:
        return dict(block_v=128, num_warps=4)
    return dict(block_v=32, num_warps=1)
