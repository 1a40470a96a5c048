"""Bad inputs raise the documented DSparkError (a ValueError) with the expected code.

Validation runs before any launch, so these tests are fast on any device. The device check is
exercised with a "meta" tensor, which passes every shape/dtype check.
"""

import pytest
import torch

from kda_testutil import device, make_problem

from sglang_dspark_plugin.errors import DSparkError
from sglang_dspark_plugin.kernels import decode, mtp_verify, replayssm_fold


def _verify_args(mode="snapshot"):
    p = make_problem(N=2, H=1, num_spec=1, dtype=torch.bfloat16, lower_bound=None, seed=3)
    args = dict(zip("qkvab", p.acts()))
    kw = p.verify_kwargs()
    kw["intermediate_conv"] = p.new_icw()
    if mode == "snapshot":
        kw["intermediate_ssm"] = p.new_issm()
    else:
        kw.update(p.new_rings())
    return p, args, kw


def _call_verify(args, kw):
    return mtp_verify(args["q"], args["k"], args["v"], args["a"], args["b"], **kw)


VERIFY_CASES = {
    # name: (mutation(p, args, kw), code)
    "q-3d": (lambda p, a, k: a.update(q=a["q"][0]), "DSPARK-E101"),
    "a-2d": (lambda p, a, k: a.update(a=a["a"].reshape(p.T, -1)), "DSPARK-E101"),
    "k-other-T": (lambda p, a, k: a.update(k=a["k"][:, :-1]), "DSPARK-E101"),
    "b-2d": (lambda p, a, k: a.update(b=a["b"][0]), "DSPARK-E102"),
    "head-dim-64": (lambda p, a, k: a.update(q=torch.zeros(1, p.T, p.H, 64, dtype=p.dtype)), "DSPARK-E103"),
    "T-not-N-steps": (lambda p, a, k: k.update(num_spec=2), "DSPARK-E104"),
    "ssm-bf16": (lambda p, a, k: k.update(ssm_state=k["ssm_state"].bfloat16()), "DSPARK-E105"),
    "ssm-transposed": (lambda p, a, k: k.update(ssm_state=k["ssm_state"].transpose(-1, -2)), "DSPARK-E105"),
    "conv-transposed": (lambda p, a, k: k.update(conv_state=k["conv_state"].transpose(-1, -2)), "DSPARK-E106"),
    "conv-dtype": (lambda p, a, k: k.update(conv_state=k["conv_state"].float()), "DSPARK-E106"),
    "q-fp16": (lambda p, a, k: a.update(q=a["q"].half()), "DSPARK-E107"),
    "v-dtype": (lambda p, a, k: a.update(v=a["v"].float()), "DSPARK-E107"),
    "q-last-dim-stride": (lambda p, a, k: a.update(q=torch.zeros(1, p.T, p.H, 256, dtype=p.dtype)[..., ::2]),
                          "DSPARK-E108"),
    "neither-mode": (lambda p, a, k: k.pop("intermediate_ssm"), "DSPARK-E110"),
    "both-modes": (lambda p, a, k: k.update(p.new_rings()), "DSPARK-E110"),
    "slots-int64": (lambda p, a, k: k.update(slot_indices=k["slot_indices"].long()), "DSPARK-E111"),
    "cu-len": (lambda p, a, k: k.update(cu_seqlens=k["cu_seqlens"][:-1]), "DSPARK-E111"),
    "conv-weight-3d": (lambda p, a, k: k.update(conv_weight=k["conv_weight"][:, None]), "DSPARK-E112"),
    "A_log-numel": (lambda p, a, k: k.update(A_log=torch.zeros(p.H + 1)), "DSPARK-E113"),
    "dt_bias-bf16": (lambda p, a, k: k.update(dt_bias=k["dt_bias"].bfloat16()), "DSPARK-E113"),
    "icw-steps": (lambda p, a, k: k.update(intermediate_conv=k["intermediate_conv"][:, :1]), "DSPARK-E114"),
    "issm-bf16": (lambda p, a, k: k.update(intermediate_ssm=k["intermediate_ssm"].bfloat16()), "DSPARK-E115"),
    "num_spec-neg": (lambda p, a, k: k.update(num_spec=-1), "DSPARK-E116"),
    "num_spec-tensor": (lambda p, a, k: k.update(num_spec=torch.tensor(1)), "DSPARK-E116"),
    "device": (lambda p, a, k: k.update(A_log=torch.empty(p.H, device="meta")), "DSPARK-E117"),
    "out-shape": (lambda p, a, k: k.update(out=torch.empty(1, p.T, p.H, 64, dtype=p.dtype)), "DSPARK-E118"),
    "lower_bound-tensor": (lambda p, a, k: k.update(lower_bound=torch.tensor(-5.0)), "DSPARK-E120"),
    "block_v": (lambda p, a, k: k.update(block_v=48), "DSPARK-E121"),
    "impl": (lambda p, a, k: k.update(impl="tiled"), "DSPARK-E123"),
}


