"""Tensor-parallel sharding of KDA layers, checked on CPU with SGLang's real layers.

Kimi-Linear-48B is served at TP2 (32 KDA heads -> 16 per rank) and Kimi-K3 at TP8 (96 -> 12 per
rank). Until a multi-GPU machine runs them end to end, this module builds SGLang's own KDA layer
classes *as rank r of tp ranks* in one CPU process and checks that what the plugin reads from a
rank is exactly that rank's shard.

How the ranks are made: ``get_parallel().override(tp_rank=r, tp_size=tp, attn_tp_rank=r,
attn_tp_size=tp, tp_group=<metadata>, attn_tp_group=<metadata>, ...)``, where the groups are
``SimpleNamespace(rank_in_group=r, world_size=tp)``: the pattern of SGLang's own fixtures
(``sglang.test.parallel_groups``: group metadata for tests that do not initialize distributed
groups). SGLang's linear layers, ``sharded_weight_loader`` and the KDA layers read their rank and
width from exactly these fields (``resolve_linear_parallel_group`` / ``get_group_rank_size``); no
process group is created and no collective runs.

Layers and weights:

* Kimi-Linear (TP2): ``sglang.srt.models.kimi_linear.KimiDeltaAttention`` with the kimi32 test
  model's KDA layer (32 heads x 128, ``tiny_models.make_target_weights`` on ``KIMI32`` shrunk to one
  KDA layer and hidden size 64), loaded through SGLang's real ``KimiLinearForCausalLM.load_weights``
  (q/k/v_conv1d -> fused ``qkv_conv1d`` shards 0/1/2, q/k/v/b/f_a/g_a -> the fused projection,
  ``sharded_weight_loader`` for ``dt_bias`` (axis 0) and ``A_log`` (axis 2)).
* Kimi-K3 (TP8): ``sglang.srt.models.kimi_k3.KimiK3DeltaAttention`` (K3's own KDA class: shards on the
  attention-TP group, full-rank output gate, ``gate_lower_bound = -5``) with the same generator at
  96 heads, converted to K3's checkpoint layout (``g_proj`` instead of ``g_a``/``g_b``, ``A_log``
  stored 1-D as ``[head_dim]`` whose first 96 entries are the heads; the other 32 are NaN so a rank
  that read them would fail), loaded through ``KimiK3LinearForCausalLM.load_weights``.

``load_weights`` runs unbound on a minimal shell (``config`` plus ``model.layers[0].self_attn``);
the model's ``post_load_weights`` is skipped (Kimi-Linear: MLA absorption, no MLA layer here;
K3: CUDA-only GEMM merges and the stash of SGLang's own fused K3 decode, which the plugin does not
use).

Asserted per rank:

1. ``num_q/k/v_heads == H / tp`` on the ``RadixLinearAttention`` the backend receives;
   ``conv_weights`` is the rank's slice of the full q, k and v conv weights in SGLang's fused
   ``[q_r | k_r | v_r]`` channel order (and a view of the loaded parameter); ``A_log`` / ``dt_bias``
   are the rank's head slice; ``lower_bound`` and ``bias`` as the model sets them.
2. SGLang's per-rank state pool (``mamba2_cache_params`` under the rank's scope) has ``H / tp``
   heads and ``3 * H / tp * 128`` conv channels, and a ``KDARunner`` pool of that head count has
   the same shapes; the plugin's ``_layer_state_args(layer, cache)`` passes exactly the layer's
   tensors and the pool's; the backend takes its fast path for the layer (no fallback reason).
3. The rank's ``mixed_qkv`` from SGLang's own (fused, column-parallel) projection, split by the
   plugin's ``split_mixed_qkv(mixed_qkv, layer.num_v_heads)``, is the rank's head slice of the full
   q/k/v projections; beta and the forget-gate input likewise.
4. End to end: every rank runs one DECODE step through the plugin's backend
   (``DSparkKDAAttnBackend.forward_decode`` -> ``kernels.decode``, spied on to prove it ran) on its
   own shard and pool; the ranks' outputs, recurrent states and conv windows are the head/channel
   slices of ``reference.decode_ref`` run on the *unsharded* layer (full checkpoint weights, full
   32- or 96-head state), i.e. concatenating the ranks gives the full layer.

Not covered here: collectives (``o_proj``'s all-reduce, the output norm and ``o_proj`` are not
run), CUDA graphs, serving under DP attention (``attn_tp_size < tp_size``: only the backend's
fallback decision is checked, ``test_dp_attention_falls_back_with_its_reason``), quantized checkpoints (they take
SGLang's unfused ``qkv_proj`` path), the verify path at TP (its kernels run at 16 / 12 heads in
tests/kernels/test_heads_per_rank.py), and real multi-process serving.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.srt.configs.kimi_linear import KimiLinearConfig
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.runtime_context import get_parallel

from sglang_kit import KDARunner, bind_requests, make_forward_batch
import sglang_dspark_plugin.backend as backend_mod
from sglang_dspark_plugin.harness import tiny_models as TM
from sglang_dspark_plugin.kernels.reference import decode_ref
from sglang_dspark_plugin.layout import split_mixed_qkv

HEAD = 128
HIDDEN = 64
PREFIX = "model.layers.0.self_attn."
NUM_REQ = 2
POOL = 4  # slots 0..POOL; bind_requests maps request i to slot i+1


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "kimi_linear" | "kimi_k3"
    heads: int
    tp: int

    @property
    def local_heads(self) -> int:
        return self.heads // self.tp


CASES = [
    Case("kimi-linear-48b-tp2", "kimi_linear", heads=32, tp=2),
    Case("kimi-k3-tp8", "kimi_k3", heads=96, tp=8),
]
RANKS = [pytest.param(c, r, id=f"{c.name}-rank{r}") for c in CASES for r in range(c.tp)]


def rel_err(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module", autouse=True)
def registered():
    from sglang_dspark_plugin import register

    register()


def tp_scope(rank: int, size: int):
    """This process as rank ``rank`` of ``size`` (TP == attention TP; no DP / CP attention)."""
    group = SimpleNamespace(rank_in_group=rank, world_size=size)
    return get_parallel().override(
        tp_rank=rank, tp_size=size, attn_tp_rank=rank, attn_tp_size=size,
        attn_dp_rank=0, attn_dp_size=1, attn_cp_rank=0, attn_cp_size=1,
        tp_group=group, attn_tp_group=group,
    )


# --- checkpoint and layers ------------------------------------------------------------------------


def _checkpoint(case: Case):
    """(config, full unsharded KDA-layer weights under SGLang's checkpoint names, full A_log [H])."""
    spec = dataclasses.replace(TM.KIMI32, name=case.name, layers=("kda",), hidden=HIDDEN, intermediate=HIDDEN,
                               kda_heads=case.heads)
    config = TM.target_config(spec)
    config["torch_dtype"] = "float32"  # fp32 activations throughout: tight tolerances (serving runs bf16)
    w = {k: v for k, v in TM.make_target_weights(spec).items() if k.startswith(PREFIX)}
    A_log = w[PREFIX + "A_log"].reshape(-1).clone()
    if case.model == "kimi_k3":
        config["linear_attn_config"].update(use_full_rank_gate=True, gate_lower_bound=-5.0)
        # K3 layout: a full-rank output gate, A_log 1-D [head_dim] (heads first, the rest unused)
        g_a, g_b = w.pop(PREFIX + "g_a_proj.weight").float(), w.pop(PREFIX + "g_b_proj.weight").float()
        w[PREFIX + "g_proj.weight"] = (g_b @ g_a).to(torch.bfloat16)
        a_log = torch.full((HEAD,), float("nan"))
        a_log[: case.heads] = A_log
        w[PREFIX + "A_log"] = a_log
    return KimiLinearConfig(**config), w, A_log


class _Shell(nn.Module):
    """What ``load_weights`` of SGLang's causal-LM class reads: ``config`` and
    ``model.layers[0].self_attn`` (parameter names ``model.layers.0.self_attn.*``)."""

    def __init__(self, config, attn):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        layer = nn.Module()
        layer.self_attn = attn
        self.model.layers = nn.ModuleList([layer])
        self.model.start_layer, self.model.end_layer = 0, 1

    def _is_non_local_pp_weight(self, name):  # Kimi-Linear: no pipeline parallelism
        return False

    def post_load_weights(self):  # see the module docstring
        pass


def dp_attention_scope(rank: int, size: int):
    """This process as rank ``rank`` of ``size`` TP ranks with data-parallel attention: attention-TP
    size 1, attention-DP size ``size`` (``--enable-dp-attention --dp-size size``)."""
    group = SimpleNamespace(rank_in_group=rank, world_size=size)
    alone = SimpleNamespace(rank_in_group=0, world_size=1)
    return get_parallel().override(
        tp_rank=rank, tp_size=size, attn_tp_rank=0, attn_tp_size=1,
        attn_dp_rank=rank, attn_dp_size=size, attn_cp_rank=0, attn_cp_size=1,
        tp_group=group, attn_tp_group=alone,
    )


def build_rank(case: Case, config, weights, rank: int, scope=None):
    """SGLang's KDA layer of ``case.model`` as rank ``rank``, full checkpoint loaded by SGLang's loader
    (under ``scope``, a parallel override; default: plain TP, ``tp_scope``)."""
    with scope or tp_scope(rank, case.tp):
        if case.model == "kimi_linear":
            from sglang.srt.models.kimi_linear import KimiDeltaAttention as Layer
            from sglang.srt.models.kimi_linear import KimiLinearForCausalLM as Model
        else:
            from sglang.srt.models.kimi_k3 import KimiK3DeltaAttention as Layer
            from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM as Model
        attn = Layer(layer_idx=0, hidden_size=config.hidden_size, config=config, prefix=PREFIX.rstrip("."))
        Model.load_weights(_Shell(config, attn), list(weights.items()))
        state_shape = config.mamba2_cache_params.shape  # SGLang's per-rank pool geometry
    return attn, state_shape


@pytest.fixture(scope="module")
def model():
    """Per case: config, full weights, full A_log and every rank's layer (built once)."""
    built = {}
    for case in CASES:
        config, w, A_log = _checkpoint(case)
        ranks = [build_rank(case, config, w, r) for r in range(case.tp)]
        built[case.name] = SimpleNamespace(config=config, w=w, A_log=A_log, ranks=ranks)
    return built


def rank_heads(case: Case, rank: int) -> slice:
    return slice(rank * case.local_heads, (rank + 1) * case.local_heads)


def rank_rows(case: Case, rank: int) -> slice:
    """The rank's rows of one full ``[H*128, ...]`` q, k or v tensor."""
    n = case.local_heads * HEAD
    return slice(rank * n, (rank + 1) * n)


def rank_channels(case: Case, rank: int) -> torch.Tensor:
    """The rank's channels of the full ``[q | k | v]`` (3*H*128) channel axis, in its fused order."""
    full, rows = case.heads * HEAD, rank_rows(case, rank)
    return torch.cat([torch.arange(rows.start, rows.stop) + i * full for i in range(3)])


def full_conv_weight(w) -> torch.Tensor:
    return torch.cat([w[PREFIX + f"{n}_conv1d.weight"][:, 0] for n in ("q", "k", "v")])  # [3*H*128, 4]


# --- 1. weights -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case,rank", RANKS)
def test_layer_holds_the_ranks_shard(model, case, rank):
    m = model[case.name]
    attn, _ = m.ranks[rank]
    layer = attn.attn  # the RadixLinearAttention the backend receives
    Hr = case.local_heads
    assert (layer.num_q_heads, layer.num_k_heads, layer.num_v_heads) == (Hr, Hr, Hr)
    assert (layer.head_q_dim, layer.head_k_dim, layer.head_v_dim) == (HEAD, HEAD, HEAD)
    assert attn.local_num_heads == Hr

    w, rows = m.w, rank_rows(case, rank)
    want = torch.cat([w[PREFIX + f"{n}_conv1d.weight"][rows, 0] for n in ("q", "k", "v")])
    assert layer.conv_weights.shape == (3 * Hr * HEAD, 4) and layer.conv_weights.dtype == torch.float32
    assert torch.equal(layer.conv_weights, want), "conv weights are not the rank's [q_r | k_r | v_r] slice"
    assert torch.equal(layer.conv_weights, full_conv_weight(w)[rank_channels(case, rank)])
    # the layer's conv_weights is a view of the parameter the loader wrote (not a stale copy)
    assert layer.conv_weights.data_ptr() == attn.qkv_conv1d.weight.data_ptr()
    assert layer.bias is None

    assert layer.A_log.numel() == Hr and layer.A_log.dtype == torch.float32
    assert torch.equal(layer.A_log.reshape(-1), m.A_log[rank_heads(case, rank)])
    assert layer.dt_bias.shape == (Hr * HEAD,) and layer.dt_bias.dtype == torch.float32
    assert torch.equal(layer.dt_bias, w[PREFIX + "dt_bias"][rows])
    assert layer.lower_bound == (-5.0 if case.model == "kimi_k3" else None)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_ranks_partition_the_layer(model, case):
    """Concatenating the ranks' shards gives the full layer: every head and channel exactly once."""
    m = model[case.name]
    layers = [attn.attn for attn, _ in m.ranks]
    full = full_conv_weight(m.w)
    order = torch.cat([rank_channels(case, r) for r in range(case.tp)])
    assert torch.equal(torch.sort(order).values, torch.arange(3 * case.heads * HEAD))
    assert torch.equal(torch.cat([x.conv_weights for x in layers]), full[order])
    assert torch.equal(torch.cat([x.A_log.reshape(-1) for x in layers]), m.A_log)
    assert torch.equal(torch.cat([x.dt_bias for x in layers]), m.w[PREFIX + "dt_bias"])


# --- 2-4. what the plugin reads, and a decode step per rank ----------------------------------------


class RankBackend:
    """The plugin's backend over one rank's pool (SGLang's HybridReqToTokenPool sized for H/tp heads);
    ``model`` (set on the runner before the backend is built) is what its startup scan sees, and
    ``runner_args`` go to the ``KDARunner`` (speculation, ReplaySSM)."""

    def __init__(self, num_heads: int, model=None, **runner_args):
        from sglang.srt.layers.attention import attention_registry

        self.runner = KDARunner(backend="dspark", num_heads=num_heads, pool_size=POOL, dtype=torch.float32,
                                **runner_args)
        if model is not None:
            self.runner.model = model
        full = attention_registry.ATTENTION_BACKENDS["dspark"](self.runner)
        self.hybrid = attention_registry.attn_backend_wrapper(self.runner, full)
        self.linear = self.hybrid.linear_attn_backend
        self.cache = self.runner.req_to_token_pool.mamba2_layer_cache(0)
        self.rpi = bind_requests(self.runner, NUM_REQ)
        self.slots = list(range(1, NUM_REQ + 1))

    def close(self):
        self.runner.close()

    def decode(self, layer, mixed_qkv, a, b):
        fb = make_forward_batch(self.runner, ForwardMode.DECODE, self.rpi, [1] * NUM_REQ)
        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.hybrid)):
            self.hybrid.init_forward_metadata(fb)
            return layer(fb, mixed_qkv=mixed_qkv, a=a, b=b)


