"""The one error type the plugin raises on bad input, and how its messages are built.

Every message carries a stable code (``DSPARK-E###``) that is a heading in
``docs/reference/errors.md``; ``tests/test_error_catalogue.py`` fails when a code used in the
package has no entry there. Code ranges: E0xx registration, E1xx kernel wrappers, E2xx backend
and layout, E3xx serving helpers.

Messages say three things: what was expected, what was given, and the fix.
"""

from __future__ import annotations

TROUBLESHOOTING = "docs/reference/errors.md"


class DSparkError(ValueError):
    """Bad input to the dspark plugin. A ``ValueError`` so callers that catch SGLang's own
    layout errors keep working; ``code`` names the entry in the error catalogue."""

    def __init__(self, code: str, message: str):
        super().__init__(f"[{code}] {message} (see {TROUBLESHOOTING}#{code.lower()})")
        self.code = code


def dspark_error(code: str, what: str, *, expected: str, got: str, fix: str) -> DSparkError:
    """Build (not raise) a ``DSparkError``: ``raise dspark_error("DSPARK-E101", "q", ...)``."""
    return DSparkError(code, f"{what}: expected {expected}, got {got}. Fix: {fix}")
