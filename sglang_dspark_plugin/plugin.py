"""Registration of the ``dspark`` attention backend with SGLang (the plugin's entry point).

SGLang calls ``register()`` through the ``sglang.srt.plugins`` entry point in every process it
starts (launcher, scheduler, detokenizer), so everything here is idempotent and cheap: heavy
SGLang modules (the KDA backend, the kernels) are imported only when a model is built.

What registration does, and the SGLang internals it touches (all of them, on purpose listed here;
``SGLANG_INTERNALS`` below names each one):

1. ``--attention-backend dspark`` becomes a valid choice
   (``sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES``, shared with the decode/prefill
   backend flags).
2. ``ATTENTION_BACKENDS["dspark"]`` builds the *full-attention* backend for the MLA layers: a
   stock SGLang backend chosen per GPU (Hopper: ``fa3``; Blackwell: ``flashinfer``, what SGLang
   itself picks for MLA there; no or another GPU: ``triton``). ``SGLANG_DSPARK_FULL_ATTN_BACKEND``
   overrides the choice.
3. Every name-keyed SGLang table that must know the alias gets ``dspark`` with the delegate's
   entry, so the MLA layers take the same code path as under the delegate's own name: the MLA
   forward-method handler (``AttentionBackendRegistry``), the absorb-core list
   (``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS``) and the chunked-prefix-cache list.
4. One AROUND hook on ``attention_registry.attn_backend_wrapper``: for Kimi-style KDA models
   served with ``dspark`` it makes SGLang's hybrid construction build the plugin's KDA backend
   (``DSparkKDAAttnBackend``) for the linear layers, inside a hybrid subclass that commits verified
   state through the plugin. Other models, and draft workers, are untouched.
5. For that one wrapped call (and only for dspark KDA models) the hook rebinds
   ``kda_backend.KDAAttnBackend`` and ``hybrid_linear_attn_backend.HybridLinearAttnBackend`` to the
   plugin's subclasses, which SGLang's wrapper imports at call time; it restores both afterwards.

Besides, registration uses ``HookRegistry``'s private ``_hooks`` / ``_patched`` / ``_apply_target``
and the ``_current_plugin_source`` context variable (read only: to find out whether
``load_plugins()`` is running and to apply its own target on a direct call).

Nothing else: every entry above answers only to the name ``dspark`` and the hook passes every other
runner through, so a process that does not select ``dspark`` runs exactly SGLang's own code. The
test harness's CPU-only patches are not installed here (``harness/cpu_support.py``, a separate
entry point that does nothing unless ``SGLANG_DSPARK_CPU=1``); no module of this product imports
the harness.

SGLang only logs exceptions raised by plugins, so ``register()`` checks its own work and logs one
line naming what it registered, or one error naming what is missing.
"""

from __future__ import annotations

import logging

from .errors import dspark_error
from .settings import FULL_ATTN_BACKEND_ENV, full_attn_backend_override

logger = logging.getLogger("sglang_dspark_plugin")

BACKEND_NAME = "dspark"
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)
HOOK_TARGET = "sglang.srt.layers.attention.attention_registry.attn_backend_wrapper"

# Every SGLang internal the plugin changes, in the order of the docstring above: what registration
# adds an entry to, the hooked function, and the two names the hook swaps for the duration of the
# wrapped call. docs/design/architecture.md lists the same; tests/test_plugin.py keeps the list, the doc,
# this module's code and the installed SGLang in step.
SGLANG_INTERNALS = (
    "sglang.srt.arg_groups.choices.ATTENTION_BACKEND_CHOICES",
    "sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS",
    "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry",
    "sglang.srt.models.deepseek_common.utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS",
    "sglang.srt.arg_groups.choices.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS",
    HOOK_TARGET,
    "sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend",
    "sglang.srt.layers.attention.hybrid_linear_attn_backend.HybridLinearAttnBackend",
)


def full_attention_delegate() -> str:
    """Name of the stock SGLang backend that serves the MLA / full-attention layers here."""
    override = full_attn_backend_override()
    if override:
        return override
    from sglang.srt.runtime_context import get_platform

    platform = get_platform()
    if platform.is_hopper_with_cuda_12_3:
        return "fa3"
    if platform.is_blackwell:
        return "flashinfer"
    return "triton"


