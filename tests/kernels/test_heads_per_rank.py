"""The plugin's kernels at the per-rank KDA head counts of tensor-parallel serving.

SGLang shards a KDA layer's heads over the tensor-parallel ranks, so each rank's kernels see
``H = num_heads / tp``:

* Kimi-Linear-48B: 32 heads at TP2 -> **H = 16** per rank;
* Kimi-K3: 96 heads at TP8 -> **H = 12** per rank (not a power of two).

The other kernel tests run at H = 1..4 on CPU. Here decode, mtp_verify (snapshot mode, ring mode
with both ring kernels) and replayssm_fold (all-layer layout, conv roll, radix track snapshot) run
at H = 16 and H = 12 against the float64 references of ``kernels/reference.py``, with CUDA-graph
padding (slot -1), a short request and untouched slots, as in test_decode.py / test_mtp_verify.py /
test_replayssm_fold.py.

Cases follow the models: Kimi-Linear's softplus gate at H = 16 with gamma 3 (4-token windows), K3's
safe gate (``lower_bound = -5``) at H = 12 with a 5-token window (the chunked verify's finish
kernel, as at K3's gamma 7). Under the Triton interpreter the recurrent kernels take V-tiles of 128
rows (one program per request and head; the interpreter's cost is per program) so the module runs
in a few tens of seconds; V-split tiles are covered at small H by the other kernel tests. Compiled
on a GPU every kernel uses its launch-table defaults.
"""

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, same_bytes, state_tol, tol

from sglang_dspark_plugin.kernels import decode, mtp_verify, replayssm_fold
from sglang_dspark_plugin.kernels import reference as R

CUDA = torch.cuda.is_available()
BV = None if CUDA else 128  # V-tile of the recurrent kernels (None: the launch table's default)

KIMI_LINEAR_TP2 = 16  # 32 heads / 2 ranks
K3_TP8 = 12  # 96 heads / 8 ranks

# fp32 state from identical inputs: 1e-5 on every device (kda_testutil.state_tol says why)
STATE_TOL = {dt: state_tol(dt) for dt in (torch.float32, torch.bfloat16)}


# --- decode ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize("H,lb", [(KIMI_LINEAR_TP2, None), (K3_TP8, -5.0)],
                         ids=("kimi-linear-tp2-H16", "k3-tp8-H12"))
def test_decode_per_rank_heads(H, lb, dtype):
    p = make_problem(N=3, H=H, num_spec=0, dtype=dtype, lower_bound=lb, seed=1700 + H + (dtype == torch.bfloat16),
                     slot_list=[3, -1, 0], slots=5)
    ssm_r, conv_r = p.ssm_state.to(F64), p.conv_state.to(F64)
    out_r = R.decode_ref(*p.acts64(), conv_weight=p.conv_weight.to(F64), A_log=p.A_log.to(F64),
                         dt_bias=p.dt_bias.to(F64), lower_bound=lb, ssm_state=ssm_r, conv_state=conv_r,
                         slot_indices=p.slot_indices, act_dtype=dtype)
    ssm0, conv0 = p.ssm_state.clone(), p.conv_state.clone()
    out = torch.full((1, 3, H, 128), float("nan"), dtype=dtype, device=p.q.device)
    decode(*p.acts(), **p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state,
           slot_indices=p.slot_indices, out=out, block_v=BV)
    assert rel_err(out, out_r) <= tol(dtype), rel_err(out, out_r)
    assert (out[0, 1] == 0).all(), "padding row output must be zero"
    for s in range(p.slots):
        if s in (3, 0):
            assert rel_err(p.ssm_state[s], ssm_r[s]) <= STATE_TOL[dtype], (s, rel_err(p.ssm_state[s], ssm_r[s]))
            assert torch.equal(p.conv_state[s].to(F64), conv_r[s])
        else:  # the slot -1 request and unused slots: untouched
            assert same_bytes(p.ssm_state[s], ssm0[s]) and same_bytes(p.conv_state[s], conv0[s])


# --- mtp_verify (snapshot and ring mode) ---------------------------------------------------------

VERIFY_CASES = [
    pytest.param((KIMI_LINEAR_TP2, 3, torch.float32, None), id="kimi-linear-tp2-H16-ns3-fp32"),
    pytest.param((K3_TP8, 4, torch.bfloat16, -5.0), id="k3-tp8-H12-ns4-bf16-lb-5"),
]


