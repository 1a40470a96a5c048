"""Kimi-K3's output gate fused into verify and decode (``output_gate`` / ``output_norm_weight`` /
``output_norm_eps``), on every kernel path the backend runs:

* against the float64 reference of the whole step (the gated norm applied to the output rounded to
  the activation dtype, ``reference.gated_rms_norm``);
* against the same kernel without the gate, from the same inputs: the gated output is the gated
  norm of the ungated one (fp32 within rounding, bf16 within one ulp), and nothing else the kernel
  writes (states, conv windows, rings, deltas, cursor) changes by a byte;
* against SGLang's own ``o_norm`` kernel (``rms_norm_gated``, the model's ``FusedRMSNormGated``)
  applied to the ungated output: bit for bit in fp32;
* the arrival counters come back zero (one workspace serves every call), padding and uncovered
  rows stay zero, and every malformed argument is refused with DSPARK-E124.
"""

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, same_bytes, tol

from sglang_dspark_plugin.errors import DSparkError
from sglang_dspark_plugin.kernels import decode, mtp_verify
from sglang_dspark_plugin.kernels import reference as R
from sglang_dspark_plugin.kernels.mtp_verify_gluon import gluon_verify_supported
from sglang_dspark_plugin.kernels.record_ring import commit_records

CUDA = torch.cuda.is_available()
EPS = 1e-5


def _gate(p, seed):
    """A gate laid out like the model's: the last quarter of a fused [q|k|v|g] projection row."""
    gen = torch.Generator(device=p.q.device).manual_seed(seed)
    width = p.H * 128
    fused = torch.randn(p.T, 4 * width + 16, generator=gen, device=p.q.device).to(p.dtype)
    gate = fused[:, 3 * width:4 * width].view(1, p.T, p.H, 128)
    # a bf16 checkpoint weight held in fp32 (what SGLang hands over), away from 1
    weight = (1 + 0.2 * torch.randn(128, generator=gen, device=p.q.device)).to(torch.bfloat16).float()
    return gate, weight


def _expected(out_plain, gate, weight, dtype):
    """The gated norm of the ungated output, in float64, rounded to the activation dtype."""
    return R.gated_rms_norm(out_plain.to(F64), gate.to(F64), weight.to(F64), EPS).to(dtype)


def _assert_gated(out_gated, out_plain, gate, weight, rows):
    """``rows``: the output rows that belong to a (non-padding) request."""
    want = _expected(out_plain, gate, weight, out_gated.dtype)
    got, want = out_gated[0, rows].to(F64), want[0, rows].to(F64)
    if out_gated.dtype == torch.float32:
        assert rel_err(got, want) <= 1e-6, rel_err(got, want)
    else:  # one bf16 ulp: |x| * 2^-7 at most (fp32 sum orders may differ from float64's)
        assert ((got - want).abs() <= want.abs() * 2.0 ** -7 + 1e-30).all()
        assert (got == want).float().mean() >= 0.98


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    return x


def _assert_same(a, b, what=""):
    if isinstance(a, torch.Tensor):
        assert same_bytes(a, b), f"{what} differs with the output gate"
    elif isinstance(a, dict):
        for k in a:
            _assert_same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{what}[{i}]")


# --- verify ---------------------------------------------------------------------------------------

# (name, num_spec, mode, impl, block_v): every path of the backend's verify
VERIFY_PATHS = [
    ("snapshot", 3, "snapshot", None, 32),
    ("ring-rows", 3, "ring", "rows", 32),
    ("ring-chunked", 3, "ring", "chunked", 32),
    ("ring-chunked-finish", 7, "ring", "chunked", 64),
    ("lazy", 3, "lazy", None, 32),
    ("lazy-finish", 7, "lazy", None, 32),
]
if CUDA:
    VERIFY_PATHS += [("ring-chunked-16", 15, "ring", "chunked", None), ("ring-rows-bv128", 7, "ring", "rows", 128),
                     ("lazy-finish-bv16", 7, "lazy", None, 16)]
