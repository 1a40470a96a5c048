"""mtp_verify against the float64 reference, in both modes, with padding and short requests."""

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, same_bytes, state_tol, tol

from sglang_dspark_plugin.kernels import mtp_verify
from sglang_dspark_plugin.kernels import reference as R

CUDA = torch.cuda.is_available()

# (num_spec, dtype, lower_bound): every value of each axis appears; the GPU gets the full product.
if CUDA:
    CASES = [(ns, dt, lb) for ns in (0, 3, 7, 15) for dt in (torch.float32, torch.bfloat16)
             for lb in (None, -5.0)]
else:
    CASES = [(0, torch.float32, None), (1, torch.bfloat16, -5.0), (3, torch.float32, -5.0),
             (3, torch.bfloat16, None)]


# fp32 state from identical (bf16) inputs: 1e-5 on every device (kda_testutil.state_tol says why)
STATE_TOL = {dt: state_tol(dt) for dt in (torch.float32, torch.bfloat16)}


def _ids(c):
    ns, dt, lb = c
    return f"ns{ns}-{str(dt).split('.')[-1]}-lb{lb}"


def _scenario(num_spec, dtype, lb, seed, H=2):
    """3 requests: full window, CUDA-graph padding (slot -1), short window (1 token less)."""
    steps = 1 + num_spec
    lengths = [steps, steps, max(1, steps - 1)]
    return make_problem(N=3, H=H, num_spec=num_spec, dtype=dtype, lower_bound=lb, seed=seed,
                        slot_list=[4, -1, 1], lengths=lengths, row_list=[2, 3, 0], slots=6, rows=4)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_verify_matches_reference_both_modes(case):
    num_spec, dtype, lb = case
    p = _scenario(num_spec, dtype, lb, seed=1000 + num_spec * 10 + (lb is None))
    steps, lengths = p.steps, p.extra["lengths"]
    ssm0, conv0 = p.ssm_state.clone(), p.conv_state.clone()

    # float64 reference (snapshot + rings at once)
    icw_r = p.new_icw(F64, fill=0.0)
    issm_r = p.new_issm(F64, fill=0.0)
    rings_r = p.new_rings(act_dtype=F64, fill=0.0)
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=icw_r, intermediate_ssm=issm_r,
                             **rings_r, **p.ref_verify_kwargs())

    # snapshot mode
    out_s = torch.full_like(p.q, float("nan"), memory_format=torch.contiguous_format)
    icw_s, issm_s = p.new_icw(), p.new_issm()
    mtp_verify(*p.acts(), intermediate_conv=icw_s, intermediate_ssm=issm_s, out=out_s, **p.verify_kwargs())
    # ring mode (ring longer than the window, as in SGLang: L >= 2 * steps)
    out_g = torch.full_like(out_s, float("nan"))
    icw_g = p.new_icw()
    rings = p.new_rings(L=2 * steps)
    ring_before = {k: v.clone() for k, v in rings.items()}
    mtp_verify(*p.acts(), intermediate_conv=icw_g, out=out_g, **rings, **p.verify_kwargs())

    t = tol(dtype)
    assert not out_s.isnan().any() and not out_g.isnan().any()
    assert rel_err(out_s, out_r) <= t, rel_err(out_s, out_r)
    # ring mode's default is the chunked (tl.dot) kernel: same maths, other rounding order
    assert rel_err(out_g, out_r) <= t, rel_err(out_g, out_r)
    # the recurrent ring-mode kernel performs snapshot mode's operations exactly
    out_rows = torch.full_like(out_s, float("nan"))
    mtp_verify(*p.acts(), intermediate_conv=p.new_icw(), out=out_rows, **p.new_rings(L=2 * steps),
               **p.verify_kwargs(), impl="rows")
    assert torch.equal(out_s, out_rows), "recurrent ring and snapshot mode outputs differ"
    # padding request (n=1) and the uncovered tail are zero
    cu = p.cu_seqlens.tolist()
    assert (out_s[0, cu[1]:cu[2]] == 0).all()
    assert (out_s[0, cu[3]:] == 0).all()
    # persistent state and conv are read-only
    assert same_bytes(p.ssm_state, ssm0) and same_bytes(p.conv_state, conv0)

    for n, (slot, row, ln) in enumerate(zip(p.extra["slot_list"], p.extra["row_list"], lengths)):
        for icw in (icw_s, icw_g):
            if slot < 0:
                assert icw[row].isnan().all(), "slot -1 wrote intermediate_conv"
                continue
            assert torch.equal(icw[row, :ln].to(F64), icw_r[row, :ln]), "conv window mismatch"
            assert icw[row, ln:].isnan().all(), "steps past the request length were written"
        if slot < 0:
            assert issm_s[row].isnan().all()
            continue
        assert rel_err(issm_s[row, :ln], issm_r[row, :ln]) <= STATE_TOL[dtype]
        assert issm_s[row, ln:].isnan().all()
        for name in ("ring_rawv", "ring_rawk", "ring_g", "ring_beta"):
            got, ref = rings[name][slot], rings_r[name][slot]
            assert not got[:, :ln].isnan().any(), name
            assert rel_err(got[:, :ln], ref[:, :ln]) <= (1e-6 if name in ("ring_g", "ring_beta") else STATE_TOL[dtype]), name
            if dtype == torch.bfloat16 and name in ("ring_rawv", "ring_rawk"):  # the rounded conv outputs
                assert torch.equal(got[:, :ln].to(F64), ref[:, :ln]), name
            assert same_bytes(got[:, ln:], ring_before[name][slot, :, ln:]), f"{name} written past length"
    # rings of slots no request owns (and of the slot -1 request) untouched
    owned = [s for s in p.extra["slot_list"] if s >= 0]
    for name, r in rings.items():
        for s in range(p.slots):
            if s not in owned:
                assert same_bytes(r[s], ring_before[name][s]), f"{name} slot {s} written"


