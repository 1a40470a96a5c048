"""Buffered decode (SGLang's decode ring, ``--enable-linear-replayssm``) against the float64
reference decode, step after step across ring wraps and forced flushes: outputs, the conv window,
the flushed state and, between flushes, the state the ring implies."""

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, same_bytes, tol

from sglang_dspark_plugin.errors import DSparkError
from sglang_dspark_plugin.kernels import decode
from sglang_dspark_plugin.kernels import reference as R

CUDA = torch.cuda.is_available()


def _rings(slots, H, L, dev):
    # NaN everywhere: a read of a row the kernel did not write would show in the outputs
    return [torch.full((slots, H, L, 128), float("nan"), dtype=torch.float32, device=dev) for _ in range(3)]


@pytest.mark.parametrize("impl", [None, "factored"], ids=("rows", "factored"))
@pytest.mark.parametrize("dtype,lb,L", [(torch.float32, None, 4), (torch.bfloat16, -5.0, 8), (torch.float32, None, 1)],
                         ids=("fp32-L4", "bf16-lb-L8", "fp32-L1"))
def test_buffered_decode_follows_the_reference_across_flushes(dtype, lb, L, impl):
    H, N = (4 if CUDA else 2), 3
    steps = 2 * L + 5  # at least two natural wraps, and a forced flush (step 3)
    slot_list = [3, -1, 0]
    p = make_problem(N=N, H=H, num_spec=0, dtype=dtype, lower_bound=lb, seed=70 + L, slot_list=slot_list, slots=5)
    dev = p.q.device
    ssm_r, conv_r = p.ssm_state.to(F64), p.conv_state.to(F64)  # the reference pool (plain decode)
    ssm0, conv0 = p.ssm_state.clone(), p.conv_state.clone()
    ring_d, ring_k, ring_g = _rings(p.slots, H, L, dev)
    cursor = {s: 0 for s in slot_list if s >= 0}  # SGLang's per-slot write_pos
    gen = torch.Generator(device=dev).manual_seed(L)
    params64 = p.params() | dict(conv_weight=p.conv_weight.to(F64), A_log=p.A_log.to(F64), dt_bias=p.dt_bias.to(F64))
    flushes = 0
    for step in range(steps):
        q, k, v, a = (torch.randn(1, N, H, 128, generator=gen, device=dev).to(dtype) for _ in range(4))
        b = torch.randn(1, N, H, generator=gen, device=dev).to(dtype)
        write_pos = torch.tensor([cursor.get(s, 0) for s in slot_list], dtype=torch.int32, device=dev)
        force = torch.tensor([int(step == 3), 0, 0], dtype=torch.int32, device=dev)
        out_r = R.decode_ref(q.to(F64), k.to(F64), v.to(F64), a.to(F64), b.to(F64), **params64, ssm_state=ssm_r,
                             conv_state=conv_r, slot_indices=p.slot_indices, act_dtype=dtype)
        out = decode(q, k, v, a, b, **p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state,
                     slot_indices=p.slot_indices, ring_d=ring_d, ring_k=ring_k, ring_g=ring_g,
                     write_pos=write_pos, force_flush=force, impl=impl,
                     block_v=None if CUDA else 32)  # the interpreter's default is one tile: four here
        assert rel_err(out, out_r) <= tol(dtype), (step, rel_err(out, out_r))
        assert (out[0, 1] == 0).all(), "padding row output must be zero"
        for n, s in enumerate(slot_list):
            if s < 0:
                continue
            flushed = cursor[s] == L - 1 or bool(force[n])
            cursor[s] = 0 if flushed else cursor[s] + 1
            flushes += flushed
            implied = R.buffered_decode_state_ref(p.ssm_state, ring_d, ring_k, ring_g, s, cursor[s])
            assert rel_err(implied, ssm_r[s]) <= 1e-5, (step, s, cursor[s], rel_err(implied, ssm_r[s]))
            assert torch.equal(p.conv_state[s].to(F64), conv_r[s])
    assert flushes >= 4
    for s in (1, 2, 4):  # unused slots (and the padding request's): untouched
        assert same_bytes(p.ssm_state[s], ssm0[s]) and same_bytes(p.conv_state[s], conv0[s])


def test_buffered_decode_argument_errors():
    p = make_problem(N=2, H=2, num_spec=0, dtype=torch.float32, lower_bound=None, seed=5, slot_list=[0, 1], slots=3)
    dev = p.q.device
    ring_d, ring_k, ring_g = _rings(p.slots, 2, 4, dev)
    wp = torch.zeros(2, dtype=torch.int32, device=dev)
    base = dict(**p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state, slot_indices=p.slot_indices)
    cases = [
        ("DSPARK-E110", dict(ring_d=ring_d, ring_k=ring_k, ring_g=ring_g)),  # no write_pos
        ("DSPARK-E109", dict(ring_d=ring_d.to(torch.bfloat16), ring_k=ring_k, ring_g=ring_g, write_pos=wp)),
        ("DSPARK-E109", dict(ring_d=ring_d[:, :, :2], ring_k=ring_k, ring_g=ring_g, write_pos=wp)),  # L differs
        ("DSPARK-E111", dict(ring_d=ring_d, ring_k=ring_k, ring_g=ring_g, write_pos=wp.long())),
        ("DSPARK-E111", dict(ring_d=ring_d, ring_k=ring_k, ring_g=ring_g, write_pos=wp, force_flush=wp[:1])),
        ("DSPARK-E121", dict(ring_d=ring_d, ring_k=ring_k, ring_g=ring_g, write_pos=wp, block_v=8)),
        ("DSPARK-E123", dict(impl="factored")),  # the factored step needs the ring
    ]
    for code, kwargs in cases:
        with pytest.raises(DSparkError, match=code):
            decode(*p.acts(), **base, **kwargs)
