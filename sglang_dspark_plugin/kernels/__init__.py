"""Bundled Triton kernels for KDA (Kimi Delta Attention) with DSPARK speculative decoding.

* :func:`mtp_verify` -- verify a window of 1+num_spec tokens per request (state read-only;
  snapshot mode or ReplaySSM ring mode).
* :func:`decode` -- one token per request, conv and recurrent state updated in place.
* :func:`replayssm_fold` -- commit: fold the accepted prefix of the rings into the state, all layers.
* :mod:`.record_ring` -- the lazy record ring's commit (``commit_records``) and the state of a slot
  from its checkpoint and records (``materialize_records``); its verify is ``mtp_verify`` with
  ``record_cursor`` (docs/design/lazy-record-ring.md).

Plain PyTorch references (the test oracle) live in :mod:`.reference`; see ``docs/reference/kernel-api.md``.
"""

from .decode import decode
from .mtp_verify import mtp_verify
from .replayssm_fold import replayssm_fold

__all__ = ["mtp_verify", "decode", "replayssm_fold"]
