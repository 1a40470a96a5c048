"""replayssm_fold: == snapshot step a-1 for every accept length, all layers in one launch, track
snapshots, conv roll, padding / accept-0 no-ops, and a 200-cycle verify -> accept -> fold run."""

import random

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, same_bytes

from sglang_dspark_plugin.kernels import mtp_verify, replayssm_fold
from sglang_dspark_plugin.kernels import reference as R

CUDA = torch.cuda.is_available()


def _two_layer_verify(num_spec, dtype, lb, seed, H=2):
    """Two KDA layers of one batch, each verified twice (snapshot + ring) from the same pool."""
    N = 4
    steps = 1 + num_spec
    layers = []
    for layer in range(2):
        p = make_problem(N=N, H=H, num_spec=num_spec, dtype=dtype, lower_bound=lb, seed=seed + layer,
                         slot_list=[5, 1, -1, 3], row_list=[1, 3, 0, 2], slots=7, rows=4)
        icw_s, issm = p.new_icw(), p.new_issm()
        mtp_verify(*p.acts(), intermediate_conv=icw_s, intermediate_ssm=issm, **p.verify_kwargs())
        icw_g, rings = p.new_icw(), p.new_rings(L=2 * steps)
        mtp_verify(*p.acts(), intermediate_conv=icw_g, **rings, **p.verify_kwargs())
        assert torch.equal(icw_s.nan_to_num(), icw_g.nan_to_num())
        layers.append((p, issm, icw_g, rings))
    stack = lambda f: torch.stack([f(x) for x in layers])  # noqa: E731
    return dict(
        p=layers[0][0], ps=[x[0] for x in layers],
        ssm=stack(lambda x: x[0].ssm_state), conv=stack(lambda x: x[0].conv_state),
        issm=stack(lambda x: x[1]), icw=stack(lambda x: x[2]),
        rings={k: stack(lambda x, k=k: x[3][k]) for k in layers[0][3]},
    )


@pytest.mark.parametrize("num_spec,dtype,lb", [(3, torch.float32, None), (3, torch.bfloat16, -5.0),
                                               (1, torch.float32, -5.0)] +
                         ([(7, torch.float32, None), (15, torch.bfloat16, -5.0)] if CUDA else []),
                         ids=lambda x: str(x).replace("torch.", ""))
def test_fold_equals_snapshot_every_accept_length(num_spec, dtype, lb):
    v = _two_layer_verify(num_spec, dtype, lb, seed=100 + num_spec)
    p = v["p"]
    steps = p.steps
    dev = p.q.device
    slots = p.extra["slot_list"]  # [5, 1, -1, 3]; request 2 is padding
    rows = p.extra["row_list"]
    bit_exact = True
    # every accept length 0..steps is seen by requests 0, 1 and 3 across the shifts
    for shift in range(steps + 1):
        acc = [(shift + 2 * n) % (steps + 1) for n in range(p.N)]
        track_steps = [a - 2 if a >= 2 else -1 for a in acc]  # state after step a-2 -> spare slots
        # the pool's states behind one guard slot: a write to slot -1 of layer 0 lands there
        layers, slots_ = v["ssm"].shape[:2]
        guarded = torch.full((1 + layers * slots_, *v["ssm"].shape[2:]), 7.0, device=dev)
        ssm = guarded[1:].view(v["ssm"].shape)
        ssm.copy_(v["ssm"])
        conv = v["conv"].clone()
        spare = {0: 0, 1: 2, 3: 4}  # request -> its track slot (slots no request folds into)
        tslots = [spare.get(n, -1) for n in range(p.N)]
        if shift % 2:  # a live request with a track step but no track slot: nothing to write
            tslots[3] = -1  # (slot -1 of layer 1 would be layer 0's slot 6, checked untouched)
        ret = replayssm_fold(
            ssm, **v["rings"], slot_indices=p.slot_indices,
            accept_lens=torch.tensor(acc, dtype=torch.int32, device=dev),
            conv_state=conv, intermediate_conv=v["icw"], intermediate_rows=p.intermediate_rows,
            track_slot_indices=torch.tensor(tslots, dtype=torch.int32, device=dev),
            track_steps=torch.tensor(track_steps, dtype=torch.int32, device=dev))
        assert ret is ssm
        assert torch.all(guarded[0] == 7.0), "slot -1 written"
        touched = set()
        for n, (slot, row, a) in enumerate(zip(slots, rows, acc)):
            if slot < 0 or a == 0:
                continue
            touched.add(slot)
            want = v["issm"][:, row, a - 1]
            assert rel_err(ssm[:, slot], want) <= 1e-6, (n, a, rel_err(ssm[:, slot], want))
            bit_exact &= same_bytes(ssm[:, slot], want)
            assert torch.equal(conv[:, slot], v["icw"][:, row, a - 1])
            if track_steps[n] >= 0 and tslots[n] >= 0:
                touched.add(tslots[n])
                assert rel_err(ssm[:, tslots[n]], v["issm"][:, row, track_steps[n]]) <= 1e-6
        for s in range(p.slots):
            if s not in touched:
                assert same_bytes(ssm[:, s], v["ssm"][:, s]), f"slot {s} state written"
                assert same_bytes(conv[:, s], v["conv"][:, s]), f"slot {s} conv written"
    if not CUDA:  # same numpy ops in the same order: the interpreter must be bit-exact
        assert bit_exact


