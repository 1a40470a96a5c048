"""Every setting of the plugin in one place: its environment variables, the kernel geometry it is
built for, and where it runs.

Environment variables all start with ``SGLANG_DSPARK_`` and are listed in ``ENV_VARS`` (README.md,
"Settings", has the same table and docs/reference/settings.md a section for each;
``tests/test_settings.py`` keeps the three in step). They are read
when used, not at import, so a test or a launcher can set them after importing the package.
``TRITON_INTERPRET`` is Triton's own variable; it is read here too because the launch table and
the CPU support depend on it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

# --- kernel geometry: what the bundled kernels are specialised for -------------------------------

HEAD_DIM = 128  # K = V = 128 per KDA head (Kimi-Linear, Kimi-K3)
CONV_WIDTH = 4  # short conv of q/k/v: 3 previous inputs + the current one
ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)  # q/k/v/a/b, conv state, rings; the state is fp32
# The lazy record ring runs for verify windows up to this many tokens (1 + gamma): above, its
# verify cost more than it saved on the H200 (docs/design/lazy-record-ring.md, 2026-12-02)
LAZY_RECORDS_MAX_WINDOW = 4
# SGLANG_DSPARK_LAZY_RECORDS=all takes windows up to this many tokens: the lazy kernels are tested
# (against float64, through flushes) up to 16-token windows
LAZY_RECORDS_TESTED_WINDOW = 16

# --- environment variables --------------------------------------------------------------------

FULL_ATTN_BACKEND_ENV = "SGLANG_DSPARK_FULL_ATTN_BACKEND"
CPU_ENV = "SGLANG_DSPARK_CPU"
PDL_ENV = "SGLANG_DSPARK_PDL"
TINY_DIR_ENV = "SGLANG_DSPARK_TINY_DIR"
LAZY_RECORDS_ENV = "SGLANG_DSPARK_LAZY_RECORDS"
BUFFERED_DECODE_ENV = "SGLANG_DSPARK_BUFFERED_DECODE"
BUFFERED_DECODE_IMPLS = ("factored", "rows")
OUTPUT_GATE_ENV = "SGLANG_DSPARK_OUTPUT_GATE"
VERIFY_IMPL_ENV = "SGLANG_DSPARK_VERIFY_IMPL"
VERIFY_IMPLS = ("triton", "gluon")

ENV_VARS = {
    FULL_ATTN_BACKEND_ENV: "stock SGLang backend for the MLA / full-attention layers (default: fa3 on "
    "Hopper, flashinfer on Blackwell, else triton)",
    CPU_ENV: "1 = install the CPU-only shims of harness/cpu_support.py (no-GPU runs of the harness: the "
    "demo, the server launcher, the tests); unset, the plugin changes nothing outside dspark",
    PDL_ENV: "0 = launch the kernels without programmatic dependent launch (sm_90+; default on)",
    TINY_DIR_ENV: "where harness/tiny_models.py writes the tiny test models (default: configs/ of a "
    "source checkout, else the user cache)",
    LAZY_RECORDS_ENV: "unset or 1 = the lazy record ring under --enable-linear-replayssm-spec where it is "
    f"safe, for verify windows up to {LAZY_RECORDS_MAX_WINDOW} tokens (no fold per commit; faster per KDA "
    "step and served, docs/design/lazy-record-ring.md); all = also for windows of "
    f"{LAZY_RECORDS_MAX_WINDOW + 1}-{LAZY_RECORDS_TESTED_WINDOW} tokens (correct, not yet shown faster); "
    "0 = fold every commit",
    BUFFERED_DECODE_ENV: "the buffered decode kernel under --enable-linear-replayssm: factored (default) = only "
    "the step's two state products between flushes, the state formed at flushes; rows = form the state every "
    "step (kernels/decode.py)",
    OUTPUT_GATE_ENV: "unset or 1 = apply Kimi-K3's output gate (o_norm, gated RMSNorm) inside the verify and "
    "decode kernels where the model offers it; 0 = leave it to the model's own o_norm kernel",
    VERIFY_IMPL_ENV: "the ring-mode verify's state stream: triton (default) = the portable Triton kernels; "
    "gluon = (experimental) the warp-specialised Gluon kernel (TMA + wgmma) on sm_90 GPUs where it applies (ring mode "
    "without the lazy record ring), the Triton kernels elsewhere (kernels/mtp_verify_gluon.py)",
}


def full_attn_backend_override() -> Optional[str]:
    """``SGLANG_DSPARK_FULL_ATTN_BACKEND``, or None when unset or empty."""
    return os.environ.get(FULL_ATTN_BACKEND_ENV) or None


def cpu_requested() -> bool:
    """``SGLANG_DSPARK_CPU=1``: the harness asks for the CPU-only shims (``harness/cpu_support.py``)."""
    return os.environ.get(CPU_ENV) == "1"


def pdl_enabled() -> bool:
    """``SGLANG_DSPARK_PDL`` is not ``0`` (programmatic dependent launch where the GPU has it)."""
    return os.environ.get(PDL_ENV, "1") != "0"


def lazy_records_enabled() -> bool:
    """The lazy record ring where it is safe: the default (unset or empty), ``1`` or ``all``;
    ``SGLANG_DSPARK_LAZY_RECORDS=0`` folds every commit. Any other value is refused with one
    clear error."""
    return _choice(LAZY_RECORDS_ENV, "1", ("0", "1", "all"),
                   "a lazy record ring setting: use 1 (the default), all or 0") != "0"


def lazy_records_setting() -> Optional[str]:
    """The raw ``SGLANG_DSPARK_LAZY_RECORDS`` value, None when unset (log lines; the two settings
    around it are read from it)."""
    return os.environ.get(LAZY_RECORDS_ENV)


def lazy_records_any_window() -> bool:
    """``SGLANG_DSPARK_LAZY_RECORDS=all``: the lazy record ring also for verify windows above
    ``LAZY_RECORDS_MAX_WINDOW`` tokens."""
    return lazy_records_setting() == "all"


def buffered_decode_impl() -> str:
    """``SGLANG_DSPARK_BUFFERED_DECODE``: the ``impl`` of :func:`kernels.decode.decode` in SGLang's
    decode ring, ``factored`` when unset or empty (the faster kernel: docs/design/lazy-record-ring.md). Any
    other value is refused with one clear error."""
    return _choice(BUFFERED_DECODE_ENV, "factored", BUFFERED_DECODE_IMPLS,
                   f"a buffered decode kernel: use one of {', '.join(BUFFERED_DECODE_IMPLS)} "
                   "(or leave it unset for factored)")


def output_gate_enabled() -> bool:
    """``SGLANG_DSPARK_OUTPUT_GATE``: fuse Kimi-K3's output gate into the kernels where the model
    offers it (the default: unset, empty or ``1``); ``0`` leaves it to the model. Any other value
    is refused with one clear error."""
    return _choice(OUTPUT_GATE_ENV, "1", ("0", "1"), "an output gate setting: use 1 (the default) or 0") == "1"


def verify_impl() -> str:
    """``SGLANG_DSPARK_VERIFY_IMPL``: ``triton`` when unset or empty, or ``gluon`` (the Hopper
    streaming kernel where it applies). Any other value is refused with one clear error."""
    return _choice(VERIFY_IMPL_ENV, "triton", VERIFY_IMPLS,
                   f"a verify implementation: use one of {', '.join(VERIFY_IMPLS)} (or leave it unset for triton)")


def _choice(env: str, default: str, choices, refusal: str) -> str:
    """The value of ``env`` (``default`` when unset or empty); a value outside ``choices`` stops
    with one clear error, ``<env>=<value> is not <refusal>``."""
    value = os.environ.get(env) or default
    if value not in choices:
        raise ValueError(f"{env}={value!r} is not {refusal}")
    return value


def tiny_dir() -> Optional[str]:
    """``SGLANG_DSPARK_TINY_DIR``, or None when unset or empty."""
    return os.environ.get(TINY_DIR_ENV) or None


def interpreting() -> bool:
    """Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, CPU runs)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def gpu_available() -> bool:
    """PyTorch sees a CUDA device."""
    return torch.cuda.is_available()
