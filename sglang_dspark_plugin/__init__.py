"""sglang-dspark-plugin: an out-of-tree SGLang attention backend (``--attention-backend dspark``)
for Kimi-style KDA hybrid models with DSPARK speculative decoding.

``register`` is the ``sglang.srt.plugins`` entry point; see ``plugin.py``.
"""

__version__ = "0.1.0"


def register() -> None:
    """SGLang plugin entry point (kept import-light: SGLang loads it in every process)."""
    from .plugin import register as _register

    _register()
