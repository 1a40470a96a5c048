"""Plain PyTorch references for the three KDA kernels: the test oracle.

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
  with ``S`` stored ``[V, K]``.

Indices are read with ``.tolist()`` here; that is fine for an oracle, never for the kernels.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

HEAD_DIM = 128
L2_EPS = 1e-6


def default_scale() -> float:
    return HEAD_DIM ** -0.5


# ----------------------------------------------------------------------------------------------
# Building blocks (all operate on tensors already in the compute dtype)
# ----------------------------------------------------------------------------------------------

def conv_silu_step(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, act_dtype: torch.dtype):
    """One width-4 causal conv step + SiLU.

    window ``[3, C]`` (row 0 oldest), x ``[C]``, weight ``[C, 4]``, all in the compute dtype.
    Returns ``(y, new_window)``; ``y`` is rounded to ``act_dtype`` and returned in the compute dtype.
    """
    z = weight[:, 0] * window[0] + weight[:, 1] * window[1] + weight[:, 2] * window[2] + weight[:, 3] * x
    y = F.silu(z).to(act_dtype).to(window.dtype)
    new_window = torch.cat([window[1:], x[None]], dim=0)
    return y, new_window


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + 1e-6)`` over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def kda_gate(a: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: Optional[float]):
    """Per-K log-decay. a ``[H, 128]``, dt_bias ``[H, 128]``, A_log ``[H]`` -> g ``[H, 128]``."""
    A = torch.exp(A_log)[:, None]
    x = a + dt_bias
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(A * x)
    return -A * F.softplus(x, beta=1.0, threshold=20.0)


def delta_step(S: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor):
    """One gated delta-rule step. S ``[H, V, K]``, k/g ``[H, K]``, beta ``[H]``, v ``[H, V]``."""
    S = S * torch.exp(g)[:, None, :]
    u = beta[:, None] * (v - torch.einsum("hvk,hk->hv", S, k))
    return S + u[:, :, None] * k[:, None, :]


def readout(S: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.einsum("hvk,hk->hv", S, q)


class _Token:
    """Per-token projections of one request's token (all heads), in the compute dtype."""

    def __init__(self, window, x_cat, a_t, b_t, *, weight, A_log, dt_bias, lower_bound, scale, act_dtype, H):
        y, self.window = conv_silu_step(window, x_cat, weight, act_dtype)
        yq, yk, yv = y.split(H * HEAD_DIM)
        self.rawk = yk.view(H, HEAD_DIM)
        self.rawv = yv.view(H, HEAD_DIM)
        self.q = l2norm(yq.view(H, HEAD_DIM)) * scale
        self.k = l2norm(self.rawk)
        self.g = kda_gate(a_t, dt_bias, A_log, lower_bound)
        self.beta = torch.sigmoid(b_t)


def _prep(conv_weight, A_log, dt_bias, H, cd):
    return conv_weight.to(cd), A_log.reshape(-1).to(cd), dt_bias.reshape(H, HEAD_DIM).to(cd)


def _token_inputs(q, k, v, a, b, tok, cd):
    x = torch.cat([q[0, tok].reshape(-1), k[0, tok].reshape(-1), v[0, tok].reshape(-1)]).to(cd)
    return x, a[0, tok].to(cd), b[0, tok].to(cd)


