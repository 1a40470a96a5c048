"""DSparkKDAAttnBackend inside real SGLang: SGLang's own pools (``HybridReqToTokenPool``, mamba
pool with verify intermediates or ReplaySSM rings), real ``ForwardBatch``es and DSPARK verify
inputs, the layer's real ``RadixLinearAttention.forward`` and the hybrid's real commit entry point
(``update_mamba_state_after_mtp_verify``). Kernels run under ``TRITON_INTERPRET=1`` on CPU.

The oracle for every state is the float64 sequential reference (``kernels.reference``), and the
"decode the accepted tokens one by one" run goes through the backend's own DECODE path.

The module registers the plugin in-process, so it runs in a pytest process of its own
(``own_process``, tests/conftest.py).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_kit import KDARunner, bind_requests, dflash_verify_input, make_forward_batch
from sglang_dspark_plugin.errors import DSparkError
from sglang_dspark_plugin.kernels.reference import buffered_decode_state_ref, sequential_ref
from sglang_dspark_plugin.settings import LAZY_RECORDS_MAX_WINDOW

H = 2
D = 3 * H * 128
NUM_REQ = 3
POOL = 4
DTYPE = torch.float32  # fp32 activations: the 1e-5 state tolerance

# Relative (norm-wise) error bounds against the float64 reference (kernels.reference, plain torch:
# not SGLang's Triton KDA kernels, whose bf16 tl.dot the Triton interpreter computes on raw bf16 bits
# unless cpu_support's bf16 shim is installed), per activation dtype:
# * fp32: the kernels compute in fp32 (~1e-7 per operation): 1e-5 on outputs and states (measured
#   <= 3e-7), conv windows are copied (1e-6, measured 0).
# * bf16, the serving dtype (activations, conv state and rings bf16; recurrent state fp32): outputs
#   are rounded to bf16 by the kernel and not by the reference, and the norm-wise error of that
#   rounding is at most the bf16 unit roundoff 2^-8 (measured 1.6-1.8e-3, the 2^-9 of uniform
#   rounding). Kernel and reference both round the conv outputs to bf16 (act_dtype), so the state
#   still carries only fp32 arithmetic: 1e-5 as in fp32 (measured <= 1.2e-7). The one exception
#   would be a conv output whose fp32 and float64 values round to different bf16 neighbours (about
#   2e-5 of the elements lie that close to a rounding boundary; such a flip shows as ~1e-4); these
#   fixed seeds have none, so a state error above 1e-5 means a kernel change, not noise. Conv
#   windows hold the raw bf16 inputs: copied exactly.
TOLERANCE = {
    torch.float32: dict(out=1e-5, state=1e-5, conv=1e-6),
    torch.bfloat16: dict(out=2.0**-8, state=1e-5, conv=1e-6),
}

pytestmark = pytest.mark.own_process


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module", autouse=True)
def registered():
    from sglang_dspark_plugin import register
    from sglang_dspark_plugin.harness import cpu_support

    # The harness's opt-in: without a GPU, SGLang's own KDA path (the fallback test) and its
    # snapshot commit need the CPU-only patches. A no-op with CUDA.
    cpu_support.apply()
    register()


@pytest.fixture(autouse=True)
def lazy_records_on(monkeypatch):
    """The lazy record ring, the default, set explicitly so that a developer's environment cannot
    turn it off; the tests of the default unset it, the fold's tests set 0."""
    monkeypatch.setenv("SGLANG_DSPARK_LAZY_RECORDS", "1")


class Setup:
    """One KDA layer on SGLang's pools, built through SGLang's construction chain."""

    def __init__(self, *, window: int, replayssm: bool, lower_bound=None, bias=False, backend="dspark", seed=0,
                 dtype=DTYPE, decode_ring_len=None, disable_radix_cache=False, server_args=None):
        from sglang.srt.layers.attention import attention_registry

        torch.manual_seed(seed)
        self.window = window
        self.dtype = dtype
        self.runner = KDARunner(
            backend=backend,
            num_heads=H,
            pool_size=POOL,
            num_draft_tokens=window if window > 1 else 0,
            replayssm=replayssm,
            decode_ring=decode_ring_len is not None,
            ring_len=decode_ring_len or 16,
            dtype=dtype,
            disable_radix_cache=disable_radix_cache,
            server_args=server_args,
        )
        full = attention_registry.ATTENTION_BACKENDS[backend](self.runner)
        self.hybrid = attention_registry.attn_backend_wrapper(self.runner, full)
        self.linear = self.hybrid.linear_attn_backend
        self.layer = RadixLinearAttention(
            layer_id=0,
            num_q_heads=H,
            num_k_heads=H,
            num_v_heads=H,
            head_q_dim=128,
            head_k_dim=128,
            head_v_dim=128,
            conv_weights=(torch.randn(D, 4) * 0.5).contiguous(),
            bias=torch.zeros(D) if bias else None,
            activation="silu",
            A_log=torch.log(torch.empty(1, 1, H, 1).uniform_(1, 16)),
            dt_bias=torch.randn(H * 128) * 0.1,
            lower_bound=lower_bound,
        )
        self.rpi = bind_requests(self.runner, NUM_REQ)
        self.slots = list(range(1, NUM_REQ + 1))
        pool = self.runner.req_to_token_pool.mamba_pool.mamba_cache
        self.cache = pool
        pool.temporal.normal_(0, 0.1)
        pool.conv[0].normal_(0, 1.0)

    def close(self):
        self.runner.close()

    def state(self):
        return self.cache.temporal[0].clone(), self.cache.conv[0][0].clone()

    def tokens(self, n):
        """Random verify/decode inputs in the activation dtype (drawn in fp32, then rounded)."""
        return (
            torch.randn(n, D).to(self.dtype),
            torch.randn(n, H * 128).to(self.dtype),
            torch.randn(1, n, H).to(self.dtype),
        )

    def run(self, mode, token_counts, mixed_qkv, a, b, spec_info_fn=None, rpi=None):
        rpi = self.rpi if rpi is None else rpi
        fb = make_forward_batch(self.runner, mode, rpi, token_counts)
        if spec_info_fn is not None:
            fb.spec_info = spec_info_fn(fb)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.hybrid)):
            self.hybrid.init_forward_metadata(fb)
            return self.layer(fb, mixed_qkv=mixed_qkv, a=a, b=b)

    def verify(self, mixed_qkv, a, b, verify_lens=None, graph_num_tokens=None):
        counts = verify_lens or [self.window] * NUM_REQ
        return self.run(
            ForwardMode.TARGET_VERIFY,
            counts,
            mixed_qkv, a, b,
            lambda fb: dflash_verify_input(fb, self.window, verify_lens, graph_num_tokens),
        )

    def commit(self, accept_lens):
        last = torch.tensor(accept_lens, dtype=torch.int64) - 1
        self.hybrid.update_mamba_state_after_mtp_verify(last, None, None, model=None)

    def reference(self, s0, c0, mixed_qkv, a, b, slot):
        """float64 sequential run of one request's tokens from slot's initial state."""
        x = mixed_qkv.view(1, -1, 3, H, 128)
        return sequential_ref(
            x[:, :, 0], x[:, :, 1], x[:, :, 2], a.view(1, -1, H, 128), b,
            conv_weight=self.layer.conv_weights, A_log=self.layer.A_log, dt_bias=self.layer.dt_bias,
            lower_bound=self.layer.lower_bound, state=s0[slot], window=c0[slot],
        )

    def decoded_request(self, s0, c0, tokens, outs, r):
        """Request ``r``'s outputs over decode steps (``tokens``: one ``tokens(NUM_REQ)`` per step,
        ``outs``: the steps' outputs) and its float64 reference (outputs, state, conv window)."""
        mixed = torch.cat([tok[0][r : r + 1] for tok in tokens])
        a = torch.cat([tok[1][r : r + 1] for tok in tokens])
        b = torch.cat([tok[2][:, r : r + 1] for tok in tokens], dim=1)
        out = torch.stack([o.view(NUM_REQ, H, 128)[r] for o in outs])
        return out, self.reference(s0, c0, mixed, a, b, self.slots[r])