GLUON = CUDA and gluon_verify_supported(torch.device("cuda"))
if GLUON:  # the Hopper stream (sm_90)
    VERIFY_PATHS += [("ring-gluon", 3, "ring", "gluon", None), ("ring-gluon-8", 7, "ring", "gluon", None),
                     ("ring-gluon-16", 15, "ring", "gluon", None)]
DTYPES = (torch.float32, torch.bfloat16) if CUDA else (torch.float32,)  # bf16 is raw bits in the interpreter


def _verify_setup(num_spec, mode, dtype, seed, H=2):
    """3 requests: full window, padding (slot -1), short window; for the lazy ring, pending records
    in both live slots, one of them so many that this window flushes."""
    steps = 1 + num_spec
    p = make_problem(N=3, H=H, num_spec=num_spec, dtype=dtype, lower_bound=-5.0, seed=seed, slot_list=[4, -1, 1],
                     lengths=[steps, steps, max(1, steps - 1)], row_list=[2, 3, 0], slots=6, rows=4)
    kwargs = dict(p.verify_kwargs(), intermediate_conv=p.new_icw())
    if mode == "snapshot":
        kwargs["intermediate_ssm"] = p.new_issm()
        return p, kwargs
    # lazy: a ring one row longer than the window, so that after one committed cycle slot 4 (which
    # accepted the whole window) flushes in the checked window and slot 1 (one token) does not
    L = steps + 1 if mode == "lazy" else 2 * steps
    kwargs.update(p.new_rings(L=L))
    if mode == "lazy":
        dev = p.q.device
        kwargs["ring_delta"] = torch.zeros(p.slots, H, L, 128, dtype=torch.float32, device=dev)
        kwargs["record_cursor"] = torch.zeros(p.slots, dtype=torch.int32, device=dev)
        mtp_verify(*p.acts(), **kwargs)
        accept = torch.tensor([steps, 0, 1], dtype=torch.int32, device=dev)
        commit_records(kwargs["record_cursor"], p.slot_indices, accept, p.conv_state[None],
                       kwargs["intermediate_conv"][None], p.intermediate_rows, steps=steps, ring_len=L)
        assert kwargs["record_cursor"][[4, 1]].tolist() == [steps, 1]
    return p, kwargs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("path", VERIFY_PATHS, ids=[c[0] for c in VERIFY_PATHS])
def test_verify_gate_is_the_norm_of_the_ungated_output(path, dtype):
    name, num_spec, mode, impl, block_v = path
    p, kwargs = _verify_setup(num_spec, mode, dtype, seed=300 + num_spec)
    gate, weight = _gate(p, seed=num_spec)
    start = _clone(kwargs)  # every tensor the kernel may write (state, conv, scratch, rings, cursor)
    out_plain = mtp_verify(*p.acts(), **kwargs, impl=impl, block_v=block_v)
    after_plain = kwargs
    workspace = torch.zeros(p.N * p.H + 5, dtype=torch.int32, device=p.q.device)
    for _ in range(2):  # twice on one workspace: the counters must come back to zero
        out = torch.full_like(out_plain, float("nan"))
        kwargs = _clone(start)
        got = mtp_verify(*p.acts(), **kwargs, impl=impl, block_v=block_v, out=out, output_gate=gate,
                         output_norm_weight=weight, output_norm_eps=EPS, output_gate_workspace=workspace)
        assert got is out and not (workspace != 0).any()
        _assert_same(after_plain, kwargs, "verify")
    cu = p.cu_seqlens.tolist()
    rows = list(range(cu[0], cu[1])) + list(range(cu[2], cu[3]))
    _assert_gated(out, out_plain, gate, weight, rows)
    assert (out[0, cu[1]:cu[2]] == 0).all() and (out[0, cu[3]:] == 0).all()  # padding, uncovered rows


