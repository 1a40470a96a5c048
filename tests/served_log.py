"""What a served plugin writes to the server log, and the checks on it (CPU and GPU e2e tests)."""

import re

PLUGIN_ACTIVE_MARK = "dspark: full-attention (MLA) layers use"  # the dspark backend factory ran
PLUGIN_FALLBACK_MARK = "fall back to SGLang's own KDA path"
KERNEL_MARK = "dspark: KDA kernel in use: "  # + the kernel (backend.py logs each once per process)


def assert_served_by_plugin(log: str, kernels=()) -> None:
    """The dspark backend was built, no KDA layer fell back, and each of ``kernels`` ran."""
    assert PLUGIN_ACTIVE_MARK in log, "the dspark attention backend was not built"
    fallbacks = [ln for ln in log.splitlines() if PLUGIN_FALLBACK_MARK in ln]
    assert not fallbacks, f"KDA layers left the plugin's path: {fallbacks[:3]}"
    for kernel in kernels:
        assert KERNEL_MARK + kernel in log, f"the plugin's {kernel} kernel never ran"


def assert_not_served_by_plugin(log: str) -> None:
    """A stock server: the installed plugin built nothing and ran none of its kernels."""
    assert PLUGIN_ACTIVE_MARK not in log and KERNEL_MARK not in log


def ranks_that_ran(log: str, kernel: str) -> set:
    """The tensor-parallel ranks (``{"0", "1"}``) whose first-use line of ``kernel`` is in the log:
    SGLang prefixes each rank's lines with ``TP<rank>]``."""
    return set(re.findall(r"\bTP(\d+)\] " + re.escape(KERNEL_MARK + kernel), log))
