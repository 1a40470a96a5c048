"""The launch table (kernels/launch_config.py) hands every wrapper a configuration its kernel
accepts, for every shape, on the GPU branch too (evaluated here with the interpreter check off)."""

import pytest

from sglang_dspark_plugin.kernels import launch_config as LC
from sglang_dspark_plugin.kernels import validation as V

HEADS = (1, 2, 12, 32, 96)
BATCH = (1, 2, 8, 16, 32, 64, 128, 256, 1024)
STEPS = (2, 4, 5, 8, 9, 16)
POW2 = {1, 2, 4, 8, 16, 32, 64, 128}


@pytest.fixture(params=[False, True], ids=["gpu-table", "interpreter-table"])
def table(request, monkeypatch):
    monkeypatch.setattr(LC, "interpreting", lambda: request.param)
    return request.param


def test_verify_configs_are_valid(table):
    for H in HEADS:
        for N in BATCH:
            for steps in STEPS:
                for impl in (None, "rows", "chunked"):
                    cfg = LC.verify_ring(H, N, steps, impl)
                    assert cfg["impl"] in ("rows", "chunked")
                    if impl is not None:
                        assert cfg["impl"] == impl, (H, N, steps, impl, cfg)
                    assert V.check_block_v(cfg["block_v"]) == cfg["block_v"]
                    assert cfg["num_warps"] in (1, 2, 4, 8)
                    if cfg["impl"] == "chunked":
                        assert cfg["block_v"] >= 16 and cfg["block_k"] in (16, 32, 64, 128)
                        assert cfg["prep_block_k"] in (16, 32, 64, 128) and cfg["prep_num_warps"] in (1, 2, 4, 8)
                        assert cfg["finish"] == (steps > 4) and cfg["finish_num_warps"] in (1, 2, 4, 8)
            rows = LC.verify_rows(H, N, 4)  # snapshot mode
            assert V.check_block_v(rows["block_v"]) == rows["block_v"] and rows["num_warps"] in (1, 2, 4, 8)


def test_auto_choice_is_monotone_in_batch(table):
    """Once the chunked pair is chosen for a batch, every larger batch gets it too (the switch is
    a single threshold per window, not a patchwork)."""
    for H in HEADS:
        for steps in STEPS:
            impls = [LC.verify_ring(H, N, steps)["impl"] for N in BATCH]
            first = impls.index("chunked") if "chunked" in impls else len(impls)
            assert all(i == "chunked" for i in impls[first:]), (H, steps, impls)


def test_fold_and_decode_configs_are_valid(table):
    for H in HEADS:
        for N in BATCH:
            for layers in (1, 2, 20):
                f = LC.fold(H, N, layers)
                assert f["block_v"] in POW2 and f["num_warps"] in (1, 2, 4, 8)
                # a tile of fewer rows than 32 lanes x warps is fine, but not fewer than 1 row per warp
                assert f["block_v"] >= f["num_warps"]
            d = LC.decode(H, N)
            assert d["block_v"] in POW2 and d["num_warps"] in (1, 2, 4, 8)
            buffered = LC.decode(H, N, buffered=True)
            assert buffered["block_v"] >= 16  # the ring's tl.dot tile
            assert LC.decode(H, N, buffered=True, factored=True)["block_v"] >= 16  # decode() refuses less when buffered