def _create_dspark_full_attention_backend(runner):
    """``ATTENTION_BACKENDS["dspark"]``: the full-attention backend for the MLA layers.

    SGLang's ``attn_backend_wrapper`` then pairs it with the linear (KDA) backend.
    """
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    delegate = full_attention_delegate()
    if not _hook_installed():
        # HookRegistry applies hooks after every plugin ran and only logs a failure; without the
        # hook "dspark" would silently serve SGLang's own KDA backend.
        raise _registration_error([f"hook on {HOOK_TARGET}"])
    check_ragged_verify_delegate(runner, delegate)
    logger.info("dspark: full-attention (MLA) layers use SGLang's %r backend", delegate)
    _warn_if_no_kda_layers(runner, delegate)
    return ATTENTION_BACKENDS[delegate](runner)


def _warn_if_no_kda_layers(runner, delegate: str) -> None:
    """``dspark`` on a target model without Kimi-style KDA layers serves it on the delegate alone,
    exactly as ``--attention-backend <delegate>`` would: say so (a warning, not an error, since the
    server is correct), so that nobody credits the plugin with that server's speed."""
    from sglang.srt.configs.hybrid_arch import kimi_linear_config

    if getattr(runner, "is_draft_worker", False) or kimi_linear_config(runner.model_config) is not None:
        return
    architectures = getattr(getattr(runner.model_config, "hf_config", None), "architectures", None) or ["this model"]
    logger.warning(
        "dspark: %s has no Kimi-style KDA layers: every layer runs on SGLang's %r backend, as with "
        "--attention-backend %s (dspark's own kernels serve only KDA hybrids such as Kimi-Linear)",
        architectures[0], delegate, delegate,
    )


def check_ragged_verify_delegate(runner, delegate: str) -> None:
    """Refuse genuinely ragged verify windows on SGLang's ``triton`` MLA backend (DSPARK-E004).

    With ``SGLANG_RAGGED_VERIFY_MODE=compact`` and an SPS cost table the DSPARK scheduler gives
    requests verify windows shorter than ``1 + gamma``. SGLang 0.5.23's triton attention backend
    builds its TARGET_VERIFY metadata for dense ``[bs, 1 + gamma]`` windows and ignores
    ``spec_info.ragged_verify_layout``: the first short window makes ``extend_attention_fwd`` read
    past the packed tokens (segfault / heap corruption, also with stock ``--attention-backend
    triton``; docs/guide/cpu-testing.md, "Not covered on CPU"). Failing at startup with the fix beats
    a crashed scheduler.
    """
    if delegate != "triton":
        return
    from sglang.srt.speculative.ragged_verify import RaggedVerifyMode, read_ragged_verify_mode

    table = getattr(getattr(runner, "server_args", None), "speculative_dspark_sps_table_path", None)
    if table and read_ragged_verify_mode() is RaggedVerifyMode.COMPACT:
        raise dspark_error(
            "DSPARK-E004",
            "ragged verify windows (SGLANG_RAGGED_VERIFY_MODE=compact with --speculative-dspark-sps-table-path)",
            expected="an MLA delegate that reads spec_info.ragged_verify_layout (fa3 on Hopper, flashinfer on "
            "Blackwell)",
            got="SGLang's 'triton' backend, which assumes dense 1+gamma windows and crashes on shorter ones",
            fix="serve on a Hopper/Blackwell GPU (or set SGLANG_DSPARK_FULL_ATTN_BACKEND=fa3/flashinfer), or "
            "drop --speculative-dspark-sps-table-path (compact then verifies full windows), or use "
            "SGLANG_RAGGED_VERIFY_MODE=static",
        )


def _uses_dspark_kda(runner) -> bool:
    """True when this runner serves a Kimi-style KDA target model with ``dspark``."""
    from sglang.srt.configs.hybrid_arch import kimi_linear_config

    names = (
        getattr(runner, "prefill_attention_backend_str", None),
        getattr(runner, "decode_attention_backend_str", None),
    )
    return (
        BACKEND_NAME in names
        and not getattr(runner, "is_draft_worker", False)
        and kimi_linear_config(runner.model_config) is not None
    )


