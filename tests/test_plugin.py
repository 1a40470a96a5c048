"""Registration with real SGLang: entry point, CLI choice, factory, hook, idempotence.

Checks that depend on SGLang's process-global state (plugin loading, argparse choices) run in a
fresh interpreter, as SGLang's own processes do.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT,
    )


def test_entry_point_is_discovered_by_load_plugins():
    proc = run_python(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        from importlib.metadata import entry_points
        eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dspark"]
        assert [ep.value for ep in eps] == ["sglang_dspark_plugin:register"], eps
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
        print("FACTORY", "dspark" in ATTENTION_BACKENDS, ATTENTION_BACKEND_CHOICES.count("dspark"))
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FACTORY True 1" in proc.stdout
    assert "dspark plugin registered" in proc.stderr


PARSE = """
    import argparse
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--attention-backend", "dspark",
                            "--decode-attention-backend", "dspark"])
    print("PARSED", ns.attention_backend, ns.decode_attention_backend)
"""


def test_cli_parser_accepts_dspark():
    proc = run_python(PARSE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PARSED dspark dspark" in proc.stdout


def test_cli_parser_rejects_dspark_when_plugin_excluded():
    # SGLANG_PLUGINS is a whitelist of entry-point names: leave ours out.
    proc = run_python(PARSE, env={"SGLANG_PLUGINS": "some-other-plugin"})
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert "invalid choice: 'dspark'" in proc.stderr


def test_launch_server_help_lists_dspark():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if "--attention-backend {" in l)
    assert ",dspark" in line or "{dspark" in line


def test_full_attention_delegate_follows_gpu_architecture():
    proc = run_python(
        """
        from sglang.srt.runtime_context import override_platform
        from sglang_dspark_plugin.plugin import full_attention_delegate
        with override_platform(is_hopper_with_cuda_12_3=True, is_blackwell=False):
            print("HOPPER", full_attention_delegate())
        with override_platform(is_hopper_with_cuda_12_3=False, is_blackwell=True):
            print("BLACKWELL", full_attention_delegate())
        with override_platform(is_hopper_with_cuda_12_3=False, is_blackwell=False):
            print("OTHER", full_attention_delegate())
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HOPPER fa3" in proc.stdout
    assert "BLACKWELL flashinfer" in proc.stdout
    assert "OTHER triton" in proc.stdout