@pytest.mark.parametrize("case", sorted(VERIFY_CASES))
def test_verify_rejects(case):
    mutate, code = VERIFY_CASES[case]
    p, args, kw = _verify_args()
    mutate(p, args, kw)
    with pytest.raises(DSparkError) as ei:
        _call_verify(args, kw)
    assert ei.value.code == code, str(ei.value)
    assert isinstance(ei.value, ValueError)
    msg = str(ei.value)
    assert "expected" in msg and "got" in msg and "Fix:" in msg and code in msg


def test_verify_ring_mode_rejects_partial_and_bad_rings():
    p, args, kw = _verify_args("ring")
    kw2 = dict(kw)
    kw2.pop("ring_beta")
    with pytest.raises(DSparkError) as ei:
        _call_verify(args, kw2)
    assert ei.value.code == "DSPARK-E110"
    kw3 = dict(kw, ring_g=kw["ring_g"].bfloat16())
    with pytest.raises(DSparkError) as ei:
        _call_verify(args, kw3)
    assert ei.value.code == "DSPARK-E109"
    short = {name: kw[name][:, :, :1] for name in ("ring_rawv", "ring_rawk", "ring_g", "ring_beta")}
    with pytest.raises(DSparkError, match="linear-replayssm-cache-len") as ei:
        _call_verify(args, dict(kw, **short))
    assert ei.value.code == "DSPARK-E109"
    # The chunked kernel's K-chunk has a code of its own (block_v's is E121), naming block_k.
    with pytest.raises(DSparkError, match="block_k: expected") as ei:
        _call_verify(args, dict(kw, impl="chunked", block_k=48))
    assert ei.value.code == "DSPARK-E122"


def test_fix_hint_for_3d_and_2d_inputs():
    p, args, kw = _verify_args()
    args["q"] = args["q"][0]
    with pytest.raises(DSparkError, match=r"unsqueeze\(0\)"):
        _call_verify(args, kw)
    p, args, kw = _verify_args()
    args["q"] = args["q"].reshape(p.T, -1)
    with pytest.raises(DSparkError, match=r"view\(1, T, H, 128\)"):
        _call_verify(args, kw)
    p, args, kw = _verify_args()
    args["a"] = torch.zeros(1, p.T, p.H, 64, dtype=p.dtype)
    with pytest.raises(DSparkError, match="generic KDA path"):
        _call_verify(args, kw)


def _decode_args():
    p = make_problem(N=2, H=1, num_spec=0, dtype=torch.float32, lower_bound=-5.0, seed=4)
    kw = dict(p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state, slot_indices=p.slot_indices)
    return p, dict(zip("qkvab", p.acts())), kw


DECODE_CASES = {
    "T-not-B": (lambda p, a, k: k.update(slot_indices=k["slot_indices"][:1]), "DSPARK-E104"),
    "b-shape": (lambda p, a, k: a.update(b=a["b"][:, :, :1].expand(1, p.T, p.H + 1)), "DSPARK-E102"),
    "ssm-4d-wrong-H": (lambda p, a, k: k.update(ssm_state=k["ssm_state"].repeat(1, 2, 1, 1)), "DSPARK-E105"),
    "conv-D": (lambda p, a, k: k.update(conv_state=k["conv_state"][..., :-1]), "DSPARK-E106"),
    "slots-2d": (lambda p, a, k: k.update(slot_indices=k["slot_indices"][None]), "DSPARK-E111"),
    "scale-tensor": (lambda p, a, k: k.update(scale=torch.tensor(0.1)), "DSPARK-E120"),
    "block_v": (lambda p, a, k: k.update(block_v=0), "DSPARK-E121"),
    "impl": (lambda p, a, k: k.update(impl="chunked"), "DSPARK-E123"),
}


