"""The commit after a verify must not make the host wait for the GPU (GPU only).

SGLang's overlap scheduler prepares the next batch on the host while the GPU runs this one; a
commit that waits for the GPU (a hidden host sync, or a launch that blocks) serialises the two and
leaves the GPU idle while the host works. Here the GPU is kept busy (``torch.cuda._sleep``) while
each commit path and each of its parts is called; the call must return long before the GPU is
done, and ``torch.cuda.set_sync_debug_mode("error")`` must see no synchronising CUDA call.
The CPU counterpart (dispatch-level sync count through the backend) is
``tests/test_backend.py::test_speculative_step_makes_no_host_sync``.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from sglang_dspark_plugin.commit import _commit_lazy_records, delta_ring
from sglang_dspark_plugin.kernels import replayssm_fold
from sglang_dspark_plugin.kernels.conv_window import copy_conv_windows
from sglang_dspark_plugin.kernels.record_ring import commit_records, materialize_records

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

LAYERS, SLOTS, H, L, STEPS, N = 2, 9, 4, 8, 4, 6
BUSY_S = 0.2  # GPU work queued ahead of each call
MAX_HOST_S = 0.05  # a call that returns later than this waited for the GPU


def _pool():
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rn(*shape, dtype=torch.float32, scale=0.1):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    D = 3 * H * 128
    caches = SimpleNamespace(
        temporal=rn(LAYERS, SLOTS, H, 128, 128),
        replayssm_rawv=rn(LAYERS, SLOTS, H, L, 128, dtype=bf16),
        replayssm_rawk=rn(LAYERS, SLOTS, H, L, 128, dtype=bf16),
        replayssm_g=-rn(LAYERS, SLOTS, H, L, 128).abs(),
        replayssm_beta=rn(LAYERS, SLOTS, H, L).abs() + 0.5,
        replayssm_d=rn(LAYERS, SLOTS, H, L, 128),
        conv=[rn(LAYERS, SLOTS, 3, D, dtype=bf16)],
        intermediate_conv_window=[rn(LAYERS, N, STEPS, 3, D, dtype=bf16)],
    )
    i32 = dict(dtype=torch.int32, device=dev)
    args = SimpleNamespace(
        cursor=torch.randint(0, L - STEPS + 1, (SLOTS,), **i32),
        slots=torch.tensor([1, 2, 3, 4, 5, -1], **i32),
        rows=torch.arange(N, **i32),
        accept=torch.tensor([1, 2, 3, 4, 2, 1], **i32),
        track_slots=torch.tensor([6, 7, -1, 8, -1, -1], **i32),
        track_steps=torch.tensor([0, 1, -1, 2, -1, -1], **i32),
    )
    return caches, args


def _calls():
    caches, a = _pool()
    conv, icw = caches.conv[0], caches.intermediate_conv_window[0]
    return {
        "lazy commit (with track)": lambda: _commit_lazy_records(
            a.cursor, caches, a.slots, a.rows, a.accept, a.track_slots, a.track_steps, steps=STEPS),
        "lazy commit (no track)": lambda: _commit_lazy_records(
            a.cursor, caches, a.slots, a.rows, a.accept, None, None, steps=STEPS),
        "commit_records (with track)": lambda: commit_records(
            a.cursor, a.slots, a.accept, conv, icw, a.rows, steps=STEPS, ring_len=L, track_slot_indices=a.track_slots,
            track_steps=a.track_steps),
        "materialize_records": lambda: materialize_records(
            caches.temporal, caches.replayssm_rawk, caches.replayssm_g, caches.replayssm_beta, delta_ring(caches),
            a.slots, a.accept, a.track_slots),
        "copy_conv_windows": lambda: copy_conv_windows(conv, icw, a.slots, a.rows, a.accept - 1),
        "cursor reset (index_fill_)": lambda: a.cursor.index_fill_(0, a.track_slots.clamp(min=0).long(), 0),
        "replayssm_fold (with track)": lambda: replayssm_fold(
            caches.temporal, caches.replayssm_rawv, caches.replayssm_rawk, caches.replayssm_g,
            caches.replayssm_beta, a.slots, a.accept, conv_state=conv, intermediate_conv=icw,
            intermediate_rows=a.rows, track_slot_indices=a.track_slots, track_steps=a.track_steps),
    }


CALL_NAMES = ["lazy commit (with track)", "lazy commit (no track)", "commit_records (with track)", "materialize_records",
              "copy_conv_windows", "cursor reset (index_fill_)", "replayssm_fold (with track)"]


def _busy_gpu_cycles() -> int:
    """``torch.cuda._sleep`` cycles that keep the GPU busy for about ``BUSY_S``. Timed twice, the
    second one counts: an idle GPU raises its clock during the first (the first test on a fresh
    H200 once calibrated at the low clock and queued only 70 ms of sleep)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
    return int(10_000_000 * BUSY_S * 1e3 / start.elapsed_time(end))


@pytest.mark.parametrize("name", CALL_NAMES)
def test_commit_returns_while_the_gpu_is_busy(name):
    call = _calls()[name]
    call()  # compile, allocate
    torch.cuda.synchronize()
    cycles = _busy_gpu_cycles()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    left_s = time.perf_counter() - t1
    print(f"{name}: host {host_s * 1e3:.2f} ms, GPU still busy {left_s * 1e3:.1f} ms after it returned")
    assert host_s < MAX_HOST_S and left_s > BUSY_S / 2, (
        f"{name} returned after {host_s * 1e3:.1f} ms with the GPU busy for {left_s * 1e3:.1f} ms more: "
        "it waited for the GPU")
