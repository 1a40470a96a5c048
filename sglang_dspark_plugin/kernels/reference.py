"""Plain PyTorch references for the KDA kernels: the test oracle.

The functions take exactly the arguments of the Triton wrappers (same layouts, same in-place
semantics) and work in any dtype, float64 included. All arithmetic runs in ``compute_dtype``
(float64 by default); results are cast to the dtype of the tensor they are written into, so a
caller that wants a float64 trajectory passes float64 state/conv/ring tensors.

Math per (request, head), token t (K = V = 128; D = 3*H*128 channels laid out [q | k | v]):

* conv window (c0 oldest, c1, c2) + current input x:
  ``y = SiLU(w0*c0 + w1*c1 + w2*c2 + w3*x)``, rounded to the activation dtype ``act_dtype``
  (default: the dtype of ``q``), then ``(c0, c1, c2) <- (c1, c2, x)``;
* ``q = y_q * rsqrt(sum(y_q^2) + 1e-6) * scale``, ``k = y_k * rsqrt(sum(y_k^2) + 1e-6)``, ``v = y_v``;
* ``beta = sigmoid(b)``;
* ``g = lower_bound * sigmoid(exp(A_log) * (a + dt_bias))`` if ``lower_bound`` is not None,
  else ``g = -exp(A_log) * softplus(a + dt_bias)`` (threshold 20);
* ``S <- S * exp(g)[None, :]``; ``u = beta * (v - S k)``; ``S <- S + u k^T``; ``o = S q``
  with ``S`` stored ``[V, K]``;
* with an output gate (Kimi-K3's ``o_norm``): ``o`` rounded to the activation dtype, then
  ``o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate)``.

Indices are read with ``.tolist()`` here; that is fine for an oracle, never for the kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..settings import HEAD_DIM

L2_EPS = 1e-6


def default_scale() -> float:
    return HEAD_DIM ** -0.5


# ----------------------------------------------------------------------------------------------
# Building blocks (tensors already in the compute dtype; any leading batch dims)
# ----------------------------------------------------------------------------------------------

def conv_silu_step(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, act_dtype: torch.dtype):
    """One width-4 causal conv step + SiLU.

    window ``[..., 3, C]`` (row 0 oldest), x ``[..., C]``, weight ``[C, 4]``.
    Returns ``(y, new_window)``; ``y`` is rounded to ``act_dtype`` and returned in the compute dtype.
    """
    z = (weight[:, 0] * window[..., 0, :] + weight[:, 1] * window[..., 1, :]
         + weight[:, 2] * window[..., 2, :] + weight[:, 3] * x)
    y = F.silu(z).to(act_dtype).to(window.dtype)
    new_window = torch.cat([window[..., 1:, :], x[..., None, :]], dim=-2)
    return y, new_window


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + 1e-6)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def kda_gate(a: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: Optional[float]):
    """Per-K log-decay. a ``[..., H, 128]``, dt_bias ``[H, 128]``, A_log ``[H]`` -> g ``[..., H, 128]``."""
    A = torch.exp(A_log)[:, None]
    x = a + dt_bias
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(A * x)
    return -A * F.softplus(x, beta=1.0, threshold=20.0)


def delta_step_with_delta(S: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor):
    """One gated delta-rule step and its corrected delta ``u`` ``[..., V]`` (what a decode-ring
    row keeps). S ``[..., V, K]``, k/g ``[..., K]``, beta ``[...]``, v ``[..., V]``."""
    S = S * torch.exp(g)[..., None, :]
    u = beta[..., None] * (v - torch.einsum("...vk,...k->...v", S, k))
    return S + u[..., :, None] * k[..., None, :], u


def delta_step(S: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor):
    """One gated delta-rule step. S ``[..., V, K]``, k/g ``[..., K]``, beta ``[...]``, v ``[..., V]``."""
    return delta_step_with_delta(S, k, g, beta, v)[0]


def readout(S: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``o = S q``: S ``[..., V, K]``, q ``[..., K]`` -> ``[..., V]``."""
    return torch.einsum("...vk,...k->...v", S, q)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Kimi-K3's output norm (SGLang's ``FusedRMSNormGated``, sigmoid gate) over the last dim:
    ``o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate)``. ``o`` is the attention output as the
    model sees it (rounded to the activation dtype); everything in ``o``'s dtype."""
    rstd = torch.rsqrt((o * o).mean(-1, keepdim=True) + eps)
    return o * rstd * weight.to(o.dtype) * torch.sigmoid(gate.to(o.dtype))


