"""The examples run as their docstrings say: ``examples/launch_server.sh`` serves the tiny
Kimi-Linear with ``--attention-backend dspark`` and DSPARK speculation (on a machine without a GPU
it sets up the CPU run itself), and ``examples/openai_client.py --base-url`` talks to it; its chat
and completion texts equal stock SGLang's (the session's baseline)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_dspark_plugin.harness.serving import SGLangServer, find_free_port

from e2e_kit import MAX_TOKENS, PROMPTS, assert_served_by_plugin, make_server, start_server, stop_server

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class LaunchScriptServer(SGLangServer):
    """``examples/launch_server.sh`` under the harness's start / health / stop handling."""

    @property
    def command(self):
        return ["bash", str(EXAMPLES / "launch_server.sh"), *self.args]


def _printed(out: str, label: str) -> str:
    """The text ``openai_client.py`` printed after ``label (<seconds> s): `` (a Python repr)."""
    (line,) = [ln for ln in out.splitlines() if ln.startswith(label + " (")]
    return ast.literal_eval(line.split("): ", 1)[1])


def test_launch_server_script_and_openai_client(baseline):
    port = find_free_port()
    # cpu=False: the harness adds no CPU flags or environment; the script must set up a CPU run itself
    server = make_server("example-launch-server", [], env={"PYTHON": sys.executable, "PORT": str(port)},
                         server_cls=LaunchScriptServer, cpu=False, port=port)  # fmt: skip
    for name in ("TRITON_INTERPRET", "SGLANG_DSPARK_CPU"):
        server.env.pop(name, None)
    start_server("example-launch-server", [], server=server)
    try:
        prompt = PROMPTS[0]
        client = subprocess.run(
            [sys.executable, str(EXAMPLES / "openai_client.py"), "--base-url", server.base_url + "/v1",
             "--prompt", prompt, "--max-tokens", str(MAX_TOKENS)],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert client.returncode == 0, client.stdout[-2000:] + client.stderr[-2000:]
        assert _printed(client.stdout, "chat") == baseline.chat[prompt]["text"]
        assert _printed(client.stdout, "completion") == baseline.completion[prompt]["text"]
        assert_served_by_plugin(server, ["mtp_verify (snapshot)"])
    finally:
        stop_server(server)
