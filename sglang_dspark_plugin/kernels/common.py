"""Device helpers shared by every bundled kernel (recurrent and chunked verify, decode, fold).

Sharing them makes the kernels perform the same floating-point operations in the same order:
the recurrent fold reproduces the recurrent snapshot verify bit for bit under the same compiler,
and all kernels write the same ring / conv-window bytes.
"""

import triton
import triton.language as tl


@triton.jit
def _pdl_enter(USE_PDL: tl.constexpr):
    """Programmatic dependent launch (sm90+, see ``launch_config.pdl_kwargs``): wait until the
    previous kernel on the stream has finished and its memory is visible, then let the next
    kernel's grid launch. Every kernel calls it first, before touching memory."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _round_act(x, ACT_BF16: tl.constexpr):
    """Round fp32 to the nearest bf16 value (ties to even), returned as fp32, when ACT_BF16.

    Done with integer bit operations because the Triton interpreter's fp32 -> bf16 cast truncates
    (and its "rtne" mode mishandles the mantissa carry); the result is exactly representable, so
    a following ``.to(tl.bfloat16)`` is exact both compiled and interpreted.
    """
    if ACT_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _tf32_part(x):
    """``x`` with the 13 mantissa bits tf32 drops cleared: ``x = part + (x - part)`` exactly, and a
    tensor core reads ``part`` unchanged (the operands of a 3-pass tf32 product)."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _softplus(x):
    """torch.nn.functional.softplus(x, beta=1, threshold=20) in fp32, log1p-accurate for x << 0."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / d))  # log1p(e) (Goldberg's trick)
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _kda_gate(a, dtb, A, lower_bound, USE_LB: tl.constexpr):
    """Per-K log-decay g from the raw gate input ``a`` (fp32 [128]); ``A = exp(A_log[h])``."""
    x = a + dtb
    if USE_LB:
        g = lower_bound * _sigmoid(A * x)
    else:
        g = -A * _softplus(x)
    return g


@triton.jit
def _conv_silu(c0, c1, c2, x, w0, w1, w2, w3):
    """Width-4 causal conv (c0 oldest, x current) + SiLU, fp32 (the caller rounds to act dtype).

    The sum is an explicit FMA chain so that every kernel (and every compiled variant of a
    kernel) gets bit-identical conv outputs; left to the compiler, multiply-add contraction can
    differ between variants and flip the bf16 rounding of a few elements.
    """
    z = tl.fma(w3, x, tl.fma(w2, c2, tl.fma(w1, c1, w0 * c0)))
    return z / (1.0 + tl.exp(-z))


@triton.jit
def _l2norm(x):
    """x * rsqrt(sum(x^2) + 1e-6) over a 1-D block.

    The sum of squares is accumulated in fp64, which makes it independent of the reduction order
    (i.e. of the register layout the compiler picks for ``x`` in a given kernel), so verify
    (both modes), decode and the ReplaySSM fold normalise k identically.
    """
    xd = x.to(tl.float64)
    ss = tl.sum(xd * xd, axis=0) + 1e-6
    return x * tl.rsqrt(ss.to(tl.float32))


@triton.jit
def _delta_step(S, k, g, beta, v):
    """One gated delta-rule step on a [BV, 128] state tile (rows = V slice, cols = K).

    S <- S * exp(g)[None, :]; u = beta * (v - S k); S <- S + u k^T (explicit FMA).
    (The chunked ring verify, mtp_verify_chunked.py, replaces the per-step loop by tl.dot.)
    """
    S = S * tl.exp(g)[None, :]
    kv = tl.sum(S * k[None, :], axis=1)
    u = beta * (v - kv)
    return tl.fma(u[:, None], k[None, :], S)


@triton.jit
def _load_conv_window(cbase, ch, s_row):
    """The 3 previous conv inputs (row 0 oldest) of channels ``ch`` from a slot's conv state, fp32."""
    return (tl.load(cbase + ch).to(tl.float32), tl.load(cbase + s_row + ch).to(tl.float32),
            tl.load(cbase + 2 * s_row + ch).to(tl.float32))


@triton.jit
def _load_conv_weights(w_ptr, ch, s_w):
    base = w_ptr + ch.to(tl.int64) * s_w
    return (tl.load(base + 0), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3))


# ----------------------------------------------------------------------------------------------
# Lazy record ring (docs/design/lazy-record-ring.md): a slot's pool state is a checkpoint and ring rows
# [0, p) hold the records of the p accepted tokens since: corrected delta d [V] (fp32),
# key before normalisation (the rawk ring), the key norm's reciprocal rk (the beta ring) and
# log-gate g [K] (the g ring). The state after them is S0 o e^{G_p} + sum_s d_s (k_s o e^{G_p - G_{s+1}})^T.
# ----------------------------------------------------------------------------------------------

@triton.jit
def _lazy_cursor(cur_ptr, slot, ring_len, STEPS: tl.constexpr):
    """``(p, flush, base)``: the slot's pending records, whether this window flushes (it would
    not fit behind them: ``p + STEPS > L``) and the ring row of the window's first record."""
    p = tl.load(cur_ptr + slot)
    flush = p + STEPS > ring_len
    return p, flush, tl.where(flush, 0, p)


