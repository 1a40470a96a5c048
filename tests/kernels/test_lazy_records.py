"""The lazy record ring (docs/design/lazy-record-ring.md) against an uninterrupted float64 run of the accepted
tokens: verify with ``record_cursor`` -> random accept -> ``commit_records`` (cursor, conv roll), over
enough cycles to cross several flushes, with ragged windows, a padding row and a radix track
snapshot (``materialize_records``) every cycle.

Checked after every cycle: the window's outputs, the pool's conv window, the state the slot
materialises to (checkpoint carried over its pending records), the checkpoint alone = the eager
state ``cursor`` tokens ago (what SGLang's no_buffer finish path would donate), the track
snapshot, and untouched slots. fp32 activations: under the CPU interpreter bf16 is raw bits.
"""

import random

import pytest
import torch

from kda_testutil import F64, make_problem, rel_err, same_bytes
from sglang_dspark_plugin.kernels import mtp_verify
from sglang_dspark_plugin.kernels import reference as R
from sglang_dspark_plugin.kernels.record_ring import commit_records, materialize_records

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(
    "num_spec,L,split,cycles,block_v",
    [(3, 8, False, 8, None), (3, 16, True, 14, 32), (7, 16, False, 10, None), (15, 32, False, 10, None)],
    ids=["T4-L8", "T4-L16-split-4tiles", "T8-L16-finish", "T16-L32-finish"],
)
def test_lazy_ring_trajectory(num_spec, L, split, cycles, block_v):
    """``block_v=32``: four V-tiles per head (the interpreter's default is one), so each tile's
    delta columns and the key-norm reciprocals written by V-tile 0 alone are checked on CPU too.
    Request 2 is ragged and sometimes accepts nothing (cursor unchanged past a flush's base)."""
    cycles = max(200, cycles * 20) if CUDA else cycles  # on the GPU: >= 200 commits
    steps = 1 + num_spec
    N, H = 3, 2
    slot_list = [1, -1, 3]  # request 1 is CUDA-graph padding
    live = [(n, s) for n, s in enumerate(slot_list) if s >= 0]
    track_slot = 4  # a spare slot receives request 0's track snapshots
    spare_slot = 5  # named by request 2's track, never taken: stays untouched
    p = make_problem(N=N, H=H, num_spec=num_spec, dtype=torch.float32, lower_bound=None, seed=5 + L + num_spec,
                     slot_list=slot_list, slots=6)
    dev = p.q.device
    icw = p.new_icw()
    rings = p.new_rings(L=L)
    if split:  # fp32 deltas as two 16-bit halves (SGLang's bf16 replayssm_d / replayssm_k)
        delta = tuple(torch.zeros(p.slots, H, L, 128, dtype=torch.bfloat16, device=dev) for _ in range(2))
    else:
        delta = torch.full((p.slots, H, L, 128), float("nan"), dtype=torch.float32, device=dev)
    cursor = torch.zeros(p.slots, dtype=torch.int32, device=dev)
    untouched = {s: p.ssm_state[s].clone() for s in (0, 2, 5)}
    untouched_conv = {s: p.conv_state[s].clone() for s in (0, 2, 5)}
    cursor[spare_slot] = 3  # not reset: its track was not taken
    par64 = dict(conv_weight=p.conv_weight.to(F64), A_log=p.A_log.to(F64), dt_bias=p.dt_bias.to(F64),
                 lower_bound=p.lower_bound, act_dtype=torch.float32)
    truth = {s: [p.ssm_state[s].to(F64)] for _, s in live}  # eager state after every accepted token
    window = {s: p.conv_state[s].to(F64) for _, s in live}
    rng = random.Random(L * 10 + num_spec)
    g = torch.Generator().manual_seed(L + num_spec)
    flushes = 0
    for cycle in range(cycles):
        lengths = [rng.randint(1, steps) if n == 2 else steps for n in range(N)]  # request 2 is ragged
        cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(N)], dtype=torch.int32, device=dev)
        q, k, v = (torch.randn(1, p.T, H, 128, generator=g).to(dev) for _ in range(3))
        a = torch.randn(1, p.T, H, 128, generator=g).to(dev)
        b = torch.randn(1, p.T, H, generator=g).to(dev)
        before = cursor.clone()
        out = mtp_verify(q, k, v, a, b, **p.params(), ssm_state=p.ssm_state, conv_state=p.conv_state,
                         slot_indices=p.slot_indices, cu_seqlens=cu, num_spec=num_spec, intermediate_conv=icw,
                         intermediate_rows=p.intermediate_rows, **rings, record_cursor=cursor, ring_delta=delta,
                         block_v=block_v)
        assert torch.equal(cursor, before)  # the verify only reads the cursor
        accept = [rng.randint(0 if n == 2 else 1, ln) for n, ln in enumerate(lengths)]
        track_step = rng.randint(0, accept[0] - 1)
        acc_t = torch.tensor(accept, dtype=torch.int32, device=dev)
        # request 0 tracks a step it accepted; request 2 names a step past its accepted ones (none taken)
        i32 = dict(dtype=torch.int32, device=dev)
        cursor[track_slot] = 1 + cycle % L  # records of the slot's last owner: the snapshot ends them
        counts, dst = commit_records(cursor, p.slot_indices, acc_t, p.conv_state[None], icw[None],
                                     p.intermediate_rows, steps=steps, ring_len=L,
                                     track_slot_indices=torch.tensor([track_slot, 2, spare_slot], **i32),
                                     track_steps=torch.tensor([track_step, 0, accept[2]], **i32))
        assert dst.tolist() == [track_slot, -1, -1] and int(cursor[track_slot]) == 0
        materialize_records(p.ssm_state[None], rings["ring_rawk"][None], rings["ring_g"][None],
                            rings["ring_beta"][None], tuple(d[None] for d in delta) if split else delta[None],
                            src_slots=p.slot_indices, counts=counts, dst_slots=dst)

        assert torch.equal(out[0, cu[1]:cu[2]], torch.zeros_like(out[0, cu[1]:cu[2]]))  # padding row
        for n, s in live:
            flushes += int(before[s]) + steps > L
            bos = int(cu[n])
            full = slice(bos, bos + lengths[n])
            o64, _, _ = R.sequential_ref(*(x[:, full].to(F64) for x in (q, k, v, a, b)), **par64,
                                         state=truth[s][-1], window=window[s])
            assert rel_err(out[0, full], o64) <= 2e-5, (cycle, n)
            states, wins = [truth[s][-1]], [window[s]]
            for t in range(accept[n]):
                tok = slice(bos + t, bos + t + 1)
                _, S, win = R.sequential_ref(*(x[:, tok].to(F64) for x in (q, k, v, a, b)), **par64,
                                             state=states[-1], window=wins[-1])
                states.append(S)
                wins.append(win)
            truth[s] += states[1:]
            window[s] = wins[-1]
            if n == 0:
                assert rel_err(p.ssm_state[track_slot], states[1 + track_step]) <= 2e-5, cycle
                assert torch.equal(p.conv_state[track_slot].to(F64), wins[1 + track_step]), cycle
            assert torch.equal(p.conv_state[s].to(F64), window[s]), (cycle, n)
            pending = int(cursor[s])
            assert 0 <= pending <= L
            assert rel_err(p.ssm_state[s], truth[s][-1 - pending]) <= 2e-5, (cycle, n)  # the checkpoint
        now = p.ssm_state.clone()
        materialize_records(now[None], rings["ring_rawk"][None], rings["ring_g"][None], rings["ring_beta"][None],
                            tuple(d[None] for d in delta) if split else delta[None],
                            src_slots=p.slot_indices.clamp(min=0), counts=cursor[p.slot_indices.clamp(min=0).long()],
                            dst_slots=p.slot_indices)
        for n, s in live:
            assert rel_err(now[s], truth[s][-1]) <= 2e-5, (cycle, n)  # the materialised state
    for s, st in untouched.items():
        assert same_bytes(p.ssm_state[s], st) and same_bytes(p.conv_state[s], untouched_conv[s])
    assert int(cursor[spare_slot]) == 3
    assert flushes >= 2, flushes  # the run crossed flushes


