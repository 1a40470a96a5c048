"""The plugin's KDA attention backend: the linear (KDA) layers of Kimi-style hybrids."""

from __future__ import annotations

from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend


class DSparkKDAAttnBackend(KDAAttnBackend):
    """KDA backend for ``--attention-backend dspark`` (installed by ``plugin.py``)."""