def _projections(attn, case: Case, x: torch.Tensor):
    """The rank's KDA inputs from SGLang's own projection code, as its ``forward`` hands them to
    ``self.attn`` in DECODE mode: ``mixed_qkv [T, 3*H_r*128]``, ``a [T, H_r*128]``, ``b [1, T, H_r]``."""
    with torch.no_grad():
        if case.model == "kimi_linear":
            mixed_qkv, beta, forget_gate, _ = attn.forward_qkvbfg_fused(x)
        else:
            mixed_qkv, beta, forget_gate, _ = attn.forward_qkvbfg_fused(x, defer_f_b=False)
    return mixed_qkv, forget_gate, beta.unsqueeze(0)


def _full_inputs(w, x):
    """Unsharded float64 projections of the full layer (the independent oracle's inputs)."""
    x = x.double()
    lin = lambda t, name: t @ w[PREFIX + name + ".weight"].double().T  # noqa: E731
    q, k, v = (lin(x, n) for n in ("q_proj", "k_proj", "v_proj"))
    a = lin(lin(x, "f_a_proj"), "f_b_proj")
    b = lin(x, "b_proj")
    return q, k, v, a, b


@pytest.mark.parametrize("case,rank", RANKS)
def test_plugin_reads_the_ranks_shard(model, case, rank):
    m = model[case.name]
    attn, state_shape = m.ranks[rank]
    layer, Hr = attn.attn, case.local_heads
    # SGLang's per-rank pool geometry (read under the rank's scope) == the rank's layer
    assert tuple(state_shape.temporal) == (Hr, HEAD, HEAD)
    assert [tuple(c) for c in state_shape.conv] == [(3, 3 * Hr * HEAD)]
    setup = RankBackend(Hr)
    try:
        cache = setup.cache
        assert tuple(cache.temporal.shape[1:]) == tuple(state_shape.temporal)
        assert tuple(cache.conv[0].shape[1:]) == tuple(state_shape.conv[0])
        args = backend_mod._layer_state_args(layer, cache)
        assert args["conv_weight"] is layer.conv_weights
        assert args["A_log"] is layer.A_log and args["dt_bias"] is layer.dt_bias
        assert args["lower_bound"] == layer.lower_bound and args["scale"] == HEAD**-0.5
        assert args["ssm_state"] is cache.temporal and args["conv_state"] is cache.conv[0]

        x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(17 + rank))
        mixed_qkv, a, b = _projections(attn, case, x)
        assert setup.linear._fallback_reason(layer, mixed_qkv, cache, verify=False) is None
        q, k, v = split_mixed_qkv(mixed_qkv, layer.num_v_heads)
        assert q.shape == k.shape == v.shape == (1, 3, Hr, HEAD)
        fq, fk, fv, fa, fb = _full_inputs(m.w, x)
        rows = rank_rows(case, rank)
        for got, full in ((q, fq), (k, fk), (v, fv)):
            torch.testing.assert_close(got[0].flatten(1).double(), full[:, rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.double(), fa[:, rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b[0].double(), fb[:, rank_heads(case, rank)], rtol=1e-5, atol=1e-5)
    finally:
        setup.close()


@pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="CPU test: the layers and pools live on the CPU (as in test_backend.py), so the "
                    "kernels must run under TRITON_INTERPRET=1")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rank_decodes_concatenate_to_the_full_layer(model, case, monkeypatch):
    """One DECODE step of NUM_REQ requests on every rank through the plugin's backend; the float64
    reference decodes the unsharded layer from the full state, and each rank must produce its slice."""
    m = model[case.name]
    H, P = case.heads, case.heads * HEAD
    g = torch.Generator().manual_seed(1717)
    x = torch.randn(NUM_REQ, HIDDEN, generator=g)
    S0 = torch.randn(POOL + 1, H, HEAD, HEAD, generator=g) * 0.5  # full-layer state per slot
    C0 = torch.randn(POOL + 1, 3, 3 * P, generator=g)  # full conv windows, [q | k | v] channels
    slots = list(range(1, NUM_REQ + 1))

    fq, fk, fv, fa, fb = _full_inputs(m.w, x)
    S_ref, C_ref = S0.double(), C0.double()
    view = lambda t: t.view(1, NUM_REQ, H, HEAD)  # noqa: E731
    out_ref = decode_ref(
        view(fq), view(fk), view(fv), view(fa), fb.view(1, NUM_REQ, H),
        conv_weight=full_conv_weight(m.w).double(), A_log=m.A_log.double(), dt_bias=m.w[PREFIX + "dt_bias"].double(),
        lower_bound=-5.0 if case.model == "kimi_k3" else None,
        ssm_state=S_ref, conv_state=C_ref, slot_indices=torch.tensor(slots, dtype=torch.int32),
    )

    calls = []
    real_decode = backend_mod.decode

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(backend_mod, "decode", spy)
    for rank in range(case.tp):
        attn, _ = m.ranks[rank]
        layer, heads, chans = attn.attn, rank_heads(case, rank), rank_channels(case, rank)
        setup = RankBackend(case.local_heads)
        try:
            for s in slots:  # the rank's part of the full state
                setup.cache.temporal[s] = S0[s, heads]
                setup.cache.conv[0][s] = C0[s][:, chans]
            mixed_qkv, a, b = _projections(attn, case, x)
            n_calls = len(calls)
            out = setup.decode(layer, mixed_qkv, a, b)
            assert len(calls) == n_calls + 1, "the plugin's decode kernel did not run"
            assert calls[-1]["conv_weight"] is layer.conv_weights and calls[-1]["A_log"] is layer.A_log
            assert out.shape == (1, NUM_REQ, case.local_heads, HEAD)
            err = rel_err(out, out_ref[:, :, heads])
            assert err <= 1e-5, (rank, err)
            for s in slots:
                err = rel_err(setup.cache.temporal[s], S_ref[s, heads])
                assert err <= 1e-5, (rank, s, err)
                err = rel_err(setup.cache.conv[0][s], C_ref[s][:, chans])
                assert err <= 1e-6, (rank, s, err)
        finally:
            setup.close()


def test_dp_attention_falls_back_with_its_reason(model, caplog, monkeypatch):
    """Data-parallel attention (TP 2, attention-TP 1): SGLang shards Kimi-Linear's KDA layer over the
    TP group (16 heads on a rank) but sizes the state pool by the attention-TP group (32 heads).
    The plugin's kernels would read that pool with the layer's head count, so the backend hands the
    layer to SGLang (its per-forward check) and keeps the lazy record ring off at startup (its scan
    of the model's layers), each naming the mismatch; the same layer over a pool of its own head
    count takes the plugin's path."""
    import logging

    case = CASES[0]
    m = model[case.name]
    monkeypatch.setenv("SGLANG_DSPARK_LAZY_RECORDS", "1")
    attn, state_shape = build_rank(case, m.config, m.w, 0, scope=dp_attention_scope(0, case.tp))
    layer = attn.attn
    assert layer.num_v_heads == case.heads // case.tp  # the layer: a TP shard
    pool_heads = state_shape.temporal[0]
    assert pool_heads == case.heads  # the pool: the attention-TP group's (all heads)
    mismatch = (f"state pool for {pool_heads} heads / {3 * pool_heads * HEAD} conv channels, layer with "
                f"{layer.num_v_heads} heads / {3 * layer.num_v_heads * HEAD} channels")
    speculative = dict(num_draft_tokens=4, replayssm=True, disable_radix_cache=True)
    with caplog.at_level(logging.INFO, logger="sglang_dspark_plugin"):
        setup = RankBackend(pool_heads, model=nn.ModuleList([attn]), **speculative)
    try:
        assert setup.linear.record_cursor is None
        assert f"lazy record ring off: KDA layer 0 falls back to SGLang's path ({mismatch})" in caplog.text
        x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5))
        mixed_qkv, _, _ = _projections(attn, case, x)
        assert setup.linear._fallback_reason(layer, mixed_qkv, setup.cache, verify=False) == mismatch
        assert setup.linear._fallback_reason(layer, mixed_qkv, setup.cache, verify=True) == mismatch
    finally:
        setup.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sglang_dspark_plugin"):
        setup = RankBackend(layer.num_v_heads, model=nn.ModuleList([attn]), **speculative)
    try:  # the control: the pool of a plain TP rank
        assert setup.linear.record_cursor is not None, caplog.text
        assert setup.linear._fallback_reason(layer, mixed_qkv, setup.cache, verify=False) is None
    finally:
        setup.close()
