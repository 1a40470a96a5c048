"""benchmarks/sass_report.py: the chunked-verify kernels and the fold compile for sm_90 on a machine
without a GPU (Triton's bundled ptxas), and the launch table's configurations (verify at 4-token
windows, the finish and finished streaming kernels of longer windows, the fold's 16-row tiles) do so
without register spills (docs/benchmarks.md)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report(*args):
    env = dict(os.environ, TRITON_INTERPRET="0")  # the tool compiles; the interpreter cannot
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sass_report.py"), *args],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"(\d+) registers, (\d+) B stack, \d+ B shared, (\d+) SASS instructions", r.stdout)
    assert m, r.stdout
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


@pytest.mark.parametrize("args", [
    ("verify-prep", "--T", "4", "--block-k", "64", "--warps", "1"),
    ("verify-stream", "--T", "4", "--block-v", "128", "--block-k", "32", "--warps", "4", "--stages", "3"),
    ("verify-stream", "--T", "8", "--finish", "--block-v", "64", "--warps", "2", "--stages", "3"),
    ("verify-finish", "--T", "16", "--prep-block-k", "32", "--warps", "4"),
    ("fold", "--block-v", "16", "--warps", "1"),
], ids=["prep", "stream", "stream-finished", "finish", "fold"])
def test_table_configs_compile_without_spills(args):
    regs, stack, sass = _report(*args)
    assert 0 < regs <= 255 and sass > 100
    assert stack == 0, f"{args}: {stack} B of spills"
