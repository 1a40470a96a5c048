"""The Hopper Gluon verify stream (``impl="gluon"``, kernels/mtp_verify_gluon.py) against the float64
reference: outputs, conv windows and rings, CUDA-graph padding, short requests, windows of 2-16
tokens, and that it writes nothing else. Runs on sm_90 GPUs only; on any device: the refusal, and
the path around the kernel (plan, prep, the finish kernel's split W, the workspace it reads) with
the stream modelled in torch."""

import dataclasses
import importlib

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, same_bytes, state_tol, tol

from sglang_dspark_plugin.errors import DSparkError
from sglang_dspark_plugin.kernels import mtp_verify
from sglang_dspark_plugin.kernels import reference as R
from sglang_dspark_plugin.kernels.mtp_verify_gluon import gluon_verify_supported

CUDA = torch.cuda.is_available()
GLUON = CUDA and gluon_verify_supported(torch.device("cuda"))
CASES = [(ns, dt, lb) for ns in (1, 3, 4, 7, 15) for dt in (torch.float32, torch.bfloat16) for lb in (None, -5.0)]


def _scenario(num_spec, dtype, lb, seed, H=3, N=5):
    """Full windows, a CUDA-graph padding row (slot -1) and a short window, on a pool with more
    slots than requests."""
    steps = 1 + num_spec
    slot_list = [4, -1, 1, 6, 0][:N]
    lengths = [steps, steps, max(1, steps - 1), steps, max(1, steps - 2)][:N]
    return make_problem(N=N, H=H, num_spec=num_spec, dtype=dtype, lower_bound=lb, seed=seed, slot_list=slot_list,
                        lengths=lengths, row_list=[2, 3, 0, 4, 1][:N], slots=8, rows=6)


def _launch_with(monkeypatch, **kw):
    """Run the Gluon stream with these launch options (``mtp_verify`` reads ``LAUNCH``)."""
    from sglang_dspark_plugin.kernels import mtp_verify_gluon as G

    monkeypatch.setattr(G, "LAUNCH", dataclasses.replace(G.LAUNCH, **kw))


# The launches tested: the default; on two CTAs, so that each CTA walks several items (a padding row
# among them), its pipelined loads run past the last one and the state ring wraps; and the other
# K-chunking (4 stages of 32 columns), also on two CTAs.
LAUNCHES = {"default": {}, "2ctas": dict(max_ctas=2), "k32-2ctas": dict(stages=4, block_k=32, max_ctas=2)}