def _token_rows(verify_lens, window, ragged):
    """Per request: the row indices of its tokens in the packed batch."""
    rows, start = [], 0
    for n in verify_lens:
        rows.append(list(range(start, start + n)))
        start += n if ragged else window
    return rows


def _verify_cases():
    """fp32 at every window and mode; bf16 (the serving dtype) at gamma 3 in static and compact mode
    (cap-accept verifies like static) and at gamma 7 (the chunked verify's finish kernel) with
    ReplaySSM, the serving configuration."""
    cases = []
    for gamma in (1, 3, 7):  # 7: the chunked verify's finish-kernel path (windows of 5+)
        for mode in ("static", "cap-accept", "compact"):
            for replayssm in (False, True):
                kind = "replayssm" if replayssm else "snapshot"
                cases.append(pytest.param(gamma, mode, replayssm, torch.float32, id=f"{gamma}-{mode}-{kind}"))
                if (gamma == 3 and mode != "cap-accept") or (gamma == 7 and replayssm and mode == "static"):
                    cases.append(pytest.param(gamma, mode, replayssm, torch.bfloat16, id=f"{gamma}-{mode}-{kind}-bf16"))
    return cases


@pytest.mark.parametrize("gamma,mode,replayssm,dtype", _verify_cases())
def test_verify_commit_equals_accepted_decode(gamma, mode, replayssm, dtype, monkeypatch):
    """SGLANG_RAGGED_VERIFY_MODE as the DSPARK scheduler runs it:

    * static: every request verifies its whole window (1+gamma tokens), any prefix is accepted;
    * cap-accept: the scheduler gives each request a verify length (its budget), but the batch stays
      dense -- every request still verifies its whole window, the backend gets no ragged layout --
      and SGLang caps the commit at the budget (``min(accepted, verify_len)``, dspark_verify.py);
    * compact: request i brings only its verify_len_i tokens, packed (a ragged layout), and accepts
      a prefix of them.
    """
    from sglang.srt.speculative.ragged_verify import read_ragged_verify_mode

    from sglang_dspark_plugin import backend as backend_module

    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
    assert read_ragged_verify_mode().value == mode
    densified = []

    def densify_spy(mixed_qkv, *args, **kwargs):
        batch = real_densify(mixed_qkv, *args, **kwargs)
        shares_memory = batch.q.untyped_storage().data_ptr() == mixed_qkv.untyped_storage().data_ptr()
        densified.append((kwargs["ragged"], shares_memory))
        return batch

    real_densify = backend_module.densify_verify_batch
    monkeypatch.setattr(backend_module, "densify_verify_batch", densify_spy)
    decode_calls = []
    real_decode = backend_module.decode

    def decode_spy(*args, **kwargs):
        decode_calls.append(args[0].shape[1])  # tokens of q [1, B, H, 128]
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(backend_module, "decode", decode_spy)

    tol = TOLERANCE[dtype]
    window = gamma + 1
    rng = random.Random(1000 * gamma + len(mode) + replayssm)
    setup = Setup(window=window, replayssm=replayssm, lower_bound=-5.0 if gamma == 3 else None, dtype=dtype)
    try:
        ragged = mode == "compact"
        verify_lens = [rng.randint(1, window) for _ in range(NUM_REQ)] if mode != "static" else [window] * NUM_REQ
        lens = verify_lens if ragged else [window] * NUM_REQ  # tokens each request brings to the verify
        total = sum(lens)
        extra = 2 if ragged else 0  # graph-bucket leftover tokens: covered by no request
        mixed_qkv, a, b = setup.tokens(total + extra)
        s0, c0 = setup.state()
        rings_before = (
            None if not replayssm else setup.cache.replayssm_rawv[0].clone()
        )
        out = setup.verify(
            mixed_qkv, a, b,
            verify_lens=lens if ragged else None,
            graph_num_tokens=total + extra if ragged else None,
        )
        assert out.shape == (1, total + extra, H, 128)
        assert setup.linear.last_verify_used_plugin  # the plugin's kernel ran, not SGLang's
        # Static and cap-accept verify dense windows as views of SGLang's tensors (no copy);
        # compact scatters the packed tokens into a dense batch.
        assert densified == [(True, False)] if ragged else densified == [(False, True)]
        # Verify leaves the persistent state alone.
        assert torch.equal(setup.cache.temporal[0], s0) and torch.equal(setup.cache.conv[0][0], c0)
        if replayssm:
            assert setup.cache.intermediate_ssm is None
            assert not torch.equal(setup.cache.replayssm_rawv[0], rings_before)

        accepted = [rng.randint(1, n) for n in lens]  # what the target model accepted
        commit = [min(n, cap) for n, cap in zip(accepted, verify_lens)]  # cap-accept caps it
        setup.commit(commit)

        errors = []
        for i, rows in enumerate(_token_rows(lens, window, ragged)):
            slot = setup.slots[i]
            ref_out, _, _ = setup.reference(s0, c0, mixed_qkv[rows], a[rows], b[:, rows], slot)
            errors.append(("out", rel_err(out[0, rows], ref_out)))
            kept = rows[: commit[i]]
            _, ref_state, ref_window = setup.reference(s0, c0, mixed_qkv[kept], a[kept], b[:, kept], slot)
            errors.append(("state", rel_err(setup.cache.temporal[0, slot], ref_state)))
            errors.append(("conv", rel_err(setup.cache.conv[0][0, slot], ref_window)))
        for name, error in errors:
            assert error <= tol[name], (name, error, tol[name])
        if ragged:
            assert torch.count_nonzero(out[0, total:]) == 0  # uncovered tokens: zero output
        # Untouched slots (0 and the spare) keep their bytes.
        for slot in (0, POOL):
            assert torch.equal(setup.cache.temporal[0, slot], s0[slot])
            assert torch.equal(setup.cache.conv[0][0, slot], c0[slot])
        committed = {s: (setup.cache.temporal[0, s].clone(), setup.cache.conv[0][0, s].clone()) for s in setup.slots}

        # The same committed tokens, one DECODE step at a time, through the backend's decode path.
        setup.cache.temporal[0].copy_(s0)
        setup.cache.conv[0][0].copy_(c0)
        token_rows = _token_rows(lens, window, ragged)
        for t in range(max(commit)):
            live = [i for i in range(NUM_REQ) if commit[i] > t]
            rows = [token_rows[i][t] for i in live]
            setup.run(
                ForwardMode.DECODE, [1] * len(live), mixed_qkv[rows], a[rows], b[:, rows],
                rpi=setup.rpi[live],
            )
        # every decode step ran the plugin's decode kernel on its live requests (no fallback)
        assert decode_calls == [sum(c > t for c in commit) for t in range(max(commit))]
        for s in setup.slots:
            assert rel_err(setup.cache.temporal[0, s], committed[s][0]) <= tol["state"]
            assert rel_err(setup.cache.conv[0][0, s], committed[s][1]) <= tol["conv"]
    finally:
        setup.close()