def _gated_output(o, tok, output_gate, output_norm_weight, output_norm_eps, act_dtype):
    """The output rows ``o [n, H, 128]`` of tokens ``tok`` as written: as is, or through the
    output gate (``o`` first rounded to the activation dtype, as the model receives it)."""
    if output_gate is None:
        return o
    o = o.to(act_dtype).to(o.dtype)
    return gated_rms_norm(o, output_gate[0, tok].to(o.dtype), output_norm_weight, output_norm_eps)


class _Token:
    """Projections of one token per request (leading dims ``[...]``, all heads), compute dtype.

    window ``[..., 3, D]``, x_cat ``[..., D]`` (q | k | v channels), a_t ``[..., H, 128]``, b_t ``[..., H]``.
    """

    def __init__(self, window, x_cat, a_t, b_t, *, weight, A_log, dt_bias, lower_bound, scale, act_dtype, H):
        y, self.window = conv_silu_step(window, x_cat, weight, act_dtype)
        lead = y.shape[:-1]
        yq, yk, yv = (t.reshape(*lead, H, HEAD_DIM) for t in y.split(H * HEAD_DIM, dim=-1))
        self.rawk = yk
        self.rawv = yv
        self.q = l2norm(yq) * scale
        self.k = l2norm(yk)
        self.g = kda_gate(a_t, dt_bias, A_log, lower_bound)
        self.beta = torch.sigmoid(b_t)


def _prep(conv_weight, A_log, dt_bias, H, cd):
    return conv_weight.to(cd), A_log.reshape(-1).to(cd), dt_bias.reshape(H, HEAD_DIM).to(cd)


def _token_inputs(q, k, v, a, b, tok, cd):
    """Inputs of tokens ``tok`` (an index tensor ``[n]`` or an int) as ``x [.., D]``, ``a [.., H, 128]``, ``b [.., H]``."""
    lead = q[0, tok].shape[:-2]
    x = torch.cat([t[0, tok].reshape(*lead, -1) for t in (q, k, v)], dim=-1).to(cd)
    return x, a[0, tok].to(cd), b[0, tok].to(cd)


# ----------------------------------------------------------------------------------------------
# References of the three kernels (vectorised over requests; steps run in lock-step and a
# request simply stops being written once its step count is exhausted)
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def mtp_verify_ref(q, k, v, a, b, *, conv_weight, A_log, dt_bias, lower_bound, ssm_state, conv_state,
                   slot_indices, cu_seqlens, num_spec, intermediate_conv, intermediate_rows,
                   intermediate_ssm=None, ring_rawv=None, ring_rawk=None, ring_g=None, ring_beta=None,
                   scale=None, out=None, act_dtype=None, compute_dtype=torch.float64,
                   output_gate=None, output_norm_weight=None, output_norm_eps=None):
    """Reference of :func:`sglang_dspark_plugin.kernels.mtp_verify` (same arguments and writes).

    ``ssm_state`` / ``conv_state`` are read only; writes go to ``out``, ``intermediate_conv``,
    ``intermediate_ssm`` (snapshot mode) and/or the rings (both may be given here). Output rows of
    slot -1 requests and rows not covered by ``cu_seqlens`` are zero.
    """
    cd = compute_dtype
    T, H = q.shape[1], q.shape[2]
    steps = 1 + num_spec
    act_dtype = act_dtype or q.dtype
    scale = default_scale() if scale is None else scale
    w, A_log_c, dt_c = _prep(conv_weight, A_log, dt_bias, H, cd)
    if out is None:
        out = torch.empty(1, T, H, HEAD_DIM, dtype=q.dtype, device=q.device)
    out.zero_()
    dev = q.device
    slots = slot_indices.long().to(dev)
    cu = cu_seqlens.long().to(dev)
    rows = intermediate_rows.long().to(dev)
    live = (slots >= 0).nonzero().flatten()  # requests that are not padding
    if live.numel() == 0:
        return out
    slots, rows, bos = slots[live], rows[live], cu[live]
    lens = (cu[live + 1] - bos).clamp(max=steps)
    S = ssm_state[slots].to(cd)  # [n, H, V, K]
    window = conv_state[slots].to(cd)  # [n, 3, D]
    for t in range(steps):
        act = (t < lens).nonzero().flatten()  # requests with a token at step t
        if act.numel() == 0:
            break
        tok = (bos + t).clamp(max=max(T - 1, 0))
        x, a_t, b_t = _token_inputs(q, k, v, a, b, tok, cd)
        tk = _Token(window, x, a_t, b_t, weight=w, A_log=A_log_c, dt_bias=dt_c, lower_bound=lower_bound,
                    scale=scale, act_dtype=act_dtype, H=H)
        window = tk.window
        S = delta_step(S, tk.k, tk.g, tk.beta, tk.rawv)
        o = _gated_output(readout(S, tk.q)[act], tok[act], output_gate, output_norm_weight, output_norm_eps,
                          act_dtype)
        out[0, tok[act]] = o.to(out.dtype)
        intermediate_conv[rows[act], t] = window[act].to(intermediate_conv.dtype)
        if intermediate_ssm is not None:
            intermediate_ssm[rows[act], t] = S[act].to(intermediate_ssm.dtype)
        if ring_rawv is not None:
            ring_rawv[slots[act], :, t] = tk.rawv[act].to(ring_rawv.dtype)
            ring_rawk[slots[act], :, t] = tk.rawk[act].to(ring_rawk.dtype)
            ring_g[slots[act], :, t] = tk.g[act].to(ring_g.dtype)
            ring_beta[slots[act], :, t] = tk.beta[act].to(ring_beta.dtype)
    return out


