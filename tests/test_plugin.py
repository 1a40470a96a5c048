"""Registration with real SGLang: entry point, CLI choice, factory, hook, idempotence.

Checks that depend on SGLang's process-global state (plugin loading, argparse choices) run in a
fresh interpreter, as SGLang's own processes do.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env: dict | None = None, timeout: int = 300, replace_env: bool = False):
    full_env = dict(env) if replace_env else dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT,
    )


def _env_without(*names) -> dict:
    return {k: v for k, v in os.environ.items() if k not in names}


# What the CPU-only patches (harness/cpu_support.py) would change, as one process sees it.
PROCESS_STATE = """
    import json, os, sys, torch
    import triton.runtime.autotuner as autotuner
    import sglang.kernels.ops.attention.fla.utils  # noqa: F401 (the fla shim installs on import)
    import sglang.kernels.ops.mamba.mamba_state_scatter_triton as scatter
    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    import sglang.srt.arg_groups.speculative_hook as speculative_hook
    import sglang.srt.layers.rotary_embedding.base as rope
    from sglang.srt.utils import is_cpu, is_cuda
    from sglang_dspark_plugin.harness import cpu_support

    state = dict(
        TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET"),
        record_stream_is_torchs=torch.Tensor.record_stream is RECORD_STREAM,
        autotuner_is_tritons=autotuner.Autotuner.prune_configs is PRUNE_CONFIGS,
        rope_flag_is_sglangs=rope._is_cpu == is_cpu(),
        cache_locs_flag_is_sglangs=cache_locs._is_cuda == is_cuda(),
        scatter_patched=hasattr(scatter.fused_mamba_state_scatter_with_mask, "_dspark_cpu_patch"),
        dspark_device_gate_patched=hasattr(speculative_hook._handle_dspark, "_dspark_cpu_patch"),
        import_finder=any(type(f).__name__ == "_AfterImport" for f in sys.meta_path),
        installed=cpu_support.installed_patches(),
    )
    print("STATE", json.dumps(state, sort_keys=True))
"""


def _load_plugins_and_report(env: dict, then: str = "") -> tuple[dict, subprocess.CompletedProcess]:
    """Load SGLang's plugins in a fresh interpreter with ``env`` and report what changed (``STATE``);
    ``then``: more code run after the report, in the same interpreter."""
    load = """
        import logging
        logging.basicConfig(level=logging.INFO)
        import torch, triton.runtime.autotuner
        RECORD_STREAM = torch.Tensor.record_stream
        PRUNE_CONFIGS = triton.runtime.autotuner.Autotuner.prune_configs
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang_dspark_plugin.plugin import _hook_installed
        print("FACTORY", "dspark" in ATTENTION_BACKENDS, ATTENTION_BACKEND_CHOICES.count("dspark"), _hook_installed())
    """
    proc = run_python(
        textwrap.dedent(load) + textwrap.dedent(PROCESS_STATE) + textwrap.dedent(then),
        env=env,
        replace_env=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("STATE "))
    return json.loads(line[len("STATE "):]), proc


PARSE_ARGS = """
    import argparse
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--attention-backend", "dspark",
                            "--decode-attention-backend", "dspark"])
    print("PARSED", ns.attention_backend, ns.decode_attention_backend)
"""
PARSE = """
    from sglang.srt.plugins import load_plugins
    load_plugins()