def _attn_backend_wrapper_hook(original_fn, runner, full_attn_backend, *args, **kwargs):
    """AROUND hook on ``attn_backend_wrapper``.

    SGLang's wrapper imports ``KDAAttnBackend`` and ``HybridLinearAttnBackend`` from their
    modules at call time and builds ``HybridLinearAttnBackend(full, KDAAttnBackend(runner),
    full_attn_layers)``. For dspark KDA models the plugin's subclasses stand in for those two
    names during the call, so SGLang builds the hybrid exactly as it always does (derived flags,
    backend lists) with our linear child and our commit.
    """
    if not _uses_dspark_kda(runner):
        return original_fn(runner, full_attn_backend, *args, **kwargs)

    from sglang.srt.layers.attention import hybrid_linear_attn_backend
    from sglang.srt.layers.attention.linear import kda_backend

    from .backend import DSparkHybridLinearAttnBackend, DSparkKDAAttnBackend

    stock = (kda_backend.KDAAttnBackend, hybrid_linear_attn_backend.HybridLinearAttnBackend)
    kda_backend.KDAAttnBackend = DSparkKDAAttnBackend
    hybrid_linear_attn_backend.HybridLinearAttnBackend = DSparkHybridLinearAttnBackend
    try:
        hybrid = original_fn(runner, full_attn_backend, *args, **kwargs)
    finally:
        kda_backend.KDAAttnBackend, hybrid_linear_attn_backend.HybridLinearAttnBackend = stock
    if not (
        isinstance(hybrid, DSparkHybridLinearAttnBackend)
        and isinstance(hybrid.linear_attn_backend, DSparkKDAAttnBackend)
    ):
        logger.error(
            "dspark: expected SGLang to build DSparkHybridLinearAttnBackend with "
            "DSparkKDAAttnBackend for the KDA layers, got %s(%s); the KDA layers run on "
            "SGLang's own path",
            type(hybrid).__name__,
            type(getattr(hybrid, "linear_attn_backend", None)).__name__,
        )
    return hybrid


def _register_name_aliases(delegate: str) -> None:
    """Make every name-keyed SGLang table treat ``dspark`` like its delegate."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.models.deepseek_common import utils as deepseek_utils
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
    )

    handler = AttentionBackendRegistry._handlers.get(delegate)
    if handler is not None:
        AttentionBackendRegistry.register(BACKEND_NAME, handler)

    absorb = deepseek_utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    if delegate in absorb and BACKEND_NAME not in absorb:
        absorb.append(BACKEND_NAME)

    chunked = choices.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS
    if delegate in chunked and BACKEND_NAME not in chunked:
        choices.add_chunked_prefix_cache_attention_backend(BACKEND_NAME)


def _hook_installed() -> bool:
    """True when the live ``attn_backend_wrapper`` runs our hook somewhere in its wrapper chain.

    HookRegistry skips a target it already patched, so a hook registered after another plugin
    applied its hooks to the same target would silently never run; look at the chain itself.
    """
    from sglang.srt.layers.attention import attention_registry

    fn = attention_registry.attn_backend_wrapper
    while fn is not None:
        cells = getattr(fn, "__closure__", None) or ()
        if any(getattr(c, "cell_contents", None) is _attn_backend_wrapper_hook for c in cells):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _inside_load_plugins() -> bool:
    """True while SGLang's ``load_plugins()`` runs the plugins: it sets the hook-source context
    variable around each plugin call, and applies every registered hook once all plugins ran."""
    from sglang.srt.plugins.hook_registry import _current_plugin_source

    return _current_plugin_source.get() is not None


def _apply_own_hook() -> None:
    """Apply the hooks registered on ``HOOK_TARGET`` (ours, and any other plugin's on the same
    function), as ``HookRegistry.apply_hooks()`` would, and nothing else: other plugins' targets
    stay for their ``load_plugins()``. For a direct ``register()`` call (tests, embedding code)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    if HOOK_TARGET in HookRegistry._patched:
        return
    try:
        HookRegistry._apply_target(HOOK_TARGET, HookRegistry._hooks[HOOK_TARGET])
        HookRegistry._patched.add(HOOK_TARGET)
    except Exception:  # reported as DSPARK-E002 by the check that follows
        logger.exception("Failed to apply hooks to %s", HOOK_TARGET)


