"""benchmarks/sass_report.py: the chunked-verify kernels (plain and with the lazy record ring), the
fold, the records' materialisation and decode (plain and buffered) compile for sm_90 on a machine
without a GPU (Triton's bundled ptxas), and the launch table's configurations (verify at 4-token
windows, the finish and finished streaming kernels of longer windows, the fold's 16-row tiles,
decode's tiles) do so
without register spills (docs/design/architecture.md); the prep and the fold issue their loads
before their first store (no serial memory round trips)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_tool(*args):
    """stdout of ``benchmarks/sass_report.py ARGS``."""
    env = dict(os.environ, TRITON_INTERPRET="0")  # the tool compiles; the interpreter cannot
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sass_report.py"), *args],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def _report(*args):
    out = _run_tool(*args)
    m = re.search(r"(\d+) registers, (\d+) B stack, \d+ B shared, (\d+) SASS instructions", out)
    assert m, out
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _loads_after_first_store(*args):
    out = _run_tool(*args)
    m = re.search(r"in code order: ([LS|]*); loads after the first store before a branch: (\d+)", out)
    assert m, out
    return m.group(1), int(m.group(2))


@pytest.mark.parametrize("args", [
    ("verify-prep", "--T", "4", "--block-k", "64", "--warps", "1"),
    ("verify-stream", "--T", "4", "--block-v", "128", "--block-k", "32", "--warps", "4", "--stages", "3"),
    ("verify-stream", "--T", "8", "--finish", "--block-v", "64", "--warps", "2", "--stages", "3"),
    ("verify-finish", "--T", "16", "--prep-block-k", "32", "--warps", "4"),
    ("fold", "--block-v", "16", "--warps", "1"),
    ("verify-prep", "--T", "8", "--block-k", "32", "--warps", "1", "--lazy"),
    ("verify-stream", "--T", "4", "--block-v", "128", "--block-k", "32", "--warps", "4", "--lazy"),
    ("verify-stream", "--T", "8", "--finish", "--block-v", "64", "--warps", "4", "--lazy"),
    ("verify-finish", "--T", "8", "--prep-block-k", "32", "--warps", "1", "--lazy"),
    ("materialize", "--block-v", "32", "--warps", "4"),
    ("commit", "--T", "4"),
    ("decode", "--block-v", "128", "--warps", "4"),
    ("decode", "--block-v", "32", "--warps", "1"),
    ("decode", "--buffered", "--block-v", "32", "--warps", "4"),
    ("decode", "--buffered", "--factored", "--block-v", "128", "--warps", "8"),
    ("decode", "--buffered", "--factored", "--block-v", "32", "--warps", "1"),
], ids=["prep", "stream", "stream-finished", "finish", "fold", "lazy-prep", "lazy-stream", "lazy-stream-finished",
        "lazy-finish", "materialize", "commit", "decode-small-batch", "decode", "decode-buffered",
        "decode-buffered-factored-small-batch", "decode-buffered-factored"])
def test_table_configs_compile_without_spills(args):
    regs, stack, sass = _report(*args)
    assert 0 < regs <= 255 and sass > 100
    assert stack == 0, f"{args}: {stack} B of spills"


@pytest.mark.parametrize("args", [
    ("verify-prep", "--T", "4", "--block-k", "32", "--warps", "1"),
    ("verify-prep", "--T", "16", "--block-k", "32", "--warps", "2"),
    ("fold", "--block-v", "16", "--warps", "1"),
    ("fold", "--block-v", "4", "--warps", "1"),
], ids=["prep-T4", "prep-T16", "fold-16", "fold-4"])
def test_loads_precede_the_first_store(args):
    """A load placed after a store of a loaded value waits for that load (the compiler keeps
    possibly aliasing memory operations in order): the fold's conv roll once had 8 such
    loads, its prep 3 blocks of them. The tool itself must see the difference."""
    order, late = _loads_after_first_store(*args)
    assert "S" in order and late == 0, f"{args}: {order}"


def test_loads_after_first_store_counts_interleaved_pairs():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from sass_report import loads_after_first_store
    finally:
        sys.path.pop(0)
    assert loads_after_first_store("LLLSLSLSLL|LS") == 4  # the shape of the fold before its loads moved first
    assert loads_after_first_store("LLLLSSS|LLLL|SSS") == 0
    assert loads_after_first_store("LLLL") == 0
