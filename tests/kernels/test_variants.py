"""Launch variants of the kernels, all against the float64 reference: the chunked ring verify at
several tiles and windows (both pairwise-decay paths), the recurrent ``[block_v, 128]`` verify in
both modes, and decode at several tiles."""

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, same_bytes, state_tol, tol

from sglang_dspark_plugin.kernels import decode, mtp_verify
from sglang_dspark_plugin.kernels import reference as R

CUDA = torch.cuda.is_available()


def _problem(num_spec, dtype, lb, seed, H=1):
    steps = 1 + num_spec
    return make_problem(N=3, H=H, num_spec=num_spec, dtype=dtype, lower_bound=lb, seed=seed,
                        slot_list=[4, -1, 1], lengths=[steps, steps, max(1, steps - 2)], row_list=[2, 3, 0],
                        slots=6, rows=4)


def _ref(p):
    icw_r, issm_r = p.new_icw(F64, 0.0), p.new_issm(F64, 0.0)
    rings_r = p.new_rings(act_dtype=F64, fill=0.0)
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=icw_r, intermediate_ssm=issm_r, **rings_r,
                             **p.ref_verify_kwargs())
    return out_r, icw_r, issm_r, rings_r


@pytest.mark.parametrize("num_spec,block_v,block_k,prep_block_k,dtype,lb,finish", [
    (1, 32, 16, 32, torch.float32, -5.0, None),
    (1, 64, 32, 64, torch.float32, None, True),
    (3, 64, 32, 16, torch.float32, None, None),
    (7, 16, 64, 128, torch.bfloat16, -5.0, None),
    (7, 32, 32, 32, torch.float32, None, False),
    (15, 128, 128, 64, torch.float32, None, None),
], ids=lambda x: str(x).replace("torch.", ""))
def test_chunked_ring_tiles(num_spec, block_v, block_k, prep_block_k, dtype, lb, finish):
    """Chunked ring verify (prep, finish and streaming kernels) at several tiles, prep channel
    chunks (1 to 8 prep programs per head, their partial sums added up by the finish or streaming
    kernel), windows, with and without the finish kernel (default: from 5 tokens on; forced on at 2
    tokens, where the streaming kernel pads the window to 16 rows, and off at 8): outputs vs the
    float64 reference, conv windows and rings byte-identical to the recurrent kernel's, nothing
    written past a request or for padding."""
    p = _problem(num_spec, dtype, lb, seed=300 + num_spec)
    out_r, icw_r, _, rings_r = _ref(p)
    steps = p.steps
    rings = p.new_rings(L=2 * steps)
    icw = p.new_icw()
    out = torch.full_like(p.q, float("nan"), memory_format=torch.contiguous_format)
    mtp_verify(*p.acts(), intermediate_conv=icw, out=out, **rings, **p.verify_kwargs(), block_v=block_v,
               block_k=block_k, prep_block_k=prep_block_k, impl="chunked", dot_precision="ieee" if CUDA else None,
               finish=finish)
    rings_rows, icw_rows = p.new_rings(L=2 * steps), p.new_icw()
    mtp_verify(*p.acts(), intermediate_conv=icw_rows, **rings_rows, **p.verify_kwargs(), impl="rows")
    assert not out.isnan().any()
    assert rel_err(out, out_r) <= tol(dtype), rel_err(out, out_r)
    cu = p.cu_seqlens.tolist()
    assert (out[0, cu[1]:cu[2]] == 0).all() and (out[0, cu[3]:] == 0).all()
    for slot, row, ln in zip(p.extra["slot_list"], p.extra["row_list"], p.extra["lengths"]):
        if slot < 0:
            assert icw[row].isnan().all()
            continue
        assert torch.equal(icw[row, :ln].to(F64), icw_r[row, :ln])
        assert icw[row, ln:].isnan().all()
        for name in rings:
            got = rings[name][slot]
            assert same_bytes(got[:, :ln], rings_rows[name][slot][:, :ln]), name
            assert rel_err(got[:, :ln], rings_r[name][slot][:, :ln]) <= (1e-6 if name in ("ring_g", "ring_beta")
                                                                          else tol(dtype) / 10)
            assert got[:, ln:].isnan().all(), f"{name} written past the request"