@pytest.mark.parametrize("impl", ["rows", "chunked"] + (["gluon"] if GLUON else []))
def test_verify_gate_matches_float64_reference(impl):
    dtype = torch.bfloat16 if CUDA else torch.float32
    p, kwargs = _verify_setup(3, "ring", dtype, seed=17, H=3)
    gate, weight = _gate(p, seed=5)
    out = mtp_verify(*p.acts(), **kwargs, impl=impl, output_gate=gate, output_norm_weight=weight,
                     output_norm_eps=EPS)
    out_r = R.mtp_verify_ref(*p.acts64(), intermediate_conv=p.new_icw(F64, 0.0), **p.ref_verify_kwargs(),
                             output_gate=gate.to(F64), output_norm_weight=weight.to(F64), output_norm_eps=EPS)
    assert rel_err(out, out_r) <= (1e-6 if dtype == torch.float32 else 2.0 ** -8), rel_err(out, out_r)


# --- decode -------------------------------------------------------------------------------------

DECODE_PATHS = [("plain", None), ("buffered-rows", "rows"), ("buffered-factored", "factored")]


def _decode_setup(buffered, dtype, seed, L=4):
    p = make_problem(N=3, H=2, num_spec=0, dtype=dtype, lower_bound=-5.0, seed=seed, slot_list=[3, -1, 0], slots=5)
    kwargs = dict(p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state, slot_indices=p.slot_indices,
                  block_v=None if CUDA else 32)  # the interpreter's default tile is the whole head: four here
    if buffered:
        dev = p.q.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        ring_d, ring_k, ring_g = (torch.randn(p.slots, p.H, L, 128, generator=gen, device=dev) * 0.3 for _ in range(3))
        ring_g = -ring_g.abs()  # log-decays
        kwargs.update(ring_d=ring_d, ring_k=ring_k, ring_g=ring_g, impl=buffered,
                      write_pos=torch.tensor([2, 0, L - 1], dtype=torch.int32, device=dev))  # slot 0 flushes
    return p, kwargs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("path", DECODE_PATHS, ids=[c[0] for c in DECODE_PATHS])
def test_decode_gate_is_the_norm_of_the_ungated_output(path, dtype):
    name, buffered = path
    p, kwargs = _decode_setup(buffered, dtype, seed=40)
    gate, weight = _gate(p, seed=6)
    start = _clone(kwargs)
    out_plain = decode(*p.acts(), **kwargs)
    after_plain = _clone(kwargs)
    kwargs = _clone(start)
    out = torch.full_like(out_plain, float("nan"))
    decode(*p.acts(), **kwargs, out=out, output_gate=gate, output_norm_weight=weight, output_norm_eps=EPS)
    _assert_same(after_plain, kwargs, "decode")
    _assert_gated(out, out_plain, gate, weight, [0, 2])
    assert (out[0, 1] == 0).all()


def test_decode_gate_matches_float64_reference():
    dtype = torch.bfloat16 if CUDA else torch.float32
    p, kwargs = _decode_setup(None, dtype, seed=41)
    gate, weight = _gate(p, seed=7)
    ssm_r, conv_r = p.ssm_state.to(F64), p.conv_state.to(F64)
    out = decode(*p.acts(), **kwargs, output_gate=gate, output_norm_weight=weight, output_norm_eps=EPS)
    params64 = dict(conv_weight=p.conv_weight.to(F64), A_log=p.A_log.to(F64), dt_bias=p.dt_bias.to(F64),
                    lower_bound=p.lower_bound)
    out_r = R.decode_ref(*p.acts64(), **params64, ssm_state=ssm_r, conv_state=conv_r, slot_indices=p.slot_indices,
                         act_dtype=dtype, output_gate=gate.to(F64), output_norm_weight=weight.to(F64),
                         output_norm_eps=EPS)
    assert rel_err(out, out_r) <= (1e-6 if dtype == torch.float32 else 2.0 ** -8), rel_err(out, out_r)


