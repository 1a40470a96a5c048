"""Input builders and comparison helpers for the kernel tests (and benchmarks/check_kernels_gpu.py).

Realistic scales: q/k/v/a/b ~ randn, A_log ~ log(U(1, 16)), dt_bias ~ 0.1*randn,
conv weights ~ U(-0.5, 0.5) (PyTorch's conv1d init for width 4), state ~ 0.5*randn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_dspark_plugin.settings import HEAD_DIM as HEAD

F64 = torch.float64


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(x: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 25) -> float:
    """||x - ref|| / ||ref|| in float64 (the absolute error when ref is 0); chunked to bound memory."""
    x = x.reshape(-1)
    ref = ref.reshape(-1)
    num = den = 0.0
    for i in range(0, x.numel(), chunk):
        xs, rs = x[i:i + chunk].to(F64), ref[i:i + chunk].to(F64)
        num += float(((xs - rs) ** 2).sum())
        den += float((rs ** 2).sum())
    num, den = num ** 0.5, den ** 0.5
    return num if den == 0.0 else num / den


# Bounds (norm-wise relative error against the float64 reference; docs/testing.md, "Bounds"), the
# same on every device:
OUT_TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8}
STATE_TOL = 1e-5


def tol(dtype: torch.dtype) -> float:
    """Bound on outputs: 1e-5 in fp32; in bf16 the unit roundoff 2^-8, since the kernel rounds its
    outputs to bf16 and the reference does not (measured 1.6-1.8e-3, the 2^-9 of uniform
    rounding). An output off by a factor 1.007 measures 7e-3 and fails."""
    return OUT_TOL[dtype]


def state_tol(dtype: torch.dtype) -> float:
    """Bound on the fp32 recurrent state (and the rings of fp32 values), both activation dtypes,
    on CPU and CUDA: 1e-5. Kernel and reference both round the conv outputs to the activation
    dtype, so the state carries only fp32 arithmetic (measured <= 1.3e-7 on CPU); a kernel that
    leaves one conv output unrounded measures 1e-4 to 9e-4. A conv output whose fp32 and float64
    values round to different bf16 neighbours would move its head's state by ~1e-4 without any
    kernel change: :func:`make_problem` draws bf16 inputs with no conv output near a rounding
    boundary (:func:`conv_rounding_margin`), so none can flip."""
    return STATE_TOL


# The fp32 error a kernel may make in one conv output y = SiLU(sum_j w_j x_j) before rounding it,
# relative to sum_j |w_j x_j| + |y|: 64 fp32 ulps, far above the four products, their sum and the
# SiLU's exp and division (a few ulps each), whatever their order or fusion.
CONV_FP32_ERR = 2.0 ** -18


def _conv_outputs(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """float64 conv outputs ``y [.., C]`` of inputs ``x [.., C]`` after ``window [.., 3, C]`` and the
    fp32 error bound of each (``CONV_FP32_ERR``)."""
    terms = torch.stack([w[:, 0] * window[..., 0, :], w[:, 1] * window[..., 1, :], w[:, 2] * window[..., 2, :],
                         w[:, 3] * x])
    y = torch.nn.functional.silu(terms.sum(0))
    return y, CONV_FP32_ERR * (terms.abs().sum(0) + y.abs())


def _rounds_alike(y: torch.Tensor, err: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every value within ``err`` of ``y`` rounds to the same ``dtype`` number (rounding is monotone:
    the two ends decide)."""
    return (y - err).to(dtype) == (y + err).to(dtype)


def _request_tokens(p_slots, cu, steps):
    """``(request, slot, token indices)`` of every live request."""
    for n, slot in enumerate(p_slots):
        if slot >= 0:
            yield n, slot, range(cu[n], min(cu[n + 1], cu[n] + steps))


def conv_rounding_margin(p: "Problem") -> int:
    """How many k / v conv outputs of ``p``'s live requests (the ones that feed the state) an fp32
    kernel could round to the other bf16 neighbour than the float64 reference: 0 for the problems
    :func:`make_problem` draws."""
    if p.dtype == torch.float32:
        return 0
    w = p.conv_weight.to(F64)
    x_all = torch.cat([t[0].reshape(t.shape[1], -1) for t in (p.q, p.k, p.v)], dim=-1).to(F64)
    unsure, qd = 0, p.H * HEAD
    for _, slot, tokens in _request_tokens(p.extra["slot_list"], p.cu_seqlens.tolist(), p.steps):
        window = p.conv_state[slot].to(F64)
        for tok in tokens:
            y, err = _conv_outputs(window, x_all[tok], w)
            unsure += int((~_rounds_alike(y, err, p.dtype))[qd:].sum())
            window = torch.cat([window[1:], x_all[tok][None]])
    return unsure