@pytest.mark.parametrize("replayssm", [False, True], ids=["snapshot", "replayssm"])
def test_graph_padding_rows_change_nothing(replayssm):
    window = 3
    setup = Setup(window=window, replayssm=replayssm, seed=7)
    try:
        mixed_qkv, a, b = setup.tokens(NUM_REQ * window)
        s0, c0 = setup.state()
        scratch = {
            name: getattr(setup.cache, name)[0].clone()
            for name in ("replayssm_rawv", "replayssm_rawk", "replayssm_g", "replayssm_beta")
            if getattr(setup.cache, name, None) is not None
        }
        fb = make_forward_batch(setup.runner, ForwardMode.TARGET_VERIFY, setup.rpi, [window] * NUM_REQ)
        fb.spec_info = dflash_verify_input(fb, window)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=setup.hybrid)):
            setup.hybrid.init_forward_metadata(fb)
            # What CUDA-graph replay does to padded rows of a captured bucket (SGLang's
            # _replay_metadata): their mamba slot becomes -1.
            setup.linear.forward_metadata.mamba_cache_indices[NUM_REQ - 1] = -1
            out = setup.layer(fb, mixed_qkv=mixed_qkv, a=a, b=b)
        pad_slot = setup.slots[-1]
        assert torch.count_nonzero(out[0, (NUM_REQ - 1) * window:]) == 0
        setup.commit([window] * NUM_REQ)
        assert torch.equal(setup.cache.temporal[0, pad_slot], s0[pad_slot])
        assert torch.equal(setup.cache.conv[0][0, pad_slot], c0[pad_slot])
        for name, before in scratch.items():
            assert torch.equal(getattr(setup.cache, name)[0, pad_slot], before[pad_slot]), name
        # The real rows did commit.
        assert not torch.equal(setup.cache.temporal[0, setup.slots[0]], s0[setup.slots[0]])
    finally:
        setup.close()


def test_fallback_matches_sglang_parent(caplog):
    """A conv bias is outside the fast path: the backend must hand the layer to SGLang's own
    KDA code and produce exactly what SGLang's stock backend produces."""
    window = 2
    results = []
    for backend in ("dspark", "triton"):
        setup = Setup(window=window, replayssm=False, bias=True, backend=backend, seed=3)
        try:
            torch.manual_seed(11)
            mixed_qkv, a, b = setup.tokens(NUM_REQ * window)
            with caplog.at_level(logging.WARNING, logger="sglang_dspark_plugin"):
                out = setup.verify(mixed_qkv, a, b)
            setup.commit([2, 1, 2])
            results.append((out, setup.cache.temporal[0].clone(), setup.cache.conv[0][0].clone()))
            if backend == "dspark":
                assert setup.linear.last_verify_used_plugin is False
        finally:
            setup.close()
    for ours, stock in zip(*results):
        assert torch.equal(ours, stock)
    assert "conv bias is set" in caplog.text


def test_fallback_after_a_plugin_verify_commits_through_sglang(monkeypatch):
    """ReplaySSM, two verify + commit cycles: the first through the plugin (its fold commits), the
    second falls back (a conv bias appears). The fallback must clear the plugin's verify flag so
    that SGLang's own commit matches SGLang's verify (the plugin's fold must not run), and both
    cycles must end where stock SGLang's run of the same tokens ends."""
    from sglang_dspark_plugin import commit as commit_module

    folds = []
    real_fold = commit_module.replayssm_fold

    def fold_spy(*args, **kwargs):
        folds.append(1)
        return real_fold(*args, **kwargs)

    monkeypatch.setattr(commit_module, "replayssm_fold", fold_spy)
    window = 3
    results = {}
    for backend in ("dspark", "triton"):
        setup = Setup(window=window, replayssm=True, backend=backend, seed=13)
        try:
            torch.manual_seed(17)
            cycles = [setup.tokens(NUM_REQ * window) for _ in range(2)]
            outs = []
            for cycle, (tokens, accept) in enumerate(zip(cycles, ([3, 1, 2], [2, 3, 1]))):
                if cycle == 1:
                    setup.layer.bias = torch.zeros(D)  # outside the plugin's fast path
                folds.clear()
                outs.append(setup.verify(*tokens))
                if backend == "dspark":
                    assert setup.linear.last_verify_used_plugin is (cycle == 0)
                setup.commit(accept)
                if backend == "dspark":
                    assert folds == ([1] if cycle == 0 else []), cycle  # the plugin's fold only after its verify
            results[backend] = (outs, setup.cache.temporal[0].clone(), setup.cache.conv[0][0].clone())
        finally:
            setup.close()
    (ours, state, conv), (stock, stock_state, stock_conv) = results["dspark"], results["triton"]
    for cycle in range(2):
        assert rel_err(ours[cycle], stock[cycle]) <= 1e-5, cycle
    assert rel_err(state, stock_state) <= 1e-5
    assert rel_err(conv, stock_conv) <= 1e-6


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus-gate", "lower-bound-gate"])
def test_reference_agrees_with_sglangs_own_kda(lower_bound):
    """The oracle of these tests and of tests/kernels, ``kernels.reference``, against SGLang's own
    KDA code (its stock ``triton`` backend, fp32): decode steps, and a DSPARK verify with its
    ReplaySSM commit, for both gates. Without it a misreading of KDA shared by the reference and
    our kernels (gate, norms, conv) would pass every other unit test."""
    setup = Setup(window=1, replayssm=False, backend="triton", lower_bound=lower_bound, seed=21)
    try:
        s0, c0 = setup.state()
        tokens = [setup.tokens(NUM_REQ) for _ in range(3)]
        outs = [setup.run(ForwardMode.DECODE, [1] * NUM_REQ, *tok) for tok in tokens]
        for r, slot in enumerate(setup.slots):
            out, (out_ref, state_ref, conv_ref) = setup.decoded_request(s0, c0, tokens, outs, r)
            assert rel_err(out, out_ref) <= 1e-5, ("decode out", rel_err(out, out_ref))
            assert rel_err(setup.cache.temporal[0, slot], state_ref) <= 1e-5
            assert rel_err(setup.cache.conv[0][0, slot], conv_ref) <= 1e-6
    finally:
        setup.close()
    window = 4
    setup = Setup(window=window, replayssm=True, backend="triton", lower_bound=lower_bound, seed=22)
    try:
        s0, c0 = setup.state()
        mixed_qkv, a, b = setup.tokens(NUM_REQ * window)
        out = setup.verify(mixed_qkv, a, b)
        accept = [4, 1, 3]
        setup.commit(accept)
        for i, slot in enumerate(setup.slots):
            rows = list(range(i * window, (i + 1) * window))
            ref_out, _, _ = setup.reference(s0, c0, mixed_qkv[rows], a[rows], b[:, rows], slot)
            assert rel_err(out[0, rows], ref_out) <= 1e-5, ("verify out", i)
            kept = rows[: accept[i]]
            _, state_ref, conv_ref = setup.reference(s0, c0, mixed_qkv[kept], a[kept], b[:, kept], slot)
            assert rel_err(setup.cache.temporal[0, slot], state_ref) <= 1e-5, ("state", i)
            assert rel_err(setup.cache.conv[0][0, slot], conv_ref) <= 1e-6, ("conv", i)
    finally:
        setup.close()


