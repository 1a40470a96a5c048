"""The lazy record ring's protocol (docs/design/lazy-record-ring.md) against the eager
per-token recurrence: outputs, the materialised state after every commit, and the checkpoint
invariant SGLang's no_buffer finish path relies on, over 200 steps with random accept lengths,
across flushes, for two slots at once.

This checks the protocol as the float64 reference states it (``reference.lazy_verify_ref`` /
``lazy_commit_ref``, the design's executable spec), not the kernels: those implement it as
``mtp_verify(..., record_cursor=)`` and ``kernels.record_ring``, and
``tests/kernels/test_lazy_records.py`` checks them against an uninterrupted float64 run."""

import pytest
import torch

from sglang_dspark_plugin.kernels import reference as R

H, DIM, STEPS = 2, 32, 200  # the protocol is dimension-agnostic: 32 keeps CI fast


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny ops: intra-op threads only add spin-waits (100x slower on a busy 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _window(gen, T, dtype):
    k = R.l2norm(torch.randn(T, H, DIM, generator=gen, dtype=torch.float64))
    q = R.l2norm(torch.randn(T, H, DIM, generator=gen, dtype=torch.float64)) * DIM**-0.5
    v = torch.randn(T, H, DIM, generator=gen, dtype=torch.float64)
    g = -torch.nn.functional.softplus(torch.randn(T, H, DIM, generator=gen, dtype=torch.float64)) * 0.1
    beta = torch.sigmoid(torch.randn(T, H, generator=gen, dtype=torch.float64))
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def _eager(S, q, k, v, g, beta):
    """Per-token states and outputs of the window from S (float64)."""
    states, outs = [], []
    for t in range(q.shape[0]):
        S = R.delta_step(S, k[t], g[t], beta[t], v[t])
        states.append(S)
        outs.append(R.readout(S, q[t]))
    return states, torch.stack(outs)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T,L", [(4, 16), (8, 16), (8, 32)])
def test_lazy_ring_equals_eager_recurrence(T, L, dtype, tol):
    gen = torch.Generator().manual_seed(1000 * T + L)
    slots = [1, 3]  # slot 0 and 2 stay untouched
    ssm_state = torch.zeros(4, H, DIM, DIM, dtype=dtype)
    for s in slots:
        ssm_state[s] = (torch.randn(H, DIM, DIM, generator=gen, dtype=torch.float64) * 0.05).to(dtype)
    untouched = ssm_state[[0, 2]].clone()
    rings = [torch.full((4, H, L, DIM), float("nan"), dtype=dtype) for _ in range(3)]  # unwritten rows poison
    cursor = torch.zeros(4, dtype=torch.int64)
    truth = {s: [ssm_state[s].to(torch.float64)] for s in slots}  # eager state after every committed token
    flushes = {s: 0 for s in slots}

    def rel(a, b):
        return float((a.to(torch.float64) - b).norm() / b.norm())

    for step in range(STEPS):
        for s in slots:
            q, k, v, g, beta = _window(gen, T, dtype)
            before = int(cursor[s])
            out = R.lazy_verify_ref(ssm_state, *rings, cursor, s, q, k, v, g, beta)
            flushes[s] += int(before + T > L)
            states, out_eager = _eager(truth[s][-1], *(x.to(torch.float64) for x in (q, k, v, g, beta)))
            assert rel(out, out_eager) <= tol, (step, s)
            accept = int(torch.randint(1, T + 1, (1,), generator=gen))
            R.lazy_commit_ref(cursor, s, accept)
            truth[s] += states[:accept]
            assert 0 < int(cursor[s]) <= L
            # the materialised state (checkpoint carried over the pending rows) is the eager state
            now = R.buffered_decode_state_ref(ssm_state, *rings, s, int(cursor[s]))
            assert rel(now, truth[s][-1]) <= tol, (step, s)
            # the checkpoint alone is the eager state cursor tokens ago: what SGLang's finish path
            # donates (key capped by write_pos) is a state consistent with its key
            assert rel(ssm_state[s], truth[s][-1 - int(cursor[s])]) <= tol, (step, s)
    assert torch.equal(ssm_state[[0, 2]], untouched)
    # flushes happen only when a window would not fit: at most one per ring's worth of tokens
    for s in slots:
        tokens = len(truth[s]) - 1
        assert tokens / L - 1 <= flushes[s] <= tokens / (L - T) + 1, (flushes, tokens)