@pytest.mark.gpu
@pytest.mark.skipif(not GLUON, reason="needs an sm_90 GPU and Triton's Gluon")
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ns{c[0]}-{str(c[1]).split('.')[-1]}-lb{c[2]}")
def test_gluon_verify_matches_reference(case, launch, monkeypatch):
    _launch_with(monkeypatch, **LAUNCHES[launch])
    num_spec, dtype, lb = case
    p = _scenario(num_spec, dtype, lb, seed=4000 + num_spec * 10 + (lb is None))
    steps, lengths = p.steps, p.extra["lengths"]
    ssm0, conv0 = p.ssm_state.clone(), p.conv_state.clone()
    icw_r, rings_r = p.new_icw(F64, fill=0.0), p.new_rings(act_dtype=F64, fill=0.0)
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=icw_r, intermediate_ssm=p.new_issm(F64, fill=0.0),
                             **rings_r, **p.ref_verify_kwargs())

    out = torch.full_like(p.q, float("nan"), memory_format=torch.contiguous_format)
    icw, rings = p.new_icw(), p.new_rings(L=2 * steps)
    before = {k: v.clone() for k, v in rings.items()}
    mtp_verify(*p.acts(), intermediate_conv=icw, out=out, **rings, **p.verify_kwargs(), impl="gluon")
    # the Triton chunked kernels on the same inputs: the same rings and windows byte for byte
    out_c, icw_c, rings_c = torch.full_like(out, float("nan")), p.new_icw(), p.new_rings(L=2 * steps)
    mtp_verify(*p.acts(), intermediate_conv=icw_c, out=out_c, **rings_c, **p.verify_kwargs(), impl="chunked")

    assert not out.isnan().any()
    assert rel_err(out, out_r) <= tol(dtype), rel_err(out, out_r)
    cu = p.cu_seqlens.tolist()
    assert (out[0, cu[1]:cu[2]] == 0).all() and (out[0, cu[-1]:] == 0).all()  # padding, uncovered rows
    assert same_bytes(p.ssm_state, ssm0) and same_bytes(p.conv_state, conv0)
    owned = [s for s in p.extra["slot_list"] if s >= 0]
    for n, (slot, row, ln) in enumerate(zip(p.extra["slot_list"], p.extra["row_list"], lengths)):
        if slot < 0:
            assert icw[row].isnan().all(), "slot -1 wrote intermediate_conv"
            continue
        assert torch.equal(icw[row, :ln].to(F64), icw_r[row, :ln]), "conv window mismatch"
        assert icw[row, ln:].isnan().all(), "steps past the request length were written"
        for name in rings:
            got, ref = rings[name][slot], rings_r[name][slot]
            assert rel_err(got[:, :ln], ref[:, :ln]) <= (1e-6 if name in ("ring_g", "ring_beta") else state_tol(dtype))
            assert same_bytes(got, rings_c[name][slot]), f"{name} differs from the Triton kernels'"
            assert same_bytes(got[:, ln:], before[name][slot, :, ln:]), f"{name} written past length"
    for name, r in rings.items():
        for s in range(p.slots):
            if s not in owned:
                assert same_bytes(r[s], before[name][s]), f"{name} slot {s} written"


@pytest.mark.gpu
@pytest.mark.skipif(not GLUON, reason="needs an sm_90 GPU and Triton's Gluon")
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_gluon_verify_serving_batch(launch, monkeypatch):
    """A serving-size batch (many items per persistent CTA, every ring stage reused many times)."""
    _launch_with(monkeypatch, **dict(LAUNCHES[launch], max_ctas=None))
    p = make_problem(N=96, H=32, num_spec=7, dtype=torch.bfloat16, lower_bound=-5.0, seed=11)
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=p.new_icw(F64, 0.0), **p.new_rings(act_dtype=F64),
                             **p.ref_verify_kwargs())
    out = mtp_verify(*p.acts(), intermediate_conv=p.new_icw(), **p.new_rings(L=16), **p.verify_kwargs(), impl="gluon")
    assert rel_err(out, out_r) <= tol(torch.bfloat16), rel_err(out, out_r)


def test_gluon_refused_where_it_cannot_run():
    """impl="gluon" off sm_90 (here: without such a GPU) or outside ring mode: DSPARK-E123, naming the fix."""
    p = make_problem(N=2, H=1, num_spec=1, dtype=torch.float32, lower_bound=None, seed=3)
    with pytest.raises(DSparkError, match="E123") as e:
        mtp_verify(*p.acts(), intermediate_conv=p.new_icw(), intermediate_ssm=p.new_issm(), **p.verify_kwargs(),
                   impl="gluon")
    assert "ring mode" in str(e.value) or "sm_90" in str(e.value)
    if not GLUON:
        with pytest.raises(DSparkError, match="sm_90"):
            mtp_verify(*p.acts(), intermediate_conv=p.new_icw(), **p.new_rings(L=4), **p.verify_kwargs(),
                       impl="gluon")


# --- the path around the Gluon kernel, on any device -----------------------------------------------

