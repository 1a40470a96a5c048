"""copy_conv_windows (radix track snapshot of the conv window) against its torch reference."""

import torch

from sglang_dspark_plugin.kernels.conv_window import copy_conv_windows
from sglang_dspark_plugin.kernels.reference import copy_conv_windows_ref


def test_copy_conv_windows_matches_reference_and_skips_padding():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    layers, slots, rows, steps, H = 2, 6, 4, 4, 1
    D = 3 * H * 128
    for dtype in (torch.float32, torch.bfloat16):
        conv = torch.randn(layers, slots, 3, D, device=dev).to(dtype)
        icw = torch.randn(layers, rows, steps, 3, D, device=dev).to(dtype)
        slot_idx = torch.tensor([4, -1, 2, 5], dtype=torch.int32, device=dev)
        row_idx = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=dev)
        step_idx = torch.tensor([3, 2, 0, -1], dtype=torch.int32, device=dev)
        expected = copy_conv_windows_ref(conv.clone(), icw, slot_idx, row_idx, step_idx)
        got = copy_conv_windows(conv.clone(), icw, slot_idx, row_idx, step_idx)
        assert torch.equal(got, expected)
        assert torch.equal(got[:, 4], icw[:, 0, 3]) and torch.equal(got[:, 2], icw[:, 2, 0])
        for untouched in (0, 1, 3, 5):  # padding row (-1 slot) and step -1 write nothing
            assert torch.equal(got[:, untouched], conv[:, untouched])