def test_lazy_ring_rejects_bad_arguments():
    p = make_problem(N=1, H=1, num_spec=1, dtype=torch.float32, lower_bound=None, seed=1)
    rings = p.new_rings(L=4)
    cursor = torch.zeros(p.slots, dtype=torch.int32, device=p.q.device)
    kw = dict(**p.verify_kwargs(), intermediate_conv=p.new_icw())
    from sglang_dspark_plugin.errors import DSparkError

    with pytest.raises(DSparkError, match="record_cursor/ring_delta"):
        mtp_verify(*p.acts(), **kw, **rings, record_cursor=cursor)
    with pytest.raises(DSparkError, match="ring_delta"):  # bf16 alone loses the low bits
        mtp_verify(*p.acts(), **kw, **rings, record_cursor=cursor,
                   ring_delta=torch.zeros_like(rings["ring_rawk"], dtype=torch.bfloat16))
    with pytest.raises(DSparkError, match="ring mode"):
        mtp_verify(*p.acts(), **kw, intermediate_ssm=p.new_issm(), record_cursor=cursor,
                   ring_delta=torch.zeros_like(rings["ring_rawk"]))

    # the commit: a track needs both halves; index tensors are int32
    icw, acc = p.new_icw(), torch.ones(1, dtype=torch.int32, device=p.q.device)
    commit = dict(conv_state=p.conv_state[None], intermediate_conv=icw[None], intermediate_rows=p.intermediate_rows,
                  steps=2, ring_len=4)
    with pytest.raises(DSparkError, match=r"DSPARK-E119\] track_slot_indices/track_steps"):
        commit_records(cursor, p.slot_indices, acc, **commit, track_slot_indices=p.slot_indices)
    with pytest.raises(DSparkError, match=r"DSPARK-E111\] accept_lens"):
        commit_records(cursor, p.slot_indices, acc.long(), **commit)
    with pytest.raises(DSparkError, match=r"DSPARK-E106\]"):
        commit_records(cursor, p.slot_indices, acc, **dict(commit, intermediate_conv=icw))
    assert torch.equal(cursor, torch.zeros_like(cursor))  # nothing ran