# --- SGLang's own o_norm ----------------------------------------------------------------------------

def test_gate_equals_sglangs_o_norm():
    """The model's ``o_norm`` (SGLang's ``rms_norm_gated``, sigmoid) on the ungated output gives the
    fused result: bit for bit in fp32 (the bf16 contract is one ulp, checked above; under the CPU
    interpreter SGLang's own bf16 stores truncate instead of rounding)."""
    pytest.importorskip("sglang")
    from sglang.kernels.ops.attention.fla.fused_norm_gate import rms_norm_gated

    dtype = torch.bfloat16 if CUDA else torch.float32
    p, kwargs = _verify_setup(3, "ring", dtype, seed=23, H=2)
    gate, weight = _gate(p, seed=8)
    state0 = _clone(kwargs)
    out_plain = mtp_verify(*p.acts(), **kwargs)
    out = mtp_verify(*p.acts(), **state0, output_gate=gate, output_norm_weight=weight, output_norm_eps=EPS)
    theirs = rms_norm_gated(out_plain.reshape(-1, 128), gate.reshape(-1, 128), weight.to(dtype), None, "sigmoid",
                            eps=EPS).view_as(out)
    live = torch.cat([torch.arange(0, 4), torch.arange(8, 11)]).to(out.device)
    if dtype == torch.float32:
        assert torch.equal(out[0, live], theirs[0, live])
    else:
        diff = (out[0, live].float() - theirs[0, live].float()).abs()
        assert (diff <= theirs[0, live].float().abs() * 2.0 ** -7).all()


# --- argument checks ----------------------------------------------------------------------------

def test_gate_argument_errors():
    p, kwargs = _verify_setup(1, "ring", torch.float32, seed=3)
    gate, weight = _gate(p, seed=9)
    i32 = dict(dtype=torch.int32, device=p.q.device)
    bad = [
        dict(output_gate=gate),  # partial set
        dict(output_gate=gate, output_norm_weight=weight),
        dict(output_norm_weight=weight, output_norm_eps=EPS),
        dict(output_gate=gate[:, :-1], output_norm_weight=weight, output_norm_eps=EPS),  # tokens
        dict(output_gate=gate.transpose(2, 3), output_norm_weight=weight, output_norm_eps=EPS),  # layout
        dict(output_gate=gate.to(torch.float16), output_norm_weight=weight, output_norm_eps=EPS),
        dict(output_gate=gate, output_norm_weight=weight[:64], output_norm_eps=EPS),
        dict(output_gate=gate, output_norm_weight=weight.to(torch.float16), output_norm_eps=EPS),
        dict(output_gate=gate, output_norm_weight=weight, output_norm_eps=0.0),
        dict(output_gate=gate, output_norm_weight=weight, output_norm_eps=torch.tensor(EPS)),
        dict(output_gate=gate, output_norm_weight=weight, output_norm_eps=EPS,
             output_gate_workspace=torch.zeros(p.N * p.H - 1, **i32)),  # too small
        dict(output_gate=gate, output_norm_weight=weight, output_norm_eps=EPS,
             output_gate_workspace=torch.zeros(p.N * p.H, dtype=torch.int64, device=p.q.device)),
        dict(output_gate_workspace=torch.zeros(p.N * p.H, **i32)),  # a workspace without a gate
    ]
    for extra in bad:
        with pytest.raises(DSparkError, match="DSPARK-E124"):
            mtp_verify(*p.acts(), **kwargs, **extra)
    pd, dkw = _decode_setup(None, torch.float32, seed=4)
    dgate, dweight = _gate(pd, seed=10)
    for extra in (dict(output_gate=dgate), dict(output_gate=dgate, output_norm_weight=dweight, output_norm_eps=-1.0)):
        with pytest.raises(DSparkError, match="DSPARK-E124"):
            decode(*pd.acts(), **dkw, **extra)
