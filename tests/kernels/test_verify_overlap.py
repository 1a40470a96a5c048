"""The chunked ring verify in request groups (``overlap_groups``): each group's prep / finish on a
side stream (CUDA; in order on the CPU) must give the bytes of one group, and the float64
reference's values, with padding, short requests and uncovered tail rows."""

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, tol

from sglang_dspark_plugin.kernels import mtp_verify
from sglang_dspark_plugin.kernels import reference as R
from sglang_dspark_plugin.kernels.mtp_verify_chunked import item_groups
from sglang_dspark_plugin.kernels.mtp_verify_gluon import gluon_verify_supported

CUDA = torch.cuda.is_available()
IMPLS = ["chunked"] + (["gluon"] if CUDA and gluon_verify_supported(torch.device("cuda")) else [])
EPS = 1e-5


def test_item_groups_cover_every_request_once():
    for N in (1, 2, 5, 64, 65):
        for g in (1, 2, 3, 4, 100):
            groups = item_groups(N, g)
            assert len(groups) == min(g, N)
            assert [n0 for n0, _ in groups] == [sum(c for _, c in groups[:i]) for i in range(len(groups))]
            assert sum(c for _, c in groups) == N
            assert max(c for _, c in groups) - min(c for _, c in groups) <= 1


def _problem(num_spec, dtype, H=2):
    # 5 requests: padding (slot -1) in the middle, 1-token and short requests, so that the dense
    # rows past cu_seqlens[N] reach back into the first groups' positions
    steps = 1 + num_spec
    lengths = [steps, 1, steps, max(1, steps - 2), 1]
    return make_problem(N=5, H=H, num_spec=num_spec, dtype=dtype, lower_bound=-5.0, seed=77 + num_spec,
                        slot_list=[3, 6, -1, 0, 5], lengths=lengths, row_list=[4, 0, 2, 1, 3], slots=8, rows=6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_spec,dtype", [(3, torch.float32), (7, torch.bfloat16)], ids=("ns3-fp32", "ns7-bf16"))
@pytest.mark.parametrize("gate", (False, True), ids=("nogate", "gate"))
def test_overlap_groups_same_bytes_as_one_group(impl, num_spec, dtype, gate):
    p = _problem(num_spec, dtype)
    steps = p.steps
    g = torch.Generator(device=p.q.device).manual_seed(5)
    og = torch.randn(p.q.shape, generator=g, device=p.q.device).to(dtype)
    weight = (1 + 0.1 * torch.randn(128, generator=g, device=p.q.device)).float()
    gk = dict(output_gate=og, output_norm_weight=weight, output_norm_eps=EPS) if gate else {}

    def run(groups):
        out = torch.full_like(p.q, float("nan"), memory_format=torch.contiguous_format)
        icw, rings = p.new_icw(), p.new_rings(L=2 * steps)
        mtp_verify(*p.acts(), intermediate_conv=icw, out=out, **rings, **p.verify_kwargs(), impl=impl,
                   overlap_groups=groups, **gk)
        if CUDA:
            torch.cuda.synchronize()
        return out, icw, rings

    out1, icw1, rings1 = run(1)
    for groups in (2, 3, 5):
        out, icw, rings = run(groups)
        assert torch.equal(out.view(torch.uint8), out1.view(torch.uint8)), groups
        assert torch.equal(icw.isnan(), icw1.isnan()) and torch.equal(icw.nan_to_num(), icw1.nan_to_num())
        for name in rings:
            assert torch.equal(rings[name].nan_to_num(), rings1[name].nan_to_num()), name
    # and the values are the reference's (rows past cu_seqlens[N] zero)
    icw_r, rings_r = p.new_icw(F64, fill=0.0), p.new_rings(act_dtype=F64, fill=0.0)
    ref_gate = dict(output_gate=og.to(F64), output_norm_weight=weight.to(F64), output_norm_eps=EPS) if gate else {}
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=icw_r, intermediate_ssm=p.new_issm(F64, 0.0),
                             **rings_r, **p.ref_verify_kwargs(), **ref_gate)
    assert not out.isnan().any()
    assert rel_err(out, out_r) <= tol(dtype), rel_err(out, out_r)
    cu_end = int(p.cu_seqlens[-1])
    assert (out[0, cu_end:] == 0).all()