# ----------------------------------------------------------------------------------------------
# References of the three kernels
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def mtp_verify_ref(q, k, v, a, b, *, conv_weight, A_log, dt_bias, lower_bound, ssm_state, conv_state,
                   slot_indices, cu_seqlens, num_spec, intermediate_conv, intermediate_rows,
                   intermediate_ssm=None, ring_rawv=None, ring_rawk=None, ring_g=None, ring_beta=None,
                   scale=None, out=None, act_dtype=None, compute_dtype=torch.float64):
    """Reference of :func:`sglang_dspark_plugin.kernels.mtp_verify` (same arguments and writes).

    ``ssm_state`` / ``conv_state`` are read only; writes go to ``out``, ``intermediate_conv``,
    ``intermediate_ssm`` (snapshot mode) or the rings (ring mode). Output rows of slot -1 requests
    and rows not covered by ``cu_seqlens`` are zero.
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
    slots = slot_indices.tolist()
    cu = cu_seqlens.tolist()
    rows = intermediate_rows.tolist()
    for n, slot in enumerate(slots):
        if slot < 0:
            continue
        bos, eos = cu[n], cu[n + 1]
        n_tok = min(eos - bos, steps)
        S = ssm_state[slot].to(cd)
        window = conv_state[slot].to(cd)
        row = rows[n]
        for t in range(n_tok):
            x, a_t, b_t = _token_inputs(q, k, v, a, b, bos + t, cd)
            tk = _Token(window, x, a_t, b_t, weight=w, A_log=A_log_c, dt_bias=dt_c, lower_bound=lower_bound,
                        scale=scale, act_dtype=act_dtype, H=H)
            window = tk.window
            S = delta_step(S, tk.k, tk.g, tk.beta, tk.rawv)
            out[0, bos + t] = readout(S, tk.q).to(out.dtype)
            intermediate_conv[row, t] = window.to(intermediate_conv.dtype)
            if intermediate_ssm is not None:
                intermediate_ssm[row, t] = S.to(intermediate_ssm.dtype)
            if ring_rawv is not None:
                ring_rawv[slot, :, t] = tk.rawv.to(ring_rawv.dtype)
                ring_rawk[slot, :, t] = tk.rawk.to(ring_rawk.dtype)
                ring_g[slot, :, t] = tk.g.to(ring_g.dtype)
                ring_beta[slot, :, t] = tk.beta.to(ring_beta.dtype)
    return out


@torch.no_grad()
def decode_ref(q, k, v, a, b, *, conv_weight, A_log, dt_bias, lower_bound, ssm_state, conv_state,
               slot_indices, scale=None, out=None, act_dtype=None, compute_dtype=torch.float64):
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
    for n, slot in enumerate(slot_indices.tolist()):
        if slot < 0:
            continue
        x, a_t, b_t = _token_inputs(q, k, v, a, b, n, cd)
        tk = _Token(conv_state[slot].to(cd), x, a_t, b_t, weight=w, A_log=A_log_c, dt_bias=dt_c,
                    lower_bound=lower_bound, scale=scale, act_dtype=act_dtype, H=H)
        S = delta_step(ssm_state[slot].to(cd), tk.k, tk.g, tk.beta, tk.rawv)
        out[0, n] = readout(S, tk.q).to(out.dtype)
        ssm_state[slot] = S.to(ssm_state.dtype)
        conv_state[slot] = tk.window.to(conv_state.dtype)
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
    layers = ssm_state.shape[0]
    L = ring_rawv.shape[-2]
    slots = slot_indices.tolist()
    accs = accept_lens.tolist()
    rows = intermediate_rows.tolist() if intermediate_rows is not None else None
    tslots = track_slot_indices.tolist() if track_slot_indices is not None else None
    tsteps = track_steps.tolist() if track_steps is not None else None
    for layer in range(layers):
        for n, (slot, acc) in enumerate(zip(slots, accs)):
            if slot < 0 or acc <= 0:
                continue
            acc = min(acc, L)
            S = ssm_state[layer, slot].to(cd)
            for t in range(acc):
                k = l2norm(ring_rawk[layer, slot, :, t].to(cd))
                S = delta_step(S, k, ring_g[layer, slot, :, t].to(cd), ring_beta[layer, slot, :, t].to(cd),
                               ring_rawv[layer, slot, :, t].to(cd))
                if tsteps is not None and tsteps[n] == t and tslots[n] >= 0:
                    ssm_state[layer, tslots[n]] = S.to(ssm_state.dtype)
            ssm_state[layer, slot] = S.to(ssm_state.dtype)
            if conv_state is not None:
                conv_state[layer, slot] = intermediate_conv[layer, rows[n], acc - 1].to(conv_state.dtype)
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