@pytest.fixture(scope="module", params=VERIFY_CASES)
def verified(request):
    """One verify batch at the rank's head count, run by the reference and the three kernels:
    3 requests (full window, CUDA-graph padding slot -1, one token short), slots 6, rows 4."""
    H, num_spec, dtype, lb = request.param
    steps = 1 + num_spec
    lengths = [steps, steps, steps - 1]
    p = make_problem(N=3, H=H, num_spec=num_spec, dtype=dtype, lower_bound=lb, seed=1710 + H,
                     slot_list=[4, -1, 1], lengths=lengths, row_list=[2, 3, 0], slots=6, rows=4)
    ssm0, conv0 = p.ssm_state.clone(), p.conv_state.clone()
    res = dict(p=p, ssm0=ssm0, conv0=conv0)

    # float64 reference (snapshot + rings at once)
    res["icw_r"], res["issm_r"] = p.new_icw(F64, fill=0.0), p.new_issm(F64, fill=0.0)
    res["rings_r"] = p.new_rings(act_dtype=F64, fill=0.0)
    res["out_r"] = R.mtp_verify_ref(*p.acts64(), intermediate_conv=res["icw_r"], intermediate_ssm=res["issm_r"],
                                    **res["rings_r"], **p.ref_verify_kwargs())
    # snapshot mode
    res["icw_s"], res["issm_s"] = p.new_icw(), p.new_issm()
    res["out_s"] = torch.full_like(p.q, float("nan"), memory_format=torch.contiguous_format)
    mtp_verify(*p.acts(), intermediate_conv=res["icw_s"], intermediate_ssm=res["issm_s"], out=res["out_s"],
               block_v=BV, **p.verify_kwargs())
    # ring mode, both ring kernels (rings longer than the window, as in SGLang)
    for impl in ("chunked", "rows"):
        icw, rings = p.new_icw(), p.new_rings(L=2 * steps)
        before = {k: v.clone() for k, v in rings.items()}
        out = torch.full_like(res["out_s"], float("nan"))
        mtp_verify(*p.acts(), intermediate_conv=icw, out=out, impl=impl,
                   block_v=BV if impl == "rows" else None, **rings, **p.verify_kwargs())
        res[impl] = dict(out=out, icw=icw, rings=rings, rings_before=before)
    return res


def test_verify_snapshot_per_rank_heads(verified):
    v = verified
    p = v["p"]
    dtype, lengths = p.dtype, p.extra["lengths"]
    out_s, icw_s, issm_s = v["out_s"], v["icw_s"], v["issm_s"]
    assert not out_s.isnan().any()
    assert rel_err(out_s, v["out_r"]) <= tol(dtype), rel_err(out_s, v["out_r"])
    cu = p.cu_seqlens.tolist()
    assert (out_s[0, cu[1]:cu[2]] == 0).all(), "padding request output must be zero"
    assert (out_s[0, cu[3]:] == 0).all(), "rows of no request must be zero"
    assert same_bytes(p.ssm_state, v["ssm0"]) and same_bytes(p.conv_state, v["conv0"]), "verify wrote the pool"
    for slot, row, ln in zip(p.extra["slot_list"], p.extra["row_list"], lengths):
        if slot < 0:
            assert icw_s[row].isnan().all() and issm_s[row].isnan().all(), "slot -1 wrote scratch"
            continue
        assert torch.equal(icw_s[row, :ln].to(F64), v["icw_r"][row, :ln]), "conv window mismatch"
        assert icw_s[row, ln:].isnan().all() and issm_s[row, ln:].isnan().all(), "steps past the length written"
        err = rel_err(issm_s[row, :ln], v["issm_r"][row, :ln])
        assert err <= STATE_TOL[dtype], err
        # head by head: no head got a neighbour's state (a mis-strided head would be off by O(1))
        for h in range(p.H):
            assert rel_err(issm_s[row, ln - 1, h], v["issm_r"][row, ln - 1, h]) <= 10 * STATE_TOL[dtype], h


@pytest.mark.parametrize("impl", ("chunked", "rows"))
def test_verify_ring_per_rank_heads(verified, impl):
    v = verified
    p = v["p"]
    dtype, lengths = p.dtype, p.extra["lengths"]
    r = v[impl]
    out, icw, rings = r["out"], r["icw"], r["rings"]
    assert not out.isnan().any()
    assert rel_err(out, v["out_r"]) <= tol(dtype), rel_err(out, v["out_r"])
    if impl == "rows":  # the recurrent ring kernel performs snapshot mode's operations exactly
        assert torch.equal(out, v["out_s"]), "recurrent ring and snapshot mode outputs differ"
    assert same_bytes(p.ssm_state, v["ssm0"]) and same_bytes(p.conv_state, v["conv0"]), "verify wrote the pool"
    owned = [s for s in p.extra["slot_list"] if s >= 0]
    for slot, row, ln in zip(p.extra["slot_list"], p.extra["row_list"], lengths):
        if slot < 0:
            assert icw[row].isnan().all(), "slot -1 wrote intermediate_conv"
            continue
        assert torch.equal(icw[row, :ln].to(F64), v["icw_r"][row, :ln]), "conv window mismatch"
        for name in ("ring_rawv", "ring_rawk", "ring_g", "ring_beta"):
            got, ref = rings[name][slot], v["rings_r"][name][slot]
            assert not got[:, :ln].isnan().any(), name
            bar = 1e-6 if name in ("ring_g", "ring_beta") else STATE_TOL[dtype]
            assert rel_err(got[:, :ln], ref[:, :ln]) <= bar, (name, rel_err(got[:, :ln], ref[:, :ln]))
            if dtype == torch.bfloat16 and name in ("ring_rawv", "ring_rawk"):  # the rounded conv outputs
                assert torch.equal(got[:, :ln].to(F64), ref[:, :ln]), name
            assert same_bytes(got[:, ln:], r["rings_before"][name][slot, :, ln:]), f"{name} written past length"
    for name, ring in rings.items():  # rings of slots no request owns (and of the slot -1 request)
        for s in range(p.slots):
            if s not in owned:
                assert same_bytes(ring[s], r["rings_before"][name][s]), f"{name} slot {s} written"