""" + PARSE_ARGS


@pytest.fixture(scope="module")
def plain_process():
    """A process that loads the plugins without opting in to the CPU path, reports its state, then
    parses a command line with ``--attention-backend dspark`` (one fresh interpreter for both)."""
    return _load_plugins_and_report(_env_without("TRITON_INTERPRET", "SGLANG_DSPARK_CPU"), then=PARSE_ARGS)


def test_entry_points_register_dspark_and_change_nothing_else(plain_process):
    """With the plugin installed, a process that does not opt in to the CPU path is SGLang as
    without the plugin: dspark is registered (a choice, a factory, name aliases, a hook that passes
    other backends through), and no environment variable, module flag or torch/Triton method
    changed. (With SGLANG_DSPARK_CPU=1, what the harness sets, the CPU-only patches are installed:
    tests/test_cpu_support.py.)"""
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps["dspark"] == "sglang_dspark_plugin:register"
    assert eps["dspark_cpu"] == "sglang_dspark_plugin.harness.cpu_support:apply_if_requested"

    state, proc = plain_process
    assert "FACTORY True 1 True" in proc.stdout
    assert "dspark plugin registered" in proc.stderr
    untouched = dict(
        TRITON_INTERPRET=None, record_stream_is_torchs=True, autotuner_is_tritons=True,
        rope_flag_is_sglangs=True, cache_locs_flag_is_sglangs=True, scatter_patched=False, dspark_device_gate_patched=False, import_finder=False,
        installed=[],
    )
    assert state == untouched


def test_register_applies_no_other_plugins_hooks():
    """Inside load_plugins() register() only registers its hook (load_plugins applies all hooks
    once every plugin ran); called directly it applies the hooks of its own target, nothing else."""
    proc = run_python(
        """
        import json
        from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType, _current_plugin_source
        from sglang_dspark_plugin.plugin import HOOK_TARGET, _hook_installed, register

        # Another plugin's hook, registered before ours, on a target of its own.
        HookRegistry.register("json.dumps", lambda original, *a, **k: original(*a, **k), HookType.AROUND)

        token = _current_plugin_source.set(HookSource(plugin_name="dspark", dist_name=None))
        register()  # as load_plugins() calls it
        _current_plugin_source.reset(token)
        print("IN_LOAD_PLUGINS", sorted(HookRegistry._patched), _hook_installed())

        register()  # a direct call
        print("DIRECT", sorted(HookRegistry._patched), _hook_installed())
        HookRegistry.apply_hooks()  # what load_plugins() ends with
        print("AFTER", sorted(HookRegistry._patched) == sorted([HOOK_TARGET, "json.dumps"]), _hook_installed())
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    target = "sglang.srt.layers.attention.attention_registry.attn_backend_wrapper"
    assert "IN_LOAD_PLUGINS [] False" in proc.stdout
    assert f"DIRECT ['{target}'] True" in proc.stdout
    assert "AFTER True True" in proc.stdout