def test_materialize_records_writes_only_the_live_rows_among_many():
    """Few live rows among many (what a commit with a track snapshot or two looks like): of 37
    rows (three blocks of 16, the last one partial, for a kernel that takes rows in blocks) only
    rows 0, 20 and 36 are live; their slots get the reference state, every other slot keeps its
    bytes."""
    from sglang_dspark_plugin.kernels.reference import materialize_records_ref

    g = torch.Generator().manual_seed(12)
    layers, H, L, N = 1, 1, 8, 37
    slots = 2 * N
    dev = "cuda" if CUDA else "cpu"
    ssm = (torch.randn(layers, slots, H, 128, 128, generator=g) * 0.5).to(dev)
    rawk = torch.randn(layers, slots, H, L, 128, generator=g).to(dev)
    gate = (-torch.rand(layers, slots, H, L, 128, generator=g) * 0.3).to(dev)
    rk = (torch.rand(layers, slots, H, L, generator=g) * 0.1 + 0.05).to(dev)
    delta = torch.randn(layers, slots, H, L, 128, generator=g).to(dev)
    src = torch.arange(N, dtype=torch.int32)
    dst = torch.full((N,), -1, dtype=torch.int32)
    live = [0, 20, 36]
    dst[live] = torch.tensor([N + n for n in live], dtype=torch.int32)  # copies into slots N + n
    cnt = torch.tensor([(3 * n) % (L + 1) for n in range(N)], dtype=torch.int32)
    cnt[live] = torch.tensor([2, L, 5], dtype=torch.int32)
    src, cnt, dst = src.to(dev), cnt.to(dev), dst.to(dev)
    want = ssm.to(F64)
    materialize_records_ref(want, rawk, gate, rk, delta, src, cnt, dst)
    before = ssm.clone()
    materialize_records(ssm, rawk, gate, rk, delta, src, cnt, dst)
    for n in live:
        assert rel_err(ssm[:, N + n], want[:, N + n]) <= 1e-5, n
    untouched = [s for s in range(slots) if s not in {N + n for n in live}]
    assert same_bytes(ssm[:, untouched], before[:, untouched])


@pytest.mark.parametrize("split", [False, True], ids=["fp32-deltas", "split-deltas"])
def test_materialize_records_against_reference(split):
    """``materialize_records`` (all layers, a copy into another slot, an in-place flush, skipped
    rows, a copy of a checkpoint with no pending records) against its step-by-step float64
    reference."""
    from sglang_dspark_plugin.kernels.reference import materialize_records_ref

    g = torch.Generator().manual_seed(11)
    layers, slots, H, L = 2, 6, 2, 8
    dev = "cuda" if CUDA else "cpu"

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev)

    ssm = rn(layers, slots, H, 128, 128, scale=0.5)
    rawk = rn(layers, slots, H, L, 128)
    gate = -torch.rand(layers, slots, H, L, 128, generator=g).to(dev) * 0.3
    rk = torch.rand(layers, slots, H, L, generator=g).to(dev) * 0.1 + 0.05
    d = rn(layers, slots, H, L, 128)
    if split:
        bits = d.view(torch.int32)
        delta = tuple(x.to(torch.int16).view(torch.bfloat16) for x in (bits >> 16, bits & 0xFFFF))
    else:
        delta = d
    i32 = dict(dtype=torch.int32, device=dev)
    src, cnt, dst = (torch.tensor(x, **i32) for x in ([1, 2, -1, 3, 3], [5, 3, 2, 0, 0], [4, 2, 0, -1, 5]))
    want = ssm.to(F64)
    materialize_records_ref(want, rawk, gate, rk, delta, src, cnt, dst)
    before = ssm.clone()
    materialize_records(ssm, rawk, gate, rk, delta, src, cnt, dst)
    for s in (4, 2):
        assert rel_err(ssm[:, s], want[:, s]) <= 1e-5, s
    assert same_bytes(ssm[:, 5], before[:, 3])  # no records: the checkpoint itself
    for s in (0, 1, 3):  # sources, the skipped rows' slots
        assert same_bytes(ssm[:, s], before[:, s]), s