@triton.jit
def _carried_keys(rk_base, rg_base, rb_base, s_rk_t, s_rg_t, s_rb_t, offs_c, p, LP: tl.constexpr):
    """For channels ``offs_c`` of one (slot, head): the ``p`` pending records' keys carried to the
    current token, ``k_s o e^{G_p - G_{s+1}}`` (``[LP, C]`` fp32, zero rows from ``p`` on), and the
    checkpoint's decay ``e^{G_p}`` (``[C]``). ``k_s = rawk_s * rk_s``: the record keeps the key
    before normalisation (exact in the activation dtype) and the norm's reciprocal."""
    offs_l = tl.arange(0, LP)
    pend = offs_l < p
    g = tl.load(rg_base + offs_l[:, None] * s_rg_t + offs_c[None, :], mask=pend[:, None], other=0.0)
    k = tl.load(rk_base + offs_l[:, None] * s_rk_t + offs_c[None, :], mask=pend[:, None], other=0.0)
    rk = tl.load(rb_base + offs_l * s_rb_t, mask=pend, other=0.0)
    G = tl.sum(g, axis=0)
    carried = tl.where(pend[:, None], k.to(tl.float32) * rk[:, None] * tl.exp(G[None, :] - tl.cumsum(g, axis=0)), 0.0)
    return carried, tl.exp(G)


@triton.jit
def _store_delta(hi_ptr, lo_ptr, offs, d, mask, SPLIT: tl.constexpr):
    """Store fp32 corrected deltas ``d``: into one fp32 ring, or (``SPLIT``) as the high and low
    16 bits of each value into two 16-bit rings (lossless: SGLang's bf16 ``replayssm_d`` /
    ``replayssm_k``, unused under the speculative ring)."""
    if SPLIT:
        bits = d.to(tl.int32, bitcast=True)
        tl.store(hi_ptr + offs, (bits >> 16).to(tl.int16), mask=mask)
        tl.store(lo_ptr + offs, (bits & 0xFFFF).to(tl.int16), mask=mask)
    else:
        tl.store(hi_ptr + offs, d, mask=mask)


@triton.jit
def _load_delta(hi_ptr, lo_ptr, offs, mask, SPLIT: tl.constexpr):
    """Inverse of :func:`_store_delta`: fp32 deltas, 0 where masked."""
    if SPLIT:
        hi = tl.load(hi_ptr + offs, mask=mask, other=0).to(tl.int32)
        lo = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
        d = ((hi << 16) | lo).to(tl.float32, bitcast=True)
    else:
        d = tl.load(hi_ptr + offs, mask=mask, other=0.0)
    return d


# ----------------------------------------------------------------------------------------------
# Output gate (Kimi-K3's o_norm, fused into the epilogue of verify and decode)
# ----------------------------------------------------------------------------------------------

@triton.jit
def _gated_rms_norm(x, gate, w, eps):
    """K3's output norm on rows ``x [R, 128]``: SGLang's ``FusedRMSNormGated`` with the sigmoid
    gate, in its order of operations: ``((x * rstd) * w) * sigmoid(gate)`` with
    ``rstd = 1 / sqrt(sum(x^2) / 128 + eps)``, all fp32. ``x`` holds the attention output as the
    model would see it (already rounded to the activation dtype)."""
    var = tl.sum(x * x, axis=1) / 128
    rstd = 1 / tl.sqrt(var + eps)
    return x * rstd[:, None] * w[None, :] * tl.sigmoid(gate)


@triton.jit
def _apply_output_gate(o_ptr, s_o_t, g_ptr, s_g_t, w_ptr, eps, n_tok, TR: tl.constexpr, ACT_BF16: tl.constexpr):
    """Replace the ``n_tok`` (<= ``TR``) output rows of one (request, head) at ``o_ptr`` (row
    stride ``s_o_t``, 128 channels) by their gated RMS norm; the gate rows at ``g_ptr``
    (stride ``s_g_t``), the norm weight (``[128]``, fp32 or bf16) at ``w_ptr``. The rows are
    read through L2 (``.cg``): other programs of the launch may have written them."""
    offs_t = tl.arange(0, TR)
    offs_c = tl.arange(0, 128)
    m = (offs_t < n_tok)[:, None]
    rows = offs_t.to(tl.int64)[:, None]
    x = tl.load(o_ptr + rows * s_o_t + offs_c[None, :], mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    gate = tl.load(g_ptr + rows * s_g_t + offs_c[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_c).to(tl.float32)
    y = _gated_rms_norm(x, gate, w, eps)
    tl.store(o_ptr + rows * s_o_t + offs_c[None, :], _round_act(y, ACT_BF16).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _last_tile_of_head(cnt_ptr, NVT: tl.constexpr):
    """True in exactly one of the ``NVT`` programs that share the counter at ``cnt_ptr`` (the
    V-tiles of one (request, head)): the last to arrive, after every program's earlier stores
    are visible to it. It resets the counter to 0 for the next launch (CUDA-graph replays
    included). The barrier orders the whole program's stores before its arrival (a release at
    GPU scope); the arrival's acquire orders the winner's later loads after them."""
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == NVT - 1
    if last:
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
    return last
