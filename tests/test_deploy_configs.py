"""configs/deploy/*.sh: each script builds a command line that SGLang's own argument parser
accepts (with the plugin registered, so ``--attention-backend dspark`` is a valid choice), with
the flags the deployment notes promise. No model is loaded."""

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "configs" / "deploy"
SCRIPTS = sorted(DEPLOY.glob("*.sh"))

PARSE = textwrap.dedent(
    """
    import argparse, json, sys
    import sglang_dspark_plugin
    sglang_dspark_plugin.register()
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    out = {}
    for name, argv in json.load(open(sys.argv[1])).items():
        ns = parser.parse_args(argv)
        out[name] = {k: v for k, v in vars(ns).items() if isinstance(v, (int, float, str, bool, type(None)))}
    print(json.dumps(out))
    """
)


def _argv_of(script: Path, tmp_path: Path) -> list:
    """Run the script with a fake ``python`` first on PATH that records its argv."""
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", DRAFT="/path/to/draft")
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60)
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv[:2] == ["-m", "sglang.launch_server"]
    return argv[2:]


@pytest.fixture(scope="module")
def parsed(tmp_path_factory):
    """SGLang's parse of every script's command line (one subprocess: one SGLang import)."""
    tmp = tmp_path_factory.mktemp("deploy")
    argvs = {}
    for script in SCRIPTS:
        work = tmp / script.stem
        work.mkdir()
        argvs[script.stem] = _argv_of(script, work)
    (tmp / "argvs.json").write_text(json.dumps(argvs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", PARSE, str(tmp / "argvs.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_deploy_script_parses(script, parsed):
    ns = parsed[script.stem]
    assert ns["attention_backend"] == "dspark"
    assert ns["speculative_algorithm"] == "DSPARK"
    gamma = ns["speculative_dspark_block_size"]
    assert ns["enable_linear_replayssm_spec"] is True
    ring = ns["linear_replayssm_cache_len"]
    assert ring >= 2 * (gamma + 1) and ring & (ring - 1) == 0, (gamma, ring)
    assert ns["mamba_ssm_dtype"] == "float32"
    assert ns["max_mamba_cache_size"] >= ns["max_running_requests"]
    assert ns["speculative_draft_attention_backend"] in ("fa3", "trtllm_mha")
    if "b200" in script.stem:
        assert ns["page_size"] == 64