def test_bad_layout_raises_documented_error():
    setup = Setup(window=2, replayssm=False, seed=5)
    try:
        mixed_qkv, a, b = setup.tokens(NUM_REQ * 2)
        with pytest.raises(DSparkError, match="DSPARK-E201"):
            setup.verify(mixed_qkv[:, :-128], a, b)  # one head's worth of channels missing
        with pytest.raises(DSparkError, match="DSPARK-E204"):
            setup.verify(mixed_qkv, a[:, :-128], b)
        with pytest.raises(DSparkError, match="DSPARK-E205"):
            setup.verify(mixed_qkv, a, b[:, :, :1])
        # A window that disagrees with --speculative-dspark-block-size.
        with pytest.raises(DSparkError, match="DSPARK-E208"):
            setup.run(
                ForwardMode.TARGET_VERIFY, [3] * NUM_REQ, *setup.tokens(NUM_REQ * 3),
                spec_info_fn=lambda fb: dflash_verify_input(fb, 3),
            )
    finally:
        setup.close()


def test_capability_flags_report_the_truth():
    """SGLang captures compact (ragged) verify graphs only when the hybrid says both children
    support them. Ours densifies with fixed shapes and no host sync (True); on this machine the
    MLA delegate is ``triton``, which does not, so the hybrid must say False (with ``fa3``, the
    Hopper delegate, it says True)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    setup = Setup(window=2, replayssm=True, seed=1)
    try:
        assert setup.linear.supports_ragged_verify_graph is True
        assert setup.linear.needs_cpu_seq_lens is False
        assert isinstance(setup.hybrid.full_attn_backend, TritonAttnBackend)
        assert setup.hybrid.supports_ragged_verify_graph is False
    finally:
        setup.close()


@pytest.mark.parametrize("replayssm", [False, True], ids=["snapshot", "replayssm"])
def test_radix_track_snapshot_is_written(replayssm):
    """SGLang's extra_buffer radix cache asks the commit to also store the state (and conv
    window) after a given step into a track slot; step -1 means no snapshot for that request."""
    window = 3
    setup = Setup(window=window, replayssm=replayssm, seed=9)
    try:
        mixed_qkv, a, b = setup.tokens(NUM_REQ * window)
        s0, c0 = setup.state()
        setup.verify(mixed_qkv, a, b)
        track_slot = POOL  # the spare slot
        last = torch.tensor([2, 1, 0])
        setup.hybrid.update_mamba_state_after_mtp_verify(
            last,
            torch.tensor([track_slot, 0, 0], dtype=torch.int64),
            torch.tensor([1, -1, -1], dtype=torch.int64),
            model=None,
        )
        rows = list(range(0, 2))  # request 0's first two tokens: the state after step 1
        _, ref_state, ref_window = setup.reference(s0, c0, mixed_qkv[rows], a[rows], b[:, rows], setup.slots[0])
        assert rel_err(setup.cache.temporal[0, track_slot], ref_state) <= 1e-5
        assert rel_err(setup.cache.conv[0][0, track_slot], ref_window) <= 1e-6
        assert torch.equal(setup.cache.temporal[0, 0], s0[0])  # step -1: no snapshot
    finally:
        setup.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_buffered_decode_keeps_sglangs_ring_contract(dtype, monkeypatch):
    """--enable-linear-replayssm (plain decode, no speculation): the dspark decode reads and writes
    SGLang's decode ring under SGLang's own cursor (the hybrid backend snapshots and advances
    ``replayssm_write_pos`` per step, wrapping at L - 1 with a flush). Across two wraps: outputs
    equal the float64 sequential reference, the cursor is where SGLang puts it, and the pool state
    plus the ring rows SGLang says are pending give the reference state."""
    from sglang_dspark_plugin import backend as backend_module

    L = 4
    steps = 2 * L + 2
    ring_calls = []
    real_decode = backend_module.decode

    def decode_spy(*args, **kwargs):
        ring_calls.append(kwargs.get("ring_d") is not None and kwargs.get("write_pos") is not None)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(backend_module, "decode", decode_spy)
    setup = Setup(window=1, replayssm=False, seed=11, dtype=dtype, decode_ring_len=L)
    try:
        s0, c0 = setup.state()
        tokens = [setup.tokens(NUM_REQ) for _ in range(steps)]
        outs = [setup.run(ForwardMode.DECODE, [1] * NUM_REQ, *tok) for tok in tokens]
        assert ring_calls == [True] * steps  # the plugin's kernel, through the ring, every step
        pool = setup.runner.req_to_token_pool.mamba_pool
        tol = TOLERANCE[dtype]
        for r, slot in enumerate(setup.slots):
            out, (out_ref, state_ref, conv_ref) = setup.decoded_request(s0, c0, tokens, outs, r)
            assert rel_err(out, out_ref) <= tol["out"], rel_err(out, out_ref)
            pending = int(pool.replayssm_write_pos[slot])
            assert pending == steps % L  # SGLang's cursor: +1 per step, 0 after the flush at L - 1
            cache = setup.cache
            state = buffered_decode_state_ref(cache.temporal[0], cache.replayssm_d[0], cache.replayssm_k[0],
                                              cache.replayssm_g[0], slot, pending)
            assert rel_err(state, state_ref) <= tol["state"], rel_err(state, state_ref)
            # and the pool really holds a checkpoint: the pending tokens are only in the ring
            assert pending > 0 and rel_err(cache.temporal[0][slot], state_ref) > 1e-3
            assert rel_err(cache.conv[0][0][slot], conv_ref) <= tol["conv"]
    finally:
        setup.close()


@pytest.mark.parametrize("dtype,window", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 8)],
                         ids=["fp32", "bf16", "fp32-window8-all"])
def test_lazy_record_ring_through_sglang(dtype, window, caplog, monkeypatch):
    """--enable-linear-replayssm-spec where the lazy record ring is safe (here: radix cache off):
    verify -> random accept -> the hybrid's commit, 8 cycles over SGLang's real pool, crossing
    flushes, with a radix track snapshot every cycle. After each commit the slot's state carried
    over its pending records, and the checkpoint alone ``cursor`` tokens back, match the float64
    sequential run of the accepted tokens; the conv windows are current. bf16: the deltas are
    kept as 16-bit halves in SGLang's bf16 replayssm_d / replayssm_k. An EXTEND resets the
    batch's cursors (stream-ordered), and with the no_buffer radix cache the ring stays off.
    8-token windows (the finish-kernel path): off by default, on with SGLANG_DSPARK_LAZY_RECORDS=all."""
    from sglang_dspark_plugin.commit import delta_ring
    from sglang_dspark_plugin.kernels.record_ring import materialize_records

    tol = TOLERANCE[dtype]
    if window > LAZY_RECORDS_MAX_WINDOW:
        with caplog.at_level(logging.INFO, logger="sglang_dspark_plugin"):
            setup = Setup(window=window, replayssm=True, dtype=dtype, seed=3, disable_radix_cache=True)
        try:
            assert setup.linear.record_cursor is None
            assert f"lazy record ring off: windows of {window} tokens" in caplog.text
        finally:
            setup.close()
        caplog.clear()
        monkeypatch.setenv("SGLANG_DSPARK_LAZY_RECORDS", "all")
    with caplog.at_level(logging.INFO, logger="sglang_dspark_plugin"):
        setup = Setup(window=window, replayssm=True, dtype=dtype, seed=3, disable_radix_cache=True)
    try:
        assert "lazy record ring on (ring length 16)" in caplog.text
        cursor = setup.linear.record_cursor
        pool = setup.runner.req_to_token_pool.mamba_pool
        assert cursor is pool.dspark_record_cursor
        # SGLang's decode cursor stays unallocated: its alloc-time reset would host-sync per request
        assert pool.replayssm_write_pos is None
        L = setup.cache.replayssm_rawk.shape[-2]
        rng = random.Random(5)
        s0, c0 = setup.state()
        truth = {s: [s0[s].double()] for s in setup.slots}  # eager state after every accepted token
        conv = {s: c0[s].double() for s in setup.slots}
        flushes = 0
        for cycle in range(8 if window <= 4 else 5):  # (interpreter time: 8-token windows cost ~3x)
            mixed_qkv, a, b = setup.tokens(NUM_REQ * window)
            before = cursor.clone()
            out = setup.verify(mixed_qkv, a, b)
            accept = [rng.randint(1, window) for _ in range(NUM_REQ)]
            track_step = rng.randint(0, accept[0] - 1)
            cursor[POOL] = 1 + cycle % L  # stale records in the track slot: the snapshot must end them
            setup.hybrid.update_mamba_state_after_mtp_verify(
                torch.tensor(accept) - 1, torch.tensor([POOL, 0, 0]), torch.tensor([track_step, -1, -1]), model=None)
            for i, slot in enumerate(setup.slots):
                flushes += int(before[slot]) + window > L
                rows = list(range(i * window, (i + 1) * window))
                x = mixed_qkv.view(1, -1, 3, H, 128).double()
                ref_out, _, _ = sequential_ref(
                    x[:, rows, 0], x[:, rows, 1], x[:, rows, 2], a.double().view(1, -1, H, 128)[:, rows],
                    b.double()[:, rows], conv_weight=setup.layer.conv_weights, A_log=setup.layer.A_log,
                    dt_bias=setup.layer.dt_bias, lower_bound=None, state=truth[slot][-1], window=conv[slot],
                    act_dtype=dtype)
                assert rel_err(out[0, rows], ref_out) <= tol["out"], cycle
                win = conv[slot]
                for t in rows[: accept[i]]:
                    _, S, win = sequential_ref(
                        x[:, [t], 0], x[:, [t], 1], x[:, [t], 2], a.double().view(1, -1, H, 128)[:, [t]],
                        b.double()[:, [t]], conv_weight=setup.layer.conv_weights, A_log=setup.layer.A_log,
                        dt_bias=setup.layer.dt_bias, lower_bound=None, state=truth[slot][-1], window=win,
                        act_dtype=dtype)
                    truth[slot].append(S)
                conv[slot] = win
                if i == 0:  # the track snapshot: the state after window step track_step
                    assert rel_err(setup.cache.temporal[0, POOL], truth[slot][-accept[0] + track_step]) <= tol["state"]
                    assert int(cursor[POOL]) == 0
                assert rel_err(setup.cache.conv[0][0, slot], conv[slot]) <= tol["conv"], cycle
                pending = int(cursor[slot])
                assert 0 < pending <= L
                assert rel_err(setup.cache.temporal[0, slot], truth[slot][-1 - pending]) <= tol["state"], cycle
            now = setup.cache.temporal.clone()
            slots = torch.tensor(setup.slots, dtype=torch.int32)
            materialize_records(now, setup.cache.replayssm_rawk, setup.cache.replayssm_g, setup.cache.replayssm_beta,
                                delta_ring(setup.cache), slots, cursor[slots.long()], slots)
            for slot in setup.slots:
                assert rel_err(now[0, slot], truth[slot][-1]) <= tol["state"], cycle
        assert flushes >= 2, flushes
        assert torch.equal(setup.cache.temporal[0, 0], s0[0])  # the padding slot: untouched

        fb = make_forward_batch(setup.runner, ForwardMode.EXTEND, setup.rpi, [2] * NUM_REQ)
        fb.extend_seq_lens = torch.tensor([2] * NUM_REQ, dtype=torch.int32)
        fb.extend_seq_lens_cpu = [2] * NUM_REQ
        fb.extend_start_loc = torch.tensor([0, 2, 4], dtype=torch.int32)
        fb.extend_prefix_lens = torch.tensor([4] * NUM_REQ, dtype=torch.int32)
        fb.extend_prefix_lens_cpu = [4] * NUM_REQ
        setup.linear.init_forward_metadata(fb)  # the KDA half of the hybrid's metadata
        assert all(int(cursor[s]) == 0 for s in setup.slots)  # a prefill starts the records afresh
    finally:
        setup.close()

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_dspark_plugin"):
        setup = Setup(window=window, replayssm=True, dtype=dtype, seed=3)
    try:
        assert setup.linear.record_cursor is None
        assert "lazy record ring off: no_buffer radix cache" in caplog.text
    finally:
        setup.close()


def test_lazy_record_ring_guards():
    """The lazy record ring's guards: every eager extend-metadata hook (eager, breakable prefill
    graph refresh, full prefill graph) restarts the batch's records; a second backend on the same
    pool takes the first one's decision; a KDA layer SGLang would serve keeps the ring off at
    startup (scan of the model's layers) and, met at verify time, raises DSPARK-E209 instead of
    mixing SGLang's verify with records; so does a plain DECODE forward."""
    from types import SimpleNamespace

    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

    window = 4
    setup = Setup(window=window, replayssm=True, seed=4, disable_radix_cache=True)
    try:
        linear, cursor = setup.linear, setup.linear.record_cursor
        pool = setup.runner.req_to_token_pool.mamba_pool
        assert cursor is not None and pool.dspark_lazy_records is True
        for hook in ("refresh_prefill_graph_metadata", "init_forward_metadata_out_graph"):
            cursor.fill_(3)
            fb = make_forward_batch(setup.runner, ForwardMode.EXTEND, setup.rpi, [2] * NUM_REQ)
            parent = getattr(KDAAttnBackend, hook)
            try:  # the parent's graph bookkeeping needs real graph buffers: only the reset is checked
                setattr(KDAAttnBackend, hook, lambda self, *a, **k: None)
                with _HostSyncs() as syncs:
                    getattr(linear, hook)(*(("meta", fb) if hook.startswith("refresh") else (fb,)))
            finally:
                setattr(KDAAttnBackend, hook, parent)
            assert syncs.count == syncs.scalar_assigns == 0, hook  # the reset: no host sync at a prefill either
            assert all(int(cursor[s]) == 0 for s in setup.slots), hook
            assert int(cursor[POOL]) == 3  # other slots keep their records

        # not restarted: a graph capture's dummy batch, and the extends of speculation (the target
        # verify, the draft's extend), which continue the working slots' records
        fb = make_forward_batch(setup.runner, ForwardMode.EXTEND, setup.rpi, [2] * NUM_REQ)
        cursor.fill_(3)
        parent = KDAAttnBackend.init_forward_metadata_out_graph
        try:
            KDAAttnBackend.init_forward_metadata_out_graph = lambda self, *a, **k: None
            linear.init_forward_metadata_out_graph(fb, in_capture=True)
        finally:
            KDAAttnBackend.init_forward_metadata_out_graph = parent
        for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
            fb.forward_mode = mode
            linear._restart_records(fb)
        assert all(int(cursor[s]) == 3 for s in setup.slots)
        fb.forward_mode = ForwardMode.EXTEND
        linear._restart_records(fb)
        assert all(int(cursor[s]) == 0 for s in setup.slots)

        # a second backend on the pool follows the first one's decision
        again = type(linear).__new__(type(linear))
        again.num_draft_tokens, again.req_to_token_pool = window, linear.req_to_token_pool
        again._init_lazy_records(setup.runner)
        assert again.record_cursor is cursor

        # a layer with a conv bias would be SGLang's: the startup scan keeps the ring off
        biased = RadixLinearAttention(
            layer_id=0, num_q_heads=H, num_k_heads=H, num_v_heads=H, head_q_dim=128, head_k_dim=128,
            head_v_dim=128, conv_weights=setup.layer.conv_weights, bias=torch.zeros(D), activation="silu",
            A_log=setup.layer.A_log, dt_bias=setup.layer.dt_bias,
        )
        reason = linear._lazy_records_off_reason(pool, SimpleNamespace(model=torch.nn.ModuleList([biased]),
                                                                       dtype=DTYPE))
        assert reason is not None and "conv bias" in reason

        # the default: on; 0: off
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("SGLANG_DSPARK_LAZY_RECORDS")
            assert linear._lazy_records_off_reason(pool, setup.runner) is None
            mp.setenv("SGLANG_DSPARK_LAZY_RECORDS", "0")
            assert linear._lazy_records_off_reason(pool, setup.runner) == "SGLANG_DSPARK_LAZY_RECORDS=0"
        assert linear._lazy_records_off_reason(pool, setup.runner) is None  # =1, as the tests run

        # SGLANG_DSPARK_LAZY_RECORDS=all: windows up to the tested 16 tokens, not beyond
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("SGLANG_DSPARK_LAZY_RECORDS", "all")
                linear.num_draft_tokens = 17
                reason = linear._lazy_records_off_reason(pool, setup.runner)
                assert reason is not None and "tested up to 16" in reason
                linear.num_draft_tokens = 16  # passes the window checks; the ring (16 rows) is too short
                reason = linear._lazy_records_off_reason(pool, setup.runner)
                assert reason is not None and "ring length 16 < 2 windows" in reason
        finally:
            linear.num_draft_tokens = window

        # met at verify time (no model to scan here), a fallback raises instead of mixing paths
        setup.layer.bias = torch.zeros(D)
        mixed_qkv, a, b = setup.tokens(NUM_REQ * window)
        with pytest.raises(DSparkError, match="DSPARK-E209"):
            setup.verify(mixed_qkv, a, b)
        setup.layer.bias = None
        with pytest.raises(DSparkError, match="DSPARK-E209"):
            setup.run(ForwardMode.DECODE, [1] * NUM_REQ, *setup.tokens(NUM_REQ))
    finally:
        setup.close()


class _HostSyncs(TorchDispatchMode):
    """Counts, in a ``with`` block, the ops that sync the host with the device on CUDA. ``count``:
    host reads of device values (``aten._local_scalar_dense``: ``.item()``, ``int(t)``, a 0-dim
    tensor index; ``aten.nonzero``: boolean masks). ``scalar_assigns``: Python scalars assigned
    through a tensor index (``t[idx] = 0``: an ``index_put_`` whose 0-dim value PyTorch builds in
    host memory and copies to a CUDA tensor with a stream sync, measured with
    ``torch.cuda.set_sync_debug_mode`` on the H200 in ``tests/kernels/test_commit_host.py``;
    ``index_fill_`` does not sync). On CPU both kinds look alike for host-side tensors (SGLang's
    allocator keeps some), so ``scalar_assigns`` is checked only where every tensor is a device
    one on a GPU. Under SGLang's overlap scheduler a sync makes the host wait for the step in
    flight."""

    SYNCS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default)
    INDEX_PUTS = (torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default)

    def __init__(self):
        super().__init__()
        self.count = self.scalar_assigns = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.SYNCS
        self.scalar_assigns += func in self.INDEX_PUTS and args[2].dim() == 0
        return func(*args, **(kwargs or {}))