def test_verify_default_out_and_dense_layout():
    """out=None allocation, contiguous (non-view) inputs, dense cu_seqlens, V-tile 64 and 128."""
    p = make_problem(N=2, H=1, num_spec=1, dtype=torch.float32, lower_bound=None, seed=7, strided=False)
    icw_r, issm_r = p.new_icw(F64, 0.0), p.new_issm(F64, 0.0)
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=icw_r, intermediate_ssm=issm_r, **p.ref_verify_kwargs())
    outs = []
    for bv in (64, 128):
        icw, issm = p.new_icw(), p.new_issm()
        out = mtp_verify(*p.acts(), intermediate_conv=icw, intermediate_ssm=issm, block_v=bv, **p.verify_kwargs())
        assert out.shape == p.q.shape and out.dtype == p.q.dtype
        assert rel_err(out, out_r) <= 1e-5
        assert rel_err(issm[:p.N], issm_r[:p.N]) <= 1e-5
        outs.append(out)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (serving-size shapes are too slow for the interpreter)")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_verify_serving_shape(dtype):
    """N=64 requests, H=12 heads (K3 at TP8), num_spec=7, both modes, padding and short rows."""
    steps = 8
    slot_list = [(-1 if n % 9 == 4 else n + 3) for n in range(64)]
    lengths = [steps if n % 4 else 1 + n % steps for n in range(64)]
    p = make_problem(N=64, H=12, num_spec=7, dtype=dtype, lower_bound=-5.0, seed=4242, slot_list=slot_list,
                     lengths=lengths, slots=70, rows=64)
    icw_r, issm_r = p.new_icw(F64, 0.0), p.new_issm(torch.float32, 0.0)
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=icw_r, intermediate_ssm=issm_r, **p.ref_verify_kwargs())
    icw, issm = p.new_icw(), p.new_issm()
    out = mtp_verify(*p.acts(), intermediate_conv=icw, intermediate_ssm=issm, **p.verify_kwargs())
    rings = p.new_rings(L=16)
    out_g = mtp_verify(*p.acts(), intermediate_conv=p.new_icw(), **rings, **p.verify_kwargs())
    assert rel_err(out, out_r) <= tol(dtype)
    assert rel_err(out_g, out_r) <= tol(dtype)
    live = [n for n, s in enumerate(slot_list) if s >= 0]
    rows = p.intermediate_rows[live].long()
    lens = torch.tensor([lengths[n] for n in live], device=out.device)
    m = (torch.arange(steps, device=out.device)[None, :] < lens[:, None])[:, :, None, None, None]
    assert rel_err(torch.where(m, issm[rows], 0), torch.where(m, issm_r[rows], 0)) <= STATE_TOL[dtype]