def test_name_aliases_mirror_the_delegate():
    # On Hopper the delegate is fa3: the MLA handler, absorb-core and chunked-prefix tables must
    # treat "dspark" exactly like "fa3".
    proc = run_python(
        """
        from sglang.srt.arg_groups.choices import CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS as chunked
        from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry as reg
        from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS as absorb
        from sglang_dspark_plugin.plugin import _register_name_aliases
        assert "dspark" not in absorb and "dspark" not in chunked
        _register_name_aliases("fa3")
        _register_name_aliases("fa3")
        print("HANDLER", reg.get_handler("dspark") is reg.get_handler("fa3"))
        print("ABSORB", absorb.count("dspark"), "CHUNKED", chunked.count("dspark"))
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HANDLER True" in proc.stdout
    assert "ABSORB 1 CHUNKED 1" in proc.stdout


# --- in-process: factory + hook on real SGLang construction --------------------------------


@pytest.fixture(scope="module")
def registered():
    from sglang_dspark_plugin import register

    register()
    register()  # idempotent
    return True


def _build(backend: str, hf_config=None):
    from sglang_kit import KDARunner
    from sglang.srt.layers.attention import attention_registry

    runner = KDARunner(backend=backend, hf_config=hf_config)
    try:
        full = attention_registry.ATTENTION_BACKENDS[backend](runner)
        return full, attention_registry.attn_backend_wrapper(runner, full)
    finally:
        runner.close()


def test_register_twice_is_harmless(registered):
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_dspark_plugin.plugin import HOOK_TARGET, _attn_backend_wrapper_hook, register

    register()
    assert ATTENTION_BACKEND_CHOICES.count("dspark") == 1
    hooks = [h for _, h, _ in HookRegistry._hooks[HOOK_TARGET]]
    assert hooks.count(_attn_backend_wrapper_hook) == 1
    assert HOOK_TARGET in HookRegistry._patched


def test_factory_and_hook_build_dspark_kda_backend_for_kimi(registered):
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import HybridLinearAttnBackend
    from sglang.srt.layers.attention import hybrid_linear_attn_backend
    from sglang.srt.layers.attention.linear import kda_backend
    from sglang_dspark_plugin.backend import DSparkHybridLinearAttnBackend, DSparkKDAAttnBackend

    full, hybrid = _build("dspark")
    assert isinstance(hybrid, HybridLinearAttnBackend)
    assert type(hybrid.linear_attn_backend) is DSparkKDAAttnBackend
    assert type(hybrid) is DSparkHybridLinearAttnBackend
    assert hybrid.full_attn_backend is full
    assert hybrid.full_attn_layers == [1]  # the MLA layer of the tiny config (0-based)
    # The swap is scoped to the construction call: SGLang's names are restored.
    assert kda_backend.KDAAttnBackend is not DSparkKDAAttnBackend
    assert hybrid_linear_attn_backend.HybridLinearAttnBackend is HybridLinearAttnBackend


def test_hook_leaves_other_backends_and_models_alone(registered):
    from transformers import LlamaConfig

    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
    from sglang_dspark_plugin.backend import DSparkKDAAttnBackend

    # Kimi model served with a stock backend name: SGLang's own KDA backend.
    _, hybrid = _build("triton")
    assert type(hybrid.linear_attn_backend) is KDAAttnBackend
    assert not isinstance(hybrid.linear_attn_backend, DSparkKDAAttnBackend)

    # A model without linear attention: the full-attention backend comes back unwrapped.
    full, wrapped = _build("dspark", hf_config=LlamaConfig(num_hidden_layers=2))
    assert wrapped is full


def test_unsupported_sglang_version_fails_loudly():
    # SGLang only logs plugin exceptions: register() must say clearly what is wrong.
    proc = run_python(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        import sglang
        sglang.__version__ = "0.5.22"
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        print("FACTORY", "dspark" in ATTENTION_BACKENDS)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FACTORY False" in proc.stdout
    assert "dspark plugin NOT registered" in proc.stderr
    assert "DSPARK-E001" in proc.stderr and "0.5.22" in proc.stderr


def test_unknown_delegate_leaves_nothing_half_registered():
    proc = run_python(
        """
        import logging
        logging.basicConfig(level=logging.INFO)
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        print("STATE", "dspark" in ATTENTION_BACKEND_CHOICES, "dspark" in ATTENTION_BACKENDS)
        """,
        env={"SGLANG_DSPARK_FULL_ATTN_BACKEND": "fa_3"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STATE False False" in proc.stdout
    assert "DSPARK-E003" in proc.stderr and "'fa_3'" in proc.stderr


@pytest.mark.parametrize(
    "mode,table,delegate,refused",
    [
        ("compact", "sps.json", "triton", True),  # ragged windows on the triton MLA backend: crash
        ("compact", None, "triton", False),  # compact without an SPS table verifies full windows
        ("static", "sps.json", "triton", False),  # SGLang ignores the table under static
        ("compact", "sps.json", "fa3", False),  # fa3 / flashinfer read the ragged layout
        ("compact", "sps.json", "flashinfer", False),
    ],
)
def test_ragged_verify_on_triton_mla_is_refused_with_e004(monkeypatch, mode, table, delegate, refused):
    """SGLang's triton MLA backend segfaults on verify windows shorter than 1+gamma (docs/e2e.md
    section 6); the dspark factory refuses that configuration at startup with DSPARK-E004."""
    from types import SimpleNamespace

    from sglang_dspark_plugin.errors import DSparkError
    from sglang_dspark_plugin.plugin import check_ragged_verify_delegate

    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", mode)
    runner = SimpleNamespace(server_args=SimpleNamespace(speculative_dspark_sps_table_path=table))
    if refused:
        with pytest.raises(DSparkError) as info:
            check_ragged_verify_delegate(runner, delegate)
        assert info.value.code == "DSPARK-E004"
        assert "SGLANG_DSPARK_FULL_ATTN_BACKEND" in str(info.value) and "static" in str(info.value)
    else:
        check_ragged_verify_delegate(runner, delegate)