def _prefill_batch(setup, rpi, lens):
    """A real EXTEND ``ForwardBatch`` of fresh requests (no cached prefix): ``lens[i]`` prompt
    tokens of request ``rpi[i]``."""
    fb = make_forward_batch(setup.runner, ForwardMode.EXTEND, rpi, lens, prefix_len=0)
    fb.seq_lens = torch.tensor(lens, dtype=torch.int32)
    fb.seq_lens_cpu, fb.seq_lens_sum = fb.seq_lens.clone(), sum(lens)
    fb.extend_seq_lens, fb.extend_seq_lens_cpu = torch.tensor(lens, dtype=torch.int32), list(lens)
    fb.extend_start_loc = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int32)
    fb.extend_prefix_lens = torch.zeros(len(lens), dtype=torch.int32)
    fb.extend_prefix_lens_cpu, fb.extend_num_tokens = [0] * len(lens), sum(lens)
    return fb


def test_prefill_restarts_the_records_of_exactly_its_slots():
    """Slot reuse under the lazy record ring. Every slot starts with a nonzero cursor over ring rows
    full of another request's records (a previous owner's pending tokens), as a reused slot does.
    A real prefill (SGLang's extend through the hybrid backend) of two fresh requests into slots 1
    and 3 must zero exactly those two cursors: slot 2 (not prefilled) and the others keep theirs.
    The requests' verify must then start from the state the prefill wrote, with no records: its
    outputs, and after the commit the checkpoint carried over the new records, equal the float64
    sequential run from that state. Had the prefill not reset the cursors, the verify would rebuild
    its start state from the previous owner's records."""
    from sglang_dspark_plugin.commit import delta_ring
    from sglang_dspark_plugin.kernels.record_ring import materialize_records

    window = 4
    setup = Setup(window=window, replayssm=True, seed=8, disable_radix_cache=True)
    try:
        cursor, cache = setup.linear.record_cursor, setup.cache
        L = cache.replayssm_rawk.shape[-2]
        assert cursor is not None and torch.count_nonzero(cursor) == 0  # the backend allocates zeros
        stale = torch.arange(1, POOL + 2, dtype=torch.int32)  # slot s: s + 1 pending records
        assert int(stale.max()) + window <= L  # no flush: the window goes behind the records
        cursor.copy_(stale)
        gen = torch.Generator().manual_seed(81)
        cache.replayssm_rawk[0].copy_(torch.randn(cache.replayssm_rawk[0].shape, generator=gen))
        cache.replayssm_g[0].copy_(-0.1 * torch.rand(cache.replayssm_g[0].shape, generator=gen))
        cache.replayssm_beta[0].copy_(0.5 + torch.rand(cache.replayssm_beta[0].shape, generator=gen))
        deltas = delta_ring(cache)
        deltas[0].copy_(torch.randn(deltas[0].shape, generator=gen))

        prefilled, slots = [0, 2], [1, 3]  # requests 0 and 2 own slots 1 and 3 (bind_requests)
        rpi = setup.rpi[prefilled]
        lens = [5, 3]
        fb = _prefill_batch(setup, rpi, lens)
        mixed_qkv, a, b = setup.tokens(sum(lens))
        other_state = cache.temporal[0, 2].clone()
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=setup.hybrid)):
            setup.hybrid.init_forward_metadata(fb)
            setup.layer(fb, mixed_qkv=mixed_qkv, a=a.unsqueeze(0), b=b)
        expected = stale.clone()
        expected[slots] = 0
        assert torch.equal(cursor, expected), (cursor, expected)  # exactly the prefilled slots
        assert torch.equal(cache.temporal[0, 2], other_state)
        s0, c0 = setup.state()  # what the prefill wrote: the verify's start state

        mixed_qkv, a, b = setup.tokens(len(slots) * window)
        out = setup.run(ForwardMode.TARGET_VERIFY, [window] * len(slots), mixed_qkv, a, b,
                        spec_info_fn=lambda fb: dflash_verify_input(fb, window), rpi=rpi)
        assert setup.linear.last_verify_used_plugin
        accept = [3, 2]
        setup.hybrid.update_mamba_state_after_mtp_verify(torch.tensor(accept) - 1, None, None, model=None)
        now = cache.temporal.clone()
        index = torch.tensor(slots, dtype=torch.int32)
        materialize_records(now, cache.replayssm_rawk, cache.replayssm_g, cache.replayssm_beta, delta_ring(cache),
                            index, cursor[index.long()], index)
        for i, slot in enumerate(slots):
            rows = list(range(i * window, (i + 1) * window))
            ref_out, _, _ = setup.reference(s0, c0, mixed_qkv[rows], a[rows], b[:, rows], slot)
            assert rel_err(out[0, rows], ref_out) <= TOLERANCE[DTYPE]["out"], (slot, rel_err(out[0, rows], ref_out))
            kept = rows[: accept[i]]
            _, ref_state, ref_window = setup.reference(s0, c0, mixed_qkv[kept], a[kept], b[:, kept], slot)
            assert int(cursor[slot]) == accept[i]  # the new request's records only
            assert rel_err(now[0, slot], ref_state) <= TOLERANCE[DTYPE]["state"], slot
            assert rel_err(cache.conv[0][0, slot], ref_window) <= TOLERANCE[DTYPE]["conv"], slot
        assert int(cursor[2]) == int(stale[2])  # the slot no prefill took keeps its records
    finally:
        setup.close()