@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_rejects(case):
    mutate, code = DECODE_CASES[case]
    p, args, kw = _decode_args()
    mutate(p, args, kw)
    with pytest.raises(DSparkError) as ei:
        decode(args["q"], args["k"], args["v"], args["a"], args["b"], **kw)
    assert ei.value.code == code, str(ei.value)


def _fold_args():
    layers, slots, H, L, N = 2, 3, 1, 4, 2
    D = 3 * H * 128
    dev = device()
    f32 = dict(device=dev)
    bf16 = dict(dtype=torch.bfloat16, device=dev)
    ssm = torch.zeros(layers, slots, H, 128, 128, **f32)
    rings = dict(ring_rawv=torch.zeros(layers, slots, H, L, 128, **bf16),
                 ring_rawk=torch.zeros(layers, slots, H, L, 128, **bf16),
                 ring_g=torch.zeros(layers, slots, H, L, 128, **f32), ring_beta=torch.zeros(layers, slots, H, L, **f32))
    i32 = dict(dtype=torch.int32, device=dev)
    kw = dict(rings, slot_indices=torch.tensor([0, 1], **i32), accept_lens=torch.tensor([1, 2], **i32),
              conv_state=torch.zeros(layers, slots, 3, D, **bf16),
              intermediate_conv=torch.zeros(layers, N, L, 3, D, **bf16),
              intermediate_rows=torch.tensor([0, 1], **i32))
    return ssm, kw


FOLD_CASES = {
    "ssm-bf16": (lambda s, k: s.bfloat16(), "DSPARK-E105"),
    "ring-layers": (lambda s, k: k.update(ring_g=k["ring_g"][:1]) or s, "DSPARK-E109"),
    "ring-beta-fp16": (lambda s, k: k.update(ring_beta=k["ring_beta"].half()) or s, "DSPARK-E109"),
    "accept-len": (lambda s, k: k.update(accept_lens=k["accept_lens"][:1]) or s, "DSPARK-E111"),
    "conv-partial": (lambda s, k: (k.pop("intermediate_rows"), s)[1], "DSPARK-E119"),
    "conv-layers": (lambda s, k: k.update(conv_state=k["conv_state"][:1],
                                          intermediate_conv=k["intermediate_conv"][:1]) or s, "DSPARK-E119"),
    "track-partial": (lambda s, k: k.update(track_steps=k["accept_lens"]) or s, "DSPARK-E119"),
    "icw-transposed": (lambda s, k: k.update(intermediate_conv=k["intermediate_conv"].transpose(-1, -2)) or s,
                       "DSPARK-E114"),
    # conv state and conv windows share the rings' (activation) dtype
    "conv-dtype": (lambda s, k: k.update(conv_state=k["conv_state"].float()) or s, "DSPARK-E106"),
    "icw-dtype": (lambda s, k: k.update(intermediate_conv=k["intermediate_conv"].float()) or s, "DSPARK-E114"),
    "conv-and-icw-fp32-rings-bf16": (lambda s, k: k.update(conv_state=k["conv_state"].float(),
                                                         intermediate_conv=k["intermediate_conv"].float()) or s,
                                     "DSPARK-E106"),
    "block_v": (lambda s, k: k.update(block_v=256) or s, "DSPARK-E121"),
    "impl": (lambda s, k: k.update(impl="chunked") or s, "DSPARK-E123"),
}


@pytest.mark.parametrize("case", sorted(FOLD_CASES))
def test_fold_rejects(case):
    mutate, code = FOLD_CASES[case]
    ssm, kw = _fold_args()
    ssm = mutate(ssm, kw)
    with pytest.raises(DSparkError) as ei:
        replayssm_fold(ssm, **kw)
    assert ei.value.code == code, str(ei.value)


def test_fold_valid_args_and_single_layer_accepted():
    """Validation only (the fold's maths: tests/kernels/test_replayssm_fold.py): the valid
    arguments of the reject cases above pass, in the all-layer and the single-layer form, and
    the fold works in place on the tensor given."""
    ssm, kw = _fold_args()
    assert replayssm_fold(ssm, **kw) is ssm  # all-layer form
    single = {k: (v[0] if k not in ("slot_indices", "accept_lens", "intermediate_rows") else v) for k, v in kw.items()}
    layer0 = ssm[0]
    assert replayssm_fold(layer0, **single) is layer0  # single-layer form