@torch.no_grad()
def decode_ref(q, k, v, a, b, *, conv_weight, A_log, dt_bias, lower_bound, ssm_state, conv_state,
               slot_indices, scale=None, out=None, act_dtype=None, compute_dtype=torch.float64,
               output_gate=None, output_norm_weight=None, output_norm_eps=None):
    """Reference of :func:`sglang_dspark_plugin.kernels.decode`: one token per request, conv and
    recurrent state updated in place; slot -1 rows untouched with zero output."""
    cd = compute_dtype
    T, H = q.shape[1], q.shape[2]
    act_dtype = act_dtype or q.dtype
    scale = default_scale() if scale is None else scale
    w, A_log_c, dt_c = _prep(conv_weight, A_log, dt_bias, H, cd)
    if out is None:
        out = torch.empty(1, T, H, HEAD_DIM, dtype=q.dtype, device=q.device)
    out.zero_()
    slots = slot_indices.long().to(q.device)
    live = (slots >= 0).nonzero().flatten()
    if live.numel() == 0:
        return out
    slots = slots[live]
    x, a_t, b_t = _token_inputs(q, k, v, a, b, live, cd)
    tk = _Token(conv_state[slots].to(cd), x, a_t, b_t, weight=w, A_log=A_log_c, dt_bias=dt_c,
                lower_bound=lower_bound, scale=scale, act_dtype=act_dtype, H=H)
    S = delta_step(ssm_state[slots].to(cd), tk.k, tk.g, tk.beta, tk.rawv)
    o = _gated_output(readout(S, tk.q), live, output_gate, output_norm_weight, output_norm_eps, act_dtype)
    out[0, live] = o.to(out.dtype)
    ssm_state[slots] = S.to(ssm_state.dtype)
    conv_state[slots] = tk.window.to(conv_state.dtype)
    return out


@torch.no_grad()
def replayssm_fold_ref(ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta, slot_indices, accept_lens, *,
                       conv_state=None, intermediate_conv=None, intermediate_rows=None,
                       track_slot_indices=None, track_steps=None, scale=None, compute_dtype=torch.float64):
    """Reference of :func:`sglang_dspark_plugin.kernels.replayssm_fold` (in place).

    Accepts the all-layer layout (``ssm_state [layers, slots, H, 128, 128]``) or the single-layer one
    (``[slots, H, 128, 128]``, rings ``[slots, H, L, ...]``, conv ``[slots, 3, D]``,
    intermediate_conv ``[rows, steps, 3, D]``).
    """
    del scale
    cd = compute_dtype
    if ssm_state.dim() == 4:
        ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta = (
            t.unsqueeze(0) for t in (ssm_state, ring_rawv, ring_rawk, ring_g, ring_beta))
        if conv_state is not None:
            conv_state, intermediate_conv = conv_state.unsqueeze(0), intermediate_conv.unsqueeze(0)
    L = ring_rawv.shape[-2]
    dev = ssm_state.device
    slots = slot_indices.long().to(dev)
    acc = accept_lens.long().to(dev).clamp(max=L)
    live = ((slots >= 0) & (acc > 0)).nonzero().flatten()
    if live.numel() == 0:
        return ssm_state
    slots, acc = slots[live], acc[live]
    track = track_steps is not None
    if track:
        tslots = track_slot_indices.long().to(dev)[live]
        tsteps = track_steps.long().to(dev)[live]
    for layer in range(ssm_state.shape[0]):
        S = ssm_state[layer, slots].to(cd)  # [n, H, V, K]
        for t in range(int(acc.max())):
            act = (t < acc).nonzero().flatten()
            sl = slots[act]
            k = l2norm(ring_rawk[layer, sl, :, t].to(cd))
            S[act] = delta_step(S[act], k, ring_g[layer, sl, :, t].to(cd), ring_beta[layer, sl, :, t].to(cd),
                                ring_rawv[layer, sl, :, t].to(cd))
            if track:
                snap = ((tsteps == t) & (tslots >= 0) & (t < acc)).nonzero().flatten()
                ssm_state[layer, tslots[snap]] = S[snap].to(ssm_state.dtype)
        ssm_state[layer, slots] = S.to(ssm_state.dtype)
        if conv_state is not None:
            rows = intermediate_rows.long().to(dev)[live]
            conv_state[layer, slots] = intermediate_conv[layer, rows, acc - 1].to(conv_state.dtype)
    return ssm_state