# Serving modes that keep the lazy record ring off, with the reason the server logs
# (``dspark: lazy record ring off: <reason>``); each reason names the cause, not a neighbour of it.
RING_OFF_MODES = [
    pytest.param({}, None, id="default-on"),
    pytest.param(dict(disaggregation_mode="decode"),
                 "PD disaggregation, decode side (a request's first forward here is PREBUILT, not an extend",
                 id="pd-decode"),
    pytest.param(dict(disaggregation_mode="prefill"),
                 "PD disaggregation, prefill side (this server runs no verify", id="pd-prefill"),
    pytest.param(dict(enable_pdmux=True),
                 "PD multiplexing (--enable-pdmux: prefills run on their own stream beside the decode stream",
                 id="pdmux"),
    pytest.param(dict(enable_two_batch_overlap=True),
                 "two-batch overlap (--enable-two-batch-overlap: the verify runs on TBO's two child backends "
                 "and the commit on its primary backend", id="two-batch-overlap"),
    pytest.param(dict(pp_size=2), "pipeline parallelism", id="pipeline-parallel"),
    pytest.param(dict(enable_mixed_chunk=True), "mixed chunks (--enable-mixed-chunk", id="mixed-chunk"),
    pytest.param(dict(enable_streaming_session=True), "streaming sessions (--enable-streaming-session",
                 id="streaming-session"),
    pytest.param(dict(speculative_eagle_topk=2), "tree verify (speculative topk > 1)", id="topk-2"),
]


