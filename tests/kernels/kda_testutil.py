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
    boundary (:func:`conv_rounding_margin`), so none can flip. (The bound was 1e-3 on CUDA before,
    which a kernel with one unrounded conv output passes.)"""
    return STATE_TOL


# The fp32 error a kernel may make in one conv output y = SiLU(z), z = sum_j w_j x_j, before
# rounding it: 64 fp32 ulps of sum_j |w_j x_j| for z (carried to y by SiLU's slope) and of |y| for
# the SiLU itself, far above the four products, their sum and the exp and division (a few ulps
# each), whatever their order or fusion.
CONV_FP32_ERR = 2.0 ** -18
# bf16 problems scale the current input's conv tap w_3 into [0.05, 0.5] in magnitude (from
# PyTorch's U(-0.5, 0.5)), so that redrawing an input moves its conv output (_keep_conv_rounding_safe)
MIN_CURRENT_TAP = 0.05


def _conv_outputs(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """float64 conv outputs ``y [.., C]`` of inputs ``x [.., C]`` after ``window [.., 3, C]`` and the
    fp32 error bound of each (``CONV_FP32_ERR``)."""
    terms = torch.stack([w[:, 0] * window[..., 0, :], w[:, 1] * window[..., 1, :], w[:, 2] * window[..., 2, :],
                         w[:, 3] * x])
    z = terms.sum(0)
    y = torch.nn.functional.silu(z)
    sig = torch.sigmoid(z)
    slope = (sig * (1 + z * (1 - sig))).abs()
    return y, CONV_FP32_ERR * (slope * terms.abs().sum(0) + y.abs())


def _rounds_alike(y: torch.Tensor, err: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every value within ``err`` of ``y`` rounds to the same ``dtype`` number (rounding is monotone:
    the two ends decide)."""
    return (y - err).to(dtype) == (y + err).to(dtype)


def _steps(p: "Problem"):
    """Per verify step t: ``(requests, tokens)`` of the live requests (slot >= 0) that have a t-th
    token, as index tensors on the problem's device (requests are independent: one batch per step)."""
    cu = p.cu_seqlens.tolist()
    live = [n for n, slot in enumerate(p.extra["slot_list"]) if slot >= 0]
    for t in range(p.steps):
        reqs = [n for n in live if cu[n] + t < cu[n + 1]]
        if not reqs:
            return
        idx = dict(dtype=torch.long, device=p.q.device)
        yield torch.tensor(reqs, **idx), torch.tensor([cu[n] + t for n in reqs], **idx)


def _inputs(p: "Problem", tokens: torch.Tensor) -> torch.Tensor:
    """float64 ``[len(tokens), D]`` conv inputs (q | k | v) of ``tokens``."""
    return torch.cat([t[0, tokens].reshape(len(tokens), -1) for t in (p.q, p.k, p.v)], dim=-1).to(F64)


def _windows(p: "Problem") -> torch.Tensor:
    """float64 conv windows ``[N, 3, D]`` of the requests' slots (slot -1: any, never read)."""
    slots = p.slot_indices.long().clamp(min=0)
    return p.conv_state[slots].to(F64)


def conv_rounding_margin(p: "Problem") -> int:
    """How many k / v conv outputs of ``p``'s live requests (the ones that feed the state) an fp32
    kernel could round to the other bf16 neighbour than the float64 reference: 0 for the problems
    :func:`make_problem` draws."""
    if p.dtype == torch.float32:
        return 0
    w, windows, qd = p.conv_weight.to(F64), _windows(p), p.H * HEAD
    unsure = 0
    for reqs, tokens in _steps(p):
        x = _inputs(p, tokens)
        y, err = _conv_outputs(windows[reqs], x, w)
        unsure += int((~_rounds_alike(y, err, p.dtype))[:, qd:].sum())
        windows[reqs] = torch.cat([windows[reqs, 1:], x[:, None]], dim=1)
    return unsure


def _keep_conv_rounding_safe(p: "Problem", gen: torch.Generator) -> None:
    """Redraw, in place, the bf16 inputs (q / k / v of the live requests' tokens, step by step)
    whose conv output lies within ``CONV_FP32_ERR`` of a rounding boundary of the activation dtype,
    until none does: a kernel's fp32 conv then rounds exactly as the float64 reference does.
    About 1 % of the values move, most by a few hundredths."""
    w, windows, hd = p.conv_weight.to(F64), _windows(p), p.H * HEAD
    for reqs, tokens in _steps(p):
        x = _inputs(p, tokens)
        for attempt in range(16):
            y, err = _conv_outputs(windows[reqs], x, w)
            bad = ~_rounds_alike(y, err, p.dtype)
            if not bad.any():
                break
            step = 2.0 ** (attempt // 2 - 6) * (1 + x.abs())
            noise = torch.randn(x.shape, generator=gen, device=gen.device, dtype=torch.float32).to(F64)
            x = torch.where(bad, (x + step * noise).to(p.dtype).to(F64), x)
        else:
            raise RuntimeError("conv outputs stay near a rounding boundary: draw with another seed")
        for i, t in enumerate((p.q, p.k, p.v)):
            t[0, tokens] = x[:, i * hd:(i + 1) * hd].view(-1, p.H, HEAD).to(t.dtype)
        windows[reqs] = torch.cat([windows[reqs, 1:], x[:, None]], dim=1)


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
        w3 = p.conv_weight[:, 3]
        w3.copy_(torch.sign(w3) * (MIN_CURRENT_TAP + (0.5 - MIN_CURRENT_TAP) * w3.abs() / 0.5))
        _keep_conv_rounding_safe(p, g)  # state_tol says why
    return p