def _torch_stream(v, out, *, conv_weight, ssm_state, conv_state, slot_indices, cu_seqlens, intermediate_conv,
                  intermediate_rows, ring_rawv, ws, pp, N, T, H, steps, TP, act_bf16, gate=None):
    """What the Gluon stream computes from the prep and finish kernels' workspace, in float64
    (``O^T = S0 W^T + V^T P^T``, W = the two halves the finish kernel wrote): a model of the kernel
    beside the real prep / finish kernels, so that the workspace contract is tested without sm_90.
    Also checks the split itself: the first half is W's tf32 part (13 low mantissa bits clear)."""
    live = slot_indices >= 0  # the workspace of padding requests is never written
    hi = ws[live][:, :, 0]
    assert not (hi.contiguous().view(torch.int32) & 0x1FFF).any(), "W's first half is not tf32-truncated"
    act = out.dtype
    out.zero_()
    cu = cu_seqlens.tolist()
    for n in range(N):
        slot = int(slot_indices[n])
        if slot < 0:
            continue
        bos, n_tok = cu[n], min(cu[n + 1] - cu[n], steps)
        row = int(intermediate_rows[n])
        for h in range(H):
            W = (ws[n, h, 0] + ws[n, h, 1]).to(F64)  # [TP, 128]
            acc = ssm_state[slot, h].to(F64) @ W.T  # [V, TP]
            ch = slice(2 * H * 128 + h * 128, 2 * H * 128 + (h + 1) * 128)
            window = conv_state[slot, :, ch].to(F64)
            P = pp[n, h].reshape(TP, TP).to(F64)
            o = acc.clone()
            for s in range(n_tok):
                x = v[0, bos + s, h].to(F64)
                y, window = R.conv_silu_step(window, x, conv_weight[ch].to(F64), act)
                intermediate_conv[row, s, :, ch] = window.to(act)
                ring_rawv[slot, h, s] = y.to(act)
                o += y[:, None] * P[:, s][None, :]
            rows_o = o[:, :n_tok].T.to(act).to(F64)  # [t, V], rounded as the kernel stores it
            if gate is not None:
                og, onw, eps, _ = gate
                rows_o = R.gated_rms_norm(rows_o, og[0, bos:bos + n_tok, h].to(F64), onw.to(F64), eps)
            out[0, bos:bos + n_tok, h] = rows_o.to(act)
    return out


@pytest.mark.parametrize("num_spec", (1, 7))
def test_gluon_path_workspace_contract(num_spec, monkeypatch):
    """impl="gluon" end to end with the stream modelled in torch: the plan (finish forced, 8-row
    windows), the prep and the finish kernel's split W, the workspace layout the Gluon kernel reads
    by TMA (``[N*H*2*TP, 128]`` rows, ``[N*H, TP, TP]`` P) and the rings / conv windows the prep
    writes: outputs against the float64 reference."""
    MV = importlib.import_module("sglang_dspark_plugin.kernels.mtp_verify")  # the package exports the function
    MG = importlib.import_module("sglang_dspark_plugin.kernels.mtp_verify_gluon")

    monkeypatch.setattr(MV, "gluon_verify_supported", lambda device: True)
    monkeypatch.setattr(MG, "launch_verify_stream_gluon", _torch_stream)
    dtype = torch.float32
    p = _scenario(num_spec, dtype, -5.0, seed=77 + num_spec, H=2, N=3)
    steps, lengths = p.steps, p.extra["lengths"]
    icw_r, rings_r = p.new_icw(F64, fill=0.0), p.new_rings(act_dtype=F64, fill=0.0)
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=icw_r, **rings_r, **p.ref_verify_kwargs())
    out, icw, rings = torch.full_like(p.q, float("nan")), p.new_icw(), p.new_rings(L=2 * steps)
    mtp_verify(*p.acts(), intermediate_conv=icw, out=out, **rings, **p.verify_kwargs(), impl="gluon")
    assert rel_err(out, out_r) <= tol(dtype), rel_err(out, out_r)
    for slot, row, ln in zip(p.extra["slot_list"], p.extra["row_list"], lengths):
        if slot < 0:
            continue
        assert torch.equal(icw[row, :ln].to(F64), icw_r[row, :ln])
        for name in rings:
            assert rel_err(rings[name][slot][:, :ln], rings_r[name][slot][:, :ln]) <= state_tol(dtype), name
