"""What a served plugin writes to the server log, and the checks on it (CPU and GPU e2e tests)."""

import re

PLUGIN_ACTIVE_MARK = "dspark: full-attention (MLA) layers use"  # the dspark backend factory ran
PLUGIN_FALLBACK_MARK = "fall back to SGLang's own KDA path"
KERNEL_MARK = "dspark: KDA kernel in use: "  # + the kernel (backend.py logs each once per process)
# Kimi-K3: the decode or verify kernel applied the model's gated output RMSNorm itself (it consumed
# the gate SGLang's KimiK3DeltaAttention offers at 12 heads per rank); appended to its kernel name.
# SGLANG_DSPARK_OUTPUT_GATE=0: never consumed, the model normalises (the line without it).
OUTPUT_GATE_SUFFIX = " + output gate"
OUTPUT_GATE_ENV = "SGLANG_DSPARK_OUTPUT_GATE"


def assert_served_by_plugin(log: str, kernels=()) -> None:
    """The dspark backend was built, no KDA layer fell back, and each of ``kernels`` ran."""
    assert PLUGIN_ACTIVE_MARK in log, "the dspark attention backend was not built"
    fallbacks = [ln for ln in log.splitlines() if PLUGIN_FALLBACK_MARK in ln]
    assert not fallbacks, f"KDA layers left the plugin's path: {fallbacks[:3]}"
    for kernel in kernels:
        assert KERNEL_MARK + kernel in log, f"the plugin's {kernel} kernel never ran"


def kernels_in_use(log: str) -> set:
    """Every plugin kernel whose first-use line is in the log (the text after ``KERNEL_MARK``)."""
    return {m.strip() for m in re.findall(re.escape(KERNEL_MARK) + r"(.*)$", log, re.MULTILINE)}


def assert_output_gate(log: str, kernels, fused: bool) -> None:
    """Each of ``kernels`` (decode / verify kernels) ran with the K3 output gate fused into it
    (``fused``), or without (the model applied its o_norm); never the other way."""
    logged = kernels_in_use(log)
    for kernel in kernels:
        want, other = kernel + OUTPUT_GATE_SUFFIX, kernel
        if not fused:
            want, other = other, want
        assert want in logged, f"{want!r} never ran; the plugin's KDA kernels that ran: {sorted(logged)}"
        assert other not in logged, f"{other!r} ran too; the plugin's KDA kernels that ran: {sorted(logged)}"


def assert_not_served_by_plugin(log: str) -> None:
    """A stock server: the installed plugin built nothing and ran none of its kernels."""
    assert PLUGIN_ACTIVE_MARK not in log and KERNEL_MARK not in log


def ranks_that_ran(log: str, kernel: str) -> set:
    """The tensor-parallel ranks (``{"0", "1"}``) whose first-use line of ``kernel`` is in the log:
    SGLang prefixes each rank's lines with ``TP<rank>]``."""
    return set(re.findall(r"\bTP(\d+)\] " + re.escape(KERNEL_MARK + kernel), log))