def test_hook_applied_too_early_by_another_plugin_is_reported():
    """If the target was patched before our hook could join its chain (another plugin applied the
    hooks early), the hook would never run: register() says so (DSPARK-E002), and the dspark
    factory refuses to build a backend that would silently be SGLang's own."""
    proc = run_python(
        """
        from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType, _current_plugin_source
        from sglang_dspark_plugin.errors import DSparkError
        from sglang_dspark_plugin.plugin import HOOK_TARGET, _create_dspark_full_attention_backend, register

        HookRegistry.register(HOOK_TARGET, lambda original, *a, **k: original(*a, **k), HookType.AROUND)
        HookRegistry.apply_hooks()  # another plugin applies all hooks while the plugins still load
        token = _current_plugin_source.set(HookSource(plugin_name="dspark", dist_name=None))
        try:
            register()
        except DSparkError as exc:
            print("REGISTER", exc.code, "hook on" in str(exc))
        _current_plugin_source.reset(token)
        try:
            _create_dspark_full_attention_backend(None)
        except DSparkError as exc:
            print("FACTORY", exc.code)
        """
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REGISTER DSPARK-E002 True" in proc.stdout
    assert "FACTORY DSPARK-E002" in proc.stdout


def test_cli_parser_accepts_dspark(plain_process):
    _, proc = plain_process
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


DELEGATE = """
    from sglang.srt.runtime_context import override_platform
    from sglang_dspark_plugin.plugin import full_attention_delegate
    with override_platform(is_hopper_with_cuda_12_3=True, is_blackwell=False):
        print("HOPPER", full_attention_delegate())
    with override_platform(is_hopper_with_cuda_12_3=False, is_blackwell=True):
        print("BLACKWELL", full_attention_delegate())
    with override_platform(is_hopper_with_cuda_12_3=False, is_blackwell=False):
        print("OTHER", full_attention_delegate())
"""
# On Hopper the delegate is fa3: the MLA handler, absorb-core and chunked-prefix tables must
# treat "dspark" exactly like "fa3".
NAME_ALIASES = """
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


@pytest.fixture(scope="module")
def delegate_process():
    """The delegate choice per GPU architecture (reads the platform, changes nothing), then the
    name aliases of the fa3 delegate, in one fresh interpreter."""
    proc = run_python(textwrap.dedent(DELEGATE) + textwrap.dedent(NAME_ALIASES))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_full_attention_delegate_follows_gpu_architecture(delegate_process):
    assert "HOPPER fa3" in delegate_process.stdout
    assert "BLACKWELL flashinfer" in delegate_process.stdout
    assert "OTHER triton" in delegate_process.stdout


def test_name_aliases_mirror_the_delegate(delegate_process):
    assert "HANDLER True" in delegate_process.stdout
    assert "ABSORB 1 CHUNKED 1" in delegate_process.stdout


# --- in-process: factory + hook on real SGLang construction --------------------------------
# These register the plugin in the test process: they run in a pytest process of their own
# (own_process, tests/conftest.py).


@pytest.fixture(scope="module")
def registered():
    from sglang_dspark_plugin import register
    from sglang_dspark_plugin.harness import cpu_support

    cpu_support.apply()  # the harness's opt-in to the CPU-only patches; a no-op with CUDA
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


@pytest.mark.own_process
def test_register_twice_is_harmless(registered):
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_dspark_plugin.plugin import HOOK_TARGET, _attn_backend_wrapper_hook, register

    register()
    assert ATTENTION_BACKEND_CHOICES.count("dspark") == 1
    hooks = [h for _, h, _ in HookRegistry._hooks[HOOK_TARGET]]
    assert hooks.count(_attn_backend_wrapper_hook) == 1
    assert HOOK_TARGET in HookRegistry._patched


@pytest.mark.own_process
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


@pytest.mark.own_process
def test_hook_leaves_other_backends_and_models_alone(registered, caplog):
    from transformers import LlamaConfig

    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
    from sglang_dspark_plugin.backend import DSparkKDAAttnBackend

    # Kimi model served with a stock backend name: SGLang's own KDA backend.
    _, hybrid = _build("triton")
    assert type(hybrid.linear_attn_backend) is KDAAttnBackend
    assert not isinstance(hybrid.linear_attn_backend, DSparkKDAAttnBackend)

    # A model without linear attention: the full-attention backend comes back unwrapped, and the
    # log says that dspark changed nothing for it (the Kimi model under dspark gets no such line).
    no_kda = "has no Kimi-style KDA layers"
    llama = LlamaConfig(num_hidden_layers=2, architectures=["LlamaForCausalLM"])
    with caplog.at_level("WARNING", logger="sglang_dspark_plugin"):
        _build("dspark")
        assert no_kda not in caplog.text
        full, wrapped = _build("dspark", hf_config=llama)
    assert wrapped is full
    (line,) = [r.getMessage() for r in caplog.records if no_kda in r.getMessage()]
    assert line.startswith("dspark: LlamaForCausalLM has no Kimi-style KDA layers: every layer runs on SGLang's")


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
        ("cap-accept", "sps.json", "triton", False),  # cap-accept verifies dense windows (caps the commit)
        ("compact", "sps.json", "fa3", False),  # fa3 / flashinfer read the ragged layout
        ("compact", "sps.json", "flashinfer", False),
    ],
)
def test_ragged_verify_on_triton_mla_is_refused_with_e004(monkeypatch, mode, table, delegate, refused):
    """SGLang's triton MLA backend segfaults on verify windows shorter than 1+gamma
    (docs/guide/cpu-testing.md, "Not covered on CPU"); the dspark factory refuses that configuration at startup with DSPARK-E004."""
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


def test_product_never_imports_the_harness():
    """The harness (demo, launcher, tiny models, CPU shims) is no part of what SGLang runs: no
    product module imports it, so registering the plugin cannot pull it in."""
    import ast
    import pathlib

    package = pathlib.Path(ROOT) / "sglang_dspark_plugin"
    offenders = []
    for path in package.rglob("*.py"):
        if "harness" in path.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any("harness" in name for name in names):
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not offenders, offenders


def test_touched_sglang_internals_are_listed_in_step():
    """plugin.SGLANG_INTERNALS, docs/design/architecture.md's list and the code agree: every entry exists in
    the installed SGLang and is used by plugin.py, and every module attribute plugin.py rebinds (the
    class swap in the hook) is an entry."""
    import ast
    import pathlib
    import pkgutil
    import re

    from sglang_dspark_plugin import plugin

    internals = plugin.SGLANG_INTERNALS
    doc = (pathlib.Path(ROOT) / "docs" / "design" / "architecture.md").read_text()
    listed = doc.split("<!-- sglang-internals -->", 1)[1].split("<!-- /sglang-internals -->", 1)[0]
    assert re.findall(r"^- `(sglang\.[\w.]+)`", listed, flags=re.M) == list(internals)
    assert plugin.HOOK_TARGET in internals

    tree = ast.parse(pathlib.Path(plugin.__file__).read_text())
    listing = next(n for n in tree.body if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", None) == "SGLANG_INTERNALS" for t in n.targets))
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    strings_outside_listing = {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    } - {n.value for n in ast.walk(listing) if isinstance(n, ast.Constant)}
    for dotted in internals:
        pkgutil.resolve_name(dotted)  # exists in the installed SGLang
        name = dotted.rsplit(".", 1)[1]
        assert name in used or dotted in strings_outside_listing, f"{dotted} is listed but plugin.py never uses it"

    rebound = {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
               for t in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(t, ast.Attribute)}
    assert rebound <= {d.rsplit(".", 1)[1] for d in internals}, rebound