@pytest.mark.parametrize("server_args,reason", RING_OFF_MODES)
def test_lazy_record_ring_off_reasons(server_args, reason, caplog):
    """Each serving mode in which the lazy record ring would be unsafe turns it off at startup
    (every commit then folds), and the server logs why, naming the mode's real cause: under PD
    disaggregation the decode side's first forward is PREBUILT (no extend restarts the slot's
    records); under PD multiplexing prefills run on a stream of their own; under two-batch overlap
    the commit runs on the primary backend, the verify on the two children. The same backend with
    none of them runs the ring (the first case), so each case turns exactly its mode on."""
    with caplog.at_level(logging.INFO, logger="sglang_dspark_plugin"):
        setup = Setup(window=4, replayssm=True, seed=4, disable_radix_cache=True, server_args=server_args)
    try:
        pool = setup.runner.req_to_token_pool.mamba_pool
        lines = [r.getMessage() for r in caplog.records if "lazy record ring" in r.getMessage()]
        assert len(lines) == 1, lines
        if reason is None:
            assert setup.linear.record_cursor is not None and pool.dspark_lazy_records is True
            assert lines[0].startswith("dspark: lazy record ring on"), lines
        else:
            assert setup.linear.record_cursor is None and pool.dspark_lazy_records is False
            assert lines[0].startswith(f"dspark: lazy record ring off: {reason}"), lines
            assert "retraction" not in lines[0]  # the PD reason once named retraction, not the PREBUILT forward
            assert "every commit folds the accepted tokens" in lines[0]
    finally:
        setup.close()


def test_pipeline_stable_rows_and_tree_verify_fall_back(monkeypatch):
    """The decisions SGLang's own switches make at run time: pipeline-parallel stable rows
    (``SGLANG_ENABLE_PP_SPEC``, SGLang commits those rows itself) keep the ring off; a verify batch
    with a tree (``retrieve_parent_token``, speculative topk > 1) goes to SGLang's verify, as does
    one under FlashInfer's fused-accept verify, each with its reason; a chain verify takes the
    plugin's path."""
    setup = Setup(window=4, replayssm=True, seed=4, disable_radix_cache=True)
    try:
        linear, pool = setup.linear, setup.runner.req_to_token_pool.mamba_pool
        assert linear._lazy_records_off_reason(pool, setup.runner) is None
        monkeypatch.setenv("SGLANG_ENABLE_PP_SPEC", "1")
        assert linear._lazy_records_off_reason(pool, setup.runner) == (
            "pipeline-parallel stable rows (SGLang commits them itself)")
        monkeypatch.delenv("SGLANG_ENABLE_PP_SPEC")

        mixed_qkv, a, b = setup.tokens(NUM_REQ * 4)
        fb = make_forward_batch(setup.runner, ForwardMode.TARGET_VERIFY, setup.rpi, [4] * NUM_REQ)
        fb.spec_info = dflash_verify_input(fb, 4)
        linear.init_forward_metadata(fb)
        cache = setup.cache
        assert linear._fallback_reason(setup.layer, mixed_qkv, cache, verify=True) is None
        linear.forward_metadata.retrieve_parent_token = torch.zeros(NUM_REQ, 4, dtype=torch.int64)
        assert linear._fallback_reason(setup.layer, mixed_qkv, cache, verify=True) == "tree verify (speculative topk > 1)"
        assert linear._fallback_reason(setup.layer, mixed_qkv, cache, verify=False) is None  # decode has no tree
        linear.forward_metadata.retrieve_parent_token = None
        linear.accept_lens_pool = torch.zeros(POOL + 1, dtype=torch.int32)
        assert linear._fallback_reason(setup.layer, mixed_qkv, cache, verify=True) == (
            "FlashInfer fused-accept verify backend selected")
        assert linear._lazy_records_off_reason(pool, setup.runner) == "FlashInfer fused-accept verify backend selected"
    finally:
        setup.close()