@pytest.mark.parametrize("tile", [None, (4, 1), (8, 1), (16, 1), (16, 4)], ids=str)
def test_fold_single_layer_and_reference(tile):
    """Random rings (not from a verify), single-layer tensors, float64 fold reference; the launch
    table's tiles (H200: 4 or 16 rows per warp) and previous defaults."""
    g = torch.Generator().manual_seed(5)
    dev = "cuda" if CUDA else "cpu"
    slots, H, L = 4, 2, 8
    ssm = (torch.randn(slots, H, 128, 128, generator=g) * 0.5).to(dev)
    rings = dict(
        ring_rawv=torch.randn(slots, H, L, 128, generator=g).bfloat16().to(dev),
        ring_rawk=torch.randn(slots, H, L, 128, generator=g).bfloat16().to(dev),
        ring_g=(-torch.rand(slots, H, L, 128, generator=g) * 3).to(dev),
        ring_beta=torch.rand(slots, H, L, generator=g).to(dev),
    )
    slot_idx = torch.tensor([2, -1, 0, 3], dtype=torch.int32, device=dev)
    acc = torch.tensor([5, 3, 0, 8], dtype=torch.int32, device=dev)
    ssm_r = ssm.to(F64)
    R.replayssm_fold_ref(ssm_r, *(r.to(F64) for r in rings.values()), slot_idx, acc)
    before = ssm.clone()
    kw = {} if tile is None else dict(block_v=tile[0], num_warps=tile[1])
    replayssm_fold(ssm, **rings, slot_indices=slot_idx, accept_lens=acc, **kw)
    assert rel_err(ssm, ssm_r) <= 1e-5
    assert same_bytes(ssm[0], before[0]) and same_bytes(ssm[1], before[1])  # accept 0 / unused


def test_200_cycles_verify_accept_fold():
    """200 cycles of ring-mode verify -> random accept -> fold (+ conv roll) stay within 1e-5 of an
    uninterrupted float64 sequential run over the accepted tokens (N=2, H=1, num_spec=3, fp32).

    Under the CPU interpreter the V-tile is 128 (one program per request and head) to keep the run
    near 30 s; V-split is covered by the other tests. Compiled on a GPU it uses the default tile.
    """
    cycles = 200
    bv = None if CUDA else 128
    N, H, num_spec = 2, 1, 3
    steps = 1 + num_spec
    rng = random.Random(0)
    p = make_problem(N=N, H=H, num_spec=num_spec, dtype=torch.float32, lower_bound=-5.0, seed=77,
                     slot_list=[2, 0], slots=3)
    dev = p.q.device
    icw = p.new_icw()
    rings = p.new_rings(L=2 * steps)
    S64 = [p.ssm_state[s].to(F64) for s in p.extra["slot_list"]]
    W64 = [p.conv_state[s].to(F64) for s in p.extra["slot_list"]]
    par64 = dict(conv_weight=p.conv_weight.to(F64), A_log=p.A_log.to(F64), dt_bias=p.dt_bias.to(F64),
                 lower_bound=p.lower_bound)
    g = torch.Generator().manual_seed(123)
    worst_out = worst_state = 0.0
    for c in range(cycles):
        mixed = torch.randn(p.T, p.D, generator=g).to(dev)
        q, k, v = (mixed[:, i * H * 128:(i + 1) * H * 128].view(1, p.T, H, 128) for i in range(3))
        a = torch.randn(1, p.T, H, 128, generator=g).to(dev)
        b = torch.randn(1, p.T, H, generator=g).to(dev)
        out = mtp_verify(q, k, v, a, b, **p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state,
                         slot_indices=p.slot_indices, cu_seqlens=p.cu_seqlens, num_spec=num_spec,
                         intermediate_conv=icw, intermediate_rows=p.intermediate_rows, **rings, block_v=bv)
        acc = [rng.randint(1, steps) for _ in range(N)]
        replayssm_fold(p.ssm_state, **rings, slot_indices=p.slot_indices,
                       accept_lens=torch.tensor(acc, dtype=torch.int32, device=dev),
                       conv_state=p.conv_state, intermediate_conv=icw, intermediate_rows=p.intermediate_rows,
                       block_v=bv)
        for n, slot in enumerate(p.extra["slot_list"]):
            sl = slice(n * steps, n * steps + acc[n])
            o64, S64[n], W64[n] = R.sequential_ref(
                *(x[:, sl].to(F64) for x in (q, k, v, a, b)), **par64, state=S64[n], window=W64[n],
                act_dtype=torch.float32)
            worst_out = max(worst_out, rel_err(out[0, sl], o64))
            worst_state = max(worst_state, rel_err(p.ssm_state[slot], S64[n]))
            assert torch.equal(p.conv_state[slot].to(F64), W64[n])
    print(f"200 cycles: worst output rel err {worst_out:.2e}, worst state rel err {worst_state:.2e}")
    assert worst_out <= 1e-5, worst_out
    assert worst_state <= 1e-5, worst_state