@torch.no_grad()
def sequential_ref(q, k, v, a, b, *, conv_weight, A_log, dt_bias, lower_bound, state, window, scale=None,
                   act_dtype=None, compute_dtype=torch.float64):
    """Run T tokens of ONE request sequentially from ``state [H, 128, 128]`` and ``window [3, D]``.

    Returns ``(out [T, H, 128], state, window)`` in the compute dtype. Used to check multi-cycle
    verify/fold trajectories against an uninterrupted float64 run.
    """
    cd = compute_dtype
    T, H = q.shape[1], q.shape[2]
    act_dtype = act_dtype or q.dtype
    scale = default_scale() if scale is None else scale
    w, A_log_c, dt_c = _prep(conv_weight, A_log, dt_bias, H, cd)
    S = state.to(cd)
    win = window.to(cd)
    outs = []
    for t in range(T):
        x, a_t, b_t = _token_inputs(q, k, v, a, b, t, cd)
        tk = _Token(win, x, a_t, b_t, weight=w, A_log=A_log_c, dt_bias=dt_c, lower_bound=lower_bound,
                    scale=scale, act_dtype=act_dtype, H=H)
        win = tk.window
        S = delta_step(S, tk.k, tk.g, tk.beta, tk.rawv)
        outs.append(readout(S, tk.q))
    return torch.stack(outs), S, win


@torch.no_grad()
def copy_conv_windows_ref(conv_state, intermediate_conv, slot_indices, intermediate_rows, steps):
    """Reference of :func:`sglang_dspark_plugin.kernels.conv_window.copy_conv_windows` (in place)."""
    for slot, row, step in zip(slot_indices.tolist(), intermediate_rows.tolist(), steps.tolist()):
        if slot >= 0 and step >= 0:
            conv_state[:, slot] = intermediate_conv[:, row, step]
    return conv_state


@torch.no_grad()
def buffered_decode_state_ref(ssm_state, ring_d, ring_k, ring_g, slot, rows: int, compute_dtype=torch.float64):
    """The state SGLang's decode ring implies for ``slot`` (``--enable-linear-replayssm``): the
    checkpoint ``ssm_state[slot]`` ``[H, V, K]`` carried over the ``rows`` buffered tokens, whose
    ring rows hold the corrected delta ``d`` ``[H, V]``, normalised key ``k`` and log-gate ``g``
    ``[H, K]``: step by step ``S <- S * exp(g)[K] + d k^T`` (the delta rule with ``d`` already
    corrected). Returns ``[H, V, K]`` in ``compute_dtype``."""
    S = ssm_state[slot].to(compute_dtype)
    for j in range(rows):
        d = ring_d[slot, :, j].to(compute_dtype)
        k = ring_k[slot, :, j].to(compute_dtype)
        g = ring_g[slot, :, j].to(compute_dtype)
        S = S * torch.exp(g)[:, None, :] + d[:, :, None] * k[:, None, :]
    return S


# ----------------------------------------------------------------------------------------------
# Lazy record ring (docs/design/lazy-record-ring.md): the protocol's oracle. The kernels
# (mtp_verify with record_cursor, record_ring) implement it with the key kept as rawk and its norm's
# reciprocal; these references take the processed per-token quantities of the math above
# (normalised k, scaled q, log-decay g, beta), not raw projections: the protocol concerns only how
# the recurrent state is kept.
# ----------------------------------------------------------------------------------------------