def test_lazy_record_ring_admits_requests_without_a_host_sync():
    """Admitting a request under the lazy record ring makes no host sync: SGLang's
    ``HybridReqToTokenPool.alloc`` reads no device value. With SGLang's decode cursor
    ``replayssm_write_pos`` allocated (the lazy ring's first cursor), it zeroed it at a 0-dim slot
    index, one ``.item()`` per request: that is checked here too, so the test fails if the cursor
    moves back."""
    from types import SimpleNamespace

    def admit(pool, n):
        reqs = [SimpleNamespace(kv=SimpleNamespace(
            holds_kv=False, kv_allocated_len=0, req_pool_idx=None, holds_mamba=False, mamba_pool_idx=None,
            mamba_needs_clear=False, mamba_ping_pong_track_buffer=None)) for _ in range(n)]
        with _HostSyncs() as syncs:
            assert pool.alloc(reqs) is not None
        return syncs.count

    setup = Setup(window=4, replayssm=True, seed=4, disable_radix_cache=True)
    try:
        pool = setup.runner.req_to_token_pool
        assert setup.linear.record_cursor is not None
        assert admit(pool, 1) == 0
        pool.mamba_pool.replayssm_write_pos = torch.zeros_like(setup.linear.record_cursor)
        assert admit(pool, 1) == 1  # SGLang's decode cursor: one .item() per admitted request
    finally:
        setup.close()


@pytest.mark.parametrize("ring", ["lazy", "fold"])
def test_speculative_step_makes_no_host_sync(ring):
    """One speculative step through the plugin, verify and commit (with and without a radix track
    snapshot), reads no device value on the host: under the overlap scheduler it never makes the
    host wait for the GPU. (SGLang's own snapshot commit, which the snapshot mode uses, does.)"""
    setup = Setup(window=4, replayssm=True, seed=5, disable_radix_cache=ring == "lazy")
    try:
        assert (setup.linear.record_cursor is not None) == (ring == "lazy")
        for track in (True, False):
            mixed_qkv, a, b = setup.tokens(NUM_REQ * 4)
            with _HostSyncs() as syncs:
                setup.verify(mixed_qkv, a, b)
                setup.hybrid.update_mamba_state_after_mtp_verify(
                    torch.tensor([0, 1, 3]), torch.tensor([POOL, 0, 0]) if track else None,
                    torch.tensor([0, -1, -1]) if track else None, model=None)
            assert setup.linear.last_verify_used_plugin
            assert syncs.count == syncs.scalar_assigns == 0, (ring, track)
    finally:
        setup.close()


def _offer_output_gate(layer, num_tokens, seed, weight=None, eps=1e-5):
    """What SGLang's Kimi-K3 layer does before its attention call (``kimi_k3.py``): offer the gate
    (a view of its fused [q|k|v|g] projection) and publish o_norm's weight and eps."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(num_tokens, 4 * H * 128, generator=gen).to(DTYPE)
    if weight is None:
        weight = (1 + 0.2 * torch.randn(128, generator=gen)).to(torch.bfloat16).float()
    layer._k3_fused_decode_args = (None, None, None, None, None, weight, eps)
    layer._k3_onorm_gate = fused[:, 3 * H * 128:]
    layer._k3_onorm_consumed = False
    return layer._k3_onorm_gate, weight


@pytest.mark.parametrize("mode", ["compact"])  # (static verify: a view of the gate; the K3 e2e serves it)
def test_kimi_k3_output_gate_is_applied_and_consumed(mode, monkeypatch, caplog):
    """A Kimi-K3 layer's offered output gate goes into the verify and decode kernels, which then
    return the model's o_norm of what they return without it (float64 ``gated_rms_norm`` of the
    ungated output), in SGLang's token order (compact: packed), and the layer is told the gate was
    consumed. With SGLANG_DSPARK_OUTPUT_GATE=0, or an o_norm weight outside the contract, the gate
    is left to the model, untouched, with the reason logged."""
    import logging

    from sglang_dspark_plugin import backend as backend_module
    from sglang_dspark_plugin.kernels.reference import gated_rms_norm

    caplog.set_level(logging.INFO, logger="sglang_dspark_plugin")
    backend_module._logged_once.clear()
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
    monkeypatch.setenv("SGLANG_DSPARK_LAZY_RECORDS", "0")  # the verify leaves the pool state alone
    window = 4
    ragged = mode == "compact"
    lens = [4, 2, 3] if ragged else [window] * NUM_REQ
    total = sum(lens)
    setup = Setup(window=window, replayssm=True, lower_bound=-5.0, seed=11)
    try:
        mixed_qkv, a, b = setup.tokens(total)
        s0, c0 = setup.state()

        def run(phase, gate_on, weight=None):
            """(output, consumed, gate, weight) of a verify or a decode step from the same start."""
            monkeypatch.setenv("SGLANG_DSPARK_OUTPUT_GATE", "1" if gate_on else "0")
            setup.cache.temporal[0].copy_(s0)
            setup.cache.conv[0][0].copy_(c0)
            if phase == "verify":
                gate, w = _offer_output_gate(setup.layer, total, seed=3, weight=weight)
                out = setup.verify(mixed_qkv, a, b, verify_lens=lens if ragged else None,
                                   graph_num_tokens=total if ragged else None)
            else:
                gate, w = _offer_output_gate(setup.layer, NUM_REQ, seed=4, weight=weight)
                out = setup.run(ForwardMode.DECODE, [1] * NUM_REQ, mixed_qkv[:NUM_REQ], a[:NUM_REQ],
                                b[:, :NUM_REQ])
            return out, setup.layer._k3_onorm_consumed, gate, w

        for phase in ("verify", "decode"):
            plain, consumed_off, gate, w = run(phase, False)
            assert consumed_off is False
            gated, consumed, _, _ = run(phase, True)
            assert consumed is True
            want = gated_rms_norm(plain.double(), gate.double().view(plain.shape), w.double(), 1e-5).to(DTYPE)
            assert rel_err(gated, want) <= 1e-6, (phase, rel_err(gated, want))
            # an o_norm weight the kernels cannot take: the model normalises, nothing is consumed
            kept, consumed_bad, _, _ = run(phase, True, weight=torch.ones(64))
            assert consumed_bad is False and torch.equal(kept, plain)
    finally:
        setup.close()
    assert "output gate left to the model's o_norm: SGLANG_DSPARK_OUTPUT_GATE=0" in caplog.text
    assert "o_norm weight [64]" in caplog.text.replace("torch.Size(", "").replace(")", "")