@pytest.mark.parametrize("strength", ["mild", "strong"])
def test_chunked_decay_paths(strength):
    """The chunked kernel's two pairwise-decay paths: tensor-core factorisation for bounded
    log-decays ("mild": K3 gate) and the exact pairwise form for strong decays ("strong": softplus
    gate with A = exp(A_log) up to 400, log-decays of hundreds per token, e^{-G} far beyond fp32)."""
    lb = -5.0 if strength == "mild" else None
    p = _problem(15, torch.float32, lb, seed=77)
    if strength == "strong":
        p.A_log.copy_(torch.linspace(0.0, 6.0, p.A_log.numel(), dtype=torch.float32))
        p.dt_bias.mul_(20.0)
    out_r, _, _, _ = _ref(p)
    rings = p.new_rings(L=16)
    out = mtp_verify(*p.acts(), intermediate_conv=p.new_icw(), **rings, **p.verify_kwargs(), impl="chunked",
                     dot_precision="ieee" if CUDA else None)
    assert torch.isfinite(out).all()
    assert rel_err(out, out_r) <= 1e-5, rel_err(out, out_r)


@pytest.mark.parametrize("block_v,num_warps", [(32, 4), (64, 2), (64, 4)])
@pytest.mark.parametrize("mode", ("snapshot", "ring"))
def test_recurrent_variants(block_v, num_warps, mode):
    p = _problem(3, torch.float32, -5.0, seed=41)
    out_r, icw_r, issm_r, rings_r = _ref(p)
    icw = p.new_icw()
    kw = dict(intermediate_ssm=p.new_issm()) if mode == "snapshot" else p.new_rings(L=8)
    out = mtp_verify(*p.acts(), intermediate_conv=icw, **kw, **p.verify_kwargs(), impl="rows", block_v=block_v,
                     num_warps=num_warps)
    assert rel_err(out, out_r) <= 1e-5
    for slot, row, ln in zip(p.extra["slot_list"], p.extra["row_list"], p.extra["lengths"]):
        if slot < 0:
            continue
        assert torch.equal(icw[row, :ln].to(F64), icw_r[row, :ln])
        if mode == "snapshot":
            assert rel_err(kw["intermediate_ssm"][row, :ln], issm_r[row, :ln]) <= 1e-5


@pytest.mark.parametrize("block_v,num_warps", [(128, 4), (32, 1), (64, 2)])
def test_decode_variants(block_v, num_warps):
    p = make_problem(N=3, H=2, num_spec=0, dtype=torch.bfloat16, lower_bound=-5.0, seed=61, slot_list=[3, -1, 0],
                     slots=5)
    ssm_r, conv_r = p.ssm_state.to(F64), p.conv_state.to(F64)
    out_r = R.decode_ref(*p.acts64(), conv_weight=p.conv_weight.to(F64), A_log=p.A_log.to(F64),
                         dt_bias=p.dt_bias.to(F64), lower_bound=-5.0, ssm_state=ssm_r, conv_state=conv_r,
                         slot_indices=p.slot_indices, act_dtype=torch.bfloat16)
    before = p.ssm_state.clone()
    out = decode(*p.acts(), **p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state,
                 slot_indices=p.slot_indices, block_v=block_v, num_warps=num_warps)
    assert rel_err(out, out_r) <= tol(torch.bfloat16), rel_err(out, out_r)
    assert (out[0, 1] == 0).all()
    for s in range(p.slots):
        if s in (3, 0):
            assert rel_err(p.ssm_state[s], ssm_r[s]) <= state_tol(torch.bfloat16)
            assert torch.equal(p.conv_state[s].to(F64), conv_r[s])
        else:
            assert same_bytes(p.ssm_state[s], before[s])