def lazy_verify_ref(ssm_state, ring_d, ring_k, ring_g, cursor, slot: int, q, k, v, g, beta,
                    compute_dtype=torch.float64):
    """Verify one request's window of ``T`` draft tokens from its lazily kept state, appending the
    window's records; returns the outputs ``[T, H, V]``.

    ``ssm_state[slot]`` ``[H, V, K]`` is the checkpoint, ``cursor[slot]`` = ``p`` the ring rows
    ``[0, p)`` (records of accepted tokens, the decode ring's format: corrected delta ``d``, key
    ``k``, log-gate ``g``; rings ``[slots, H, L, V or K]``) not yet folded into it. The current
    state is the checkpoint carried over those rows (:func:`buffered_decode_state_ref`: a sum of
    rank-1 terms, one ``tl.dot`` in a kernel, no recurrence). If the window does not fit behind them
    (``p + T > L``) the current state is written to the checkpoint first and ``p`` restarts at 0
    (the flush; the only full-state write). Token ``t``'s record goes to row ``p + t``: after
    :func:`lazy_commit_ref` accepts ``a`` tokens, rows ``[p, p + a)`` are exactly the accepted
    tokens' records, because an accepted draft token's state path is the verified one.

    q, k, g: ``[T, H, K]``; v: ``[T, H, V]``; beta: ``[T, H]``."""
    cd = compute_dtype
    L = ring_d.shape[2]
    T = q.shape[0]
    p = int(cursor[slot])
    S = buffered_decode_state_ref(ssm_state, ring_d, ring_k, ring_g, slot, p, compute_dtype=cd)
    if p + T > L:  # flush: materialise, empty the ring
        ssm_state[slot] = S.to(ssm_state.dtype)
        cursor[slot] = p = 0
    out = torch.empty(T, *v.shape[1:], dtype=cd, device=v.device)
    for t in range(T):
        S, d = delta_step_with_delta(S, k[t].to(cd), g[t].to(cd), beta[t].to(cd), v[t].to(cd))
        out[t] = readout(S, q[t].to(cd))
        ring_d[slot, :, p + t] = d.to(ring_d.dtype)
        ring_k[slot, :, p + t] = k[t].to(ring_k.dtype)
        ring_g[slot, :, p + t] = g[t].to(ring_g.dtype)
    return out


def lazy_commit_ref(cursor, slot: int, accept_len: int) -> None:
    """Commit ``accept_len`` verified tokens (``1..T``): only the cursor moves; the state, the
    checkpoint and the ring rows stay as the verify left them."""
    cursor[slot] += accept_len


def _deltas(ring_delta) -> torch.Tensor:
    """The lazy ring's fp32 deltas from one fp32 ring or a (high, low) pair of 16-bit rings."""
    if not isinstance(ring_delta, (tuple, list)):
        return ring_delta
    hi, lo = (t.view(torch.int16).to(torch.int32) for t in ring_delta)
    return ((hi << 16) | (lo & 0xFFFF)).view(torch.float32)


@torch.no_grad()
def materialize_records_ref(ssm_state, ring_rawk, ring_g, ring_beta, ring_delta, src_slots, counts, dst_slots,
                            compute_dtype=torch.float64):
    """Reference of :func:`sglang_dspark_plugin.kernels.record_ring.materialize_records` (in place,
    all-layer tensors): per row, ``ssm_state[:, dst]`` = ``ssm_state[:, src]`` carried over the first
    ``count`` records, step by step as :func:`buffered_decode_state_ref` with the key
    ``rawk * rk`` (``rk`` in ``ring_beta``)."""
    d_all = _deltas(ring_delta)
    keys = ring_rawk.to(compute_dtype) * ring_beta.to(compute_dtype)[..., None]
    for src, cnt, dst in zip(src_slots.tolist(), counts.tolist(), dst_slots.tolist()):
        if src < 0 or dst < 0:
            continue
        S = torch.stack([buffered_decode_state_ref(ssm_state[layer], d_all[layer], keys[layer], ring_g[layer], src,
                                                   cnt, compute_dtype=compute_dtype)
                         for layer in range(ssm_state.shape[0])])
        ssm_state[:, dst] = S.to(ssm_state.dtype)
    return ssm_state