def _hook_will_run() -> bool:
    """Our hook runs, or will: it is in the live wrapper chain, or (inside ``load_plugins()``) it is
    registered on a target that ``load_plugins()`` has still to patch."""
    if _hook_installed():
        return True
    from sglang.srt.plugins.hook_registry import HookRegistry

    registered = [h for _, h, _ in HookRegistry._hooks.get(HOOK_TARGET, [])]
    return (
        _inside_load_plugins()
        and HOOK_TARGET not in HookRegistry._patched
        and _attn_backend_wrapper_hook in registered
    )


def _registration_error(missing):
    return dspark_error(
        "DSPARK-E002",
        "registration",
        expected="the choice, the factory and the hook all in place",
        got="missing " + ", ".join(missing),
        fix="another plugin or an SGLang change interferes; check the log lines above "
        "(HookRegistry logs why a hook could not be applied)",
    )


def register() -> None:
    """Entry point of ``[project.entry-points."sglang.srt.plugins"] dspark``. Idempotent.

    Called by ``load_plugins()`` it registers the hook and leaves applying it to
    ``load_plugins()`` (which applies all plugins' hooks after the last plugin ran); called
    directly it applies the hooks of its own target at once, so the call is complete."""
    try:
        delegate = _register()
    except Exception as exc:
        logger.error(
            "dspark plugin NOT registered (--attention-backend dspark will be rejected): %s: %s",
            type(exc).__name__,
            exc,
        )
        raise
    logger.info(
        "dspark plugin registered: --attention-backend dspark (MLA layers -> %r, "
        "KDA layers -> DSparkKDAAttnBackend)",
        delegate,
    )


def _register() -> str:
    import sglang

    version = getattr(sglang, "__version__", "unknown")
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise dspark_error(
            "DSPARK-E001",
            "SGLang version",
            expected=" or ".join(SUPPORTED_SGLANG_VERSIONS),
            got=version,
            fix=f"pip install sglang=={SUPPORTED_SGLANG_VERSIONS[-1]} (the plugin hooks version-specific "
            "SGLang internals)",
        )

    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # Check the delegate first: a failed registration must not leave a half-registered name.
    delegate = full_attention_delegate()
    if delegate not in ATTENTION_BACKENDS:
        raise dspark_error(
            "DSPARK-E003",
            f"full-attention delegate {delegate!r}",
            expected="a backend name SGLang registered (e.g. fa3, flashinfer, triton)",
            got=f"{delegate!r}",
            fix=f"unset {FULL_ATTN_BACKEND_ENV} or set it to one of SGLang's attention backends",
        )
    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])
    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not _create_dspark_full_attention_backend:
        register_attention_backend(BACKEND_NAME)(_create_dspark_full_attention_backend)
    _register_name_aliases(delegate)

    registered = [h for _, h, _ in HookRegistry._hooks.get(HOOK_TARGET, [])]
    if _attn_backend_wrapper_hook not in registered:
        HookRegistry.register(HOOK_TARGET, _attn_backend_wrapper_hook, HookType.AROUND)
    if not _inside_load_plugins():
        # Applying all hooks here (HookRegistry.apply_hooks) would patch other plugins' targets
        # before load_plugins() has run every plugin; apply only the target we hook.
        _apply_own_hook()

    missing = []
    if choices.ATTENTION_BACKEND_CHOICES.count(BACKEND_NAME) != 1:
        missing.append("attention-backend choice")
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        missing.append("ATTENTION_BACKENDS factory")
    if not _hook_will_run():
        missing.append(f"hook on {HOOK_TARGET}")
    if missing:
        raise _registration_error(missing)
    return delegate