def _keep_conv_rounding_safe(p: "Problem", gen: torch.Generator) -> None:
    """Redraw, in place, the bf16 inputs (q / k / v of the live requests' tokens, in token order)
    whose conv output lies within ``CONV_FP32_ERR`` of a rounding boundary of the activation dtype,
    until none does: a kernel's fp32 conv then rounds exactly as the float64 reference does.
    About 2 % of the values move, by up to a few hundredths."""
    w = p.conv_weight.to(F64)
    views = (p.q, p.k, p.v)
    hd = p.H * HEAD
    for _, slot, tokens in _request_tokens(p.extra["slot_list"], p.cu_seqlens.tolist(), p.steps):
        window = p.conv_state[slot].to(F64)
        for tok in tokens:
            x = torch.cat([t[0, tok].reshape(-1) for t in views]).to(F64)
            for attempt in range(16):
                y, err = _conv_outputs(window, x, w)
                bad = ~_rounds_alike(y, err, p.dtype)
                if not bad.any():
                    break
                step = 2.0 ** (attempt // 2 - 6) * (1 + x.abs())
                noise = torch.randn(x.shape, generator=gen, device=gen.device, dtype=torch.float32).to(F64)
                x = torch.where(bad, (x + step * noise).to(p.dtype).to(F64), x)
            else:
                raise RuntimeError(f"conv outputs of token {tok} stay near a rounding boundary: another seed")
            for i, t in enumerate(views):
                t[0, tok] = x[i * hd:(i + 1) * hd].view(p.H, HEAD).to(t.dtype)
            window = torch.cat([window[1:], x[None]])


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    xb = x.contiguous().view(torch.uint8) if x.element_size() == 1 else x.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    yb = y.contiguous().view(xb.dtype)
    return bool(torch.equal(xb, yb))


@dataclass
class Problem:
    """One layer's worth of verify/decode inputs plus pool tensors."""

    N: int
    H: int
    num_spec: int
    dtype: torch.dtype
    lower_bound: Optional[float]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    conv_weight: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    ssm_state: torch.Tensor
    conv_state: torch.Tensor
    slot_indices: torch.Tensor
    cu_seqlens: torch.Tensor
    intermediate_rows: torch.Tensor
    slots: int
    rows: int
    extra: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return 1 + self.num_spec

    @property
    def T(self) -> int:
        return self.q.shape[1]

    @property
    def D(self) -> int:
        return 3 * self.H * HEAD

    def params(self) -> dict:
        return dict(conv_weight=self.conv_weight, A_log=self.A_log, dt_bias=self.dt_bias,
                    lower_bound=self.lower_bound)

    def acts(self):
        return self.q, self.k, self.v, self.a, self.b

    def verify_kwargs(self) -> dict:
        return dict(self.params(), ssm_state=self.ssm_state, conv_state=self.conv_state,
                    slot_indices=self.slot_indices, cu_seqlens=self.cu_seqlens, num_spec=self.num_spec,
                    intermediate_rows=self.intermediate_rows)

    def ref_verify_kwargs(self) -> dict:
        """Same as verify_kwargs with float64 copies of every float tensor (act_dtype kept)."""
        kw = self.verify_kwargs()
        for key in ("conv_weight", "A_log", "dt_bias", "ssm_state", "conv_state"):
            kw[key] = kw[key].to(F64)
        kw["act_dtype"] = self.dtype
        return kw

    def acts64(self):
        return tuple(x.to(F64) for x in self.acts())

    # scratch buffers -------------------------------------------------------------------------
    def new_icw(self, dtype=None, fill=float("nan")) -> torch.Tensor:
        return torch.full((self.rows, self.steps, 3, self.D), fill, dtype=dtype or self.dtype,
                          device=self.q.device)

    def new_issm(self, dtype=torch.float32, fill=float("nan")) -> torch.Tensor:
        return torch.full((self.rows, self.steps, self.H, HEAD, HEAD), fill, dtype=dtype, device=self.q.device)

    def new_rings(self, L=None, act_dtype=None, fill=float("nan")):
        L = L or self.steps
        dev = self.q.device
        act_dtype = act_dtype or self.dtype
        f32 = torch.float32 if act_dtype != F64 else F64
        return dict(
            ring_rawv=torch.full((self.slots, self.H, L, HEAD), fill, dtype=act_dtype, device=dev),
            ring_rawk=torch.full((self.slots, self.H, L, HEAD), fill, dtype=act_dtype, device=dev),
            ring_g=torch.full((self.slots, self.H, L, HEAD), fill, dtype=f32, device=dev),
            ring_beta=torch.full((self.slots, self.H, L), fill, dtype=f32, device=dev),
        )


def make_problem(*, N: int, H: int, num_spec: int, dtype: torch.dtype, lower_bound: Optional[float],
                 seed: int, dev: Optional[str] = None, slot_list=None, lengths=None, row_list=None,
                 slots: Optional[int] = None, rows: Optional[int] = None,
                 strided: bool = True, rounding_safe: bool = True) -> Problem:
    """Random verify problem. Its bf16 inputs leave no conv output near a rounding boundary
    (:func:`_keep_conv_rounding_safe`; ``state_tol`` says why).

    ``slot_list`` (default: distinct shuffled slots; -1 = padding), ``lengths`` (tokens per request,
    default full windows; cu_seqlens is their prefix sum, so rows past ``cu_seqlens[N]`` belong to
    no request), ``row_list`` (default: reversed rows). ``strided``: q/k/v are views of one
    ``mixed_qkv [T, D + 64]`` buffer like SGLang's fused GEMM output.
    """
    dev = dev or device()
    g = torch.Generator(device=dev).manual_seed(seed)  # generate on the target device (fast at GPU sizes)
    steps = 1 + num_spec
    T = N * steps
    D = 3 * H * HEAD
    slots = slots or (N + 3)
    rows = rows or (N + 1)
    f32 = dict(dtype=torch.float32, device=dev)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, **f32) * scale

    if strided:
        mixed = randn(T, D + 64).to(dtype)
        q = mixed[:, : H * HEAD].view(1, T, H, HEAD)
        k = mixed[:, H * HEAD: 2 * H * HEAD].view(1, T, H, HEAD)
        v = mixed[:, 2 * H * HEAD: D].view(1, T, H, HEAD)
    else:
        q, k, v = (randn(1, T, H, HEAD).to(dtype) for _ in range(3))
    a = randn(1, T, H, HEAD).to(dtype)
    b = randn(1, T, H).to(dtype)
    conv_weight = torch.rand(D, 4, generator=g, **f32) - 0.5
    A_log = torch.log(torch.rand(H, generator=g, **f32) * 15 + 1)
    dt_bias = randn(H * HEAD, scale=0.1)
    ssm_state = randn(slots, H, HEAD, HEAD, scale=0.5)
    conv_state = randn(slots, 3, D).to(dtype)
    if slot_list is None:
        slot_list = torch.randperm(slots, generator=g, device=dev)[:N].tolist()
    if lengths is None:
        lengths = [steps] * N
    if row_list is None:
        row_list = list(range(N))[::-1]
    cu = [0]
    for ln in lengths:
        cu.append(cu[-1] + ln)
    i32 = dict(dtype=torch.int32, device=dev)
    p = Problem(
        N=N, H=H, num_spec=num_spec, dtype=dtype, lower_bound=lower_bound,
        q=q, k=k, v=v, a=a, b=b, conv_weight=conv_weight, A_log=A_log, dt_bias=dt_bias,
        ssm_state=ssm_state, conv_state=conv_state,
        slot_indices=torch.tensor(slot_list, **i32), cu_seqlens=torch.tensor(cu, **i32),
        intermediate_rows=torch.tensor(row_list, **i32), slots=slots, rows=rows,
        extra=dict(lengths=list(lengths), slot_list=list(slot_list), row_list=list(row_list)),
    )
    if rounding_safe and dtype != torch.float32:
        _keep_conv_rounding_safe(p, g)  # state_tol says why
    return p