# --- replayssm_fold (all-layer layout) -----------------------------------------------------------


def _random_layer(p, L, seed):
    """A second layer's pool and rings with random contents (folded against the float64 reference)."""
    g = torch.Generator().manual_seed(seed)
    dev, act = p.q.device, p.dtype

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=dev)

    return dict(
        ssm=randn(p.slots, p.H, 128, 128, scale=0.5),
        conv=randn(p.slots, 3, p.D, dtype=act),
        icw=randn(p.rows, p.steps, 3, p.D, dtype=act),
        rings=dict(
            ring_rawv=randn(p.slots, p.H, L, 128, dtype=act),
            ring_rawk=randn(p.slots, p.H, L, 128, dtype=act),
            ring_g=(-torch.rand(p.slots, p.H, L, 128, generator=g) * 3).to(dev),
            ring_beta=torch.rand(p.slots, p.H, L, generator=g).to(dev),
        ),
    )


def test_fold_per_rank_heads(verified):
    """Two layers in SGLang's all-layer layout: layer 0 folds the chunked ring verify above (must
    equal snapshot mode's state after step a-1, conv roll == the verify's window), layer 1 random
    rings (float64 fold reference). Request 0 also stores a radix track snapshot in a spare slot."""
    v = verified
    p = v["p"]
    steps, dev = p.steps, p.q.device
    r = v["chunked"]
    L = r["rings"]["ring_rawv"].shape[2]
    other = _random_layer(p, L, seed=1720 + p.H)
    ssm0 = torch.stack([v["ssm0"], other["ssm"]])
    conv0 = torch.stack([v["conv0"], other["conv"]])
    icw = torch.stack([r["icw"].nan_to_num(), other["icw"]])
    rings = {k: torch.stack([r["rings"][k], other["rings"][k]]) for k in other["rings"]}
    slots, rows, lengths = p.extra["slot_list"], p.extra["row_list"], p.extra["lengths"]  # slots [4, -1, 1]
    track_slot = 0  # a slot no request folds into
    for acc in ([steps, 2, lengths[2]], [2, steps, 0]):  # full, short's full length, 2, 0 (no-op)
        track_step = acc[0] - 2 if acc[0] >= 2 else -1  # the state after step a-2 of request 0
        ssm, conv = ssm0.clone(), conv0.clone()
        i32 = dict(dtype=torch.int32, device=dev)
        kw = dict(slot_indices=p.slot_indices, accept_lens=torch.tensor(acc, **i32),
                  intermediate_rows=p.intermediate_rows,
                  track_slot_indices=torch.tensor([track_slot, -1, -1], **i32),
                  track_steps=torch.tensor([track_step, -1, -1], **i32))
        ret = replayssm_fold(ssm, **rings, conv_state=conv, intermediate_conv=icw, block_v=BV, **kw)
        assert ret is ssm
        # layer 1 against the float64 fold reference (same arguments)
        ssm_r = ssm0[1].to(F64)
        conv_r = conv0[1].clone()
        R.replayssm_fold_ref(ssm_r, *(x[1].to(F64) for x in rings.values()), conv_state=conv_r,
                             intermediate_conv=icw[1], **kw)
        assert rel_err(ssm[1], ssm_r) <= 1e-5, rel_err(ssm[1], ssm_r)
        assert torch.equal(conv[1], conv_r)
        touched = set()
        for slot, row, a in zip(slots, rows, acc):
            if slot < 0 or a == 0:
                continue
            touched.add(slot)
            want = v["issm_s"][row, a - 1]
            assert rel_err(ssm[0, slot], want) <= 1e-6, (slot, a, rel_err(ssm[0, slot], want))
            assert torch.equal(conv[0, slot], r["icw"][row, a - 1])
        if track_step >= 0:
            touched.add(track_slot)
            assert rel_err(ssm[0, track_slot], v["issm_s"][rows[0], track_step]) <= 1e-6
        for s in range(p.slots):
            if s not in touched:
                assert same_bytes(ssm[:, s], ssm0[:, s]), f"slot {s} state written"
                assert same_bytes(conv[:, s], conv0[:, s]), f"slot {s} conv written"
