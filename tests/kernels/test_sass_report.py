"""benchmarks/sass_report.py: the chunked-verify kernels (plain and with the lazy record ring), the
fold, the records' materialisation and decode (plain and buffered) compile for sm_90 on a machine
without a GPU (Triton's bundled ptxas), and the launch table's configurations (verify at 4-token
windows, the finish and finished streaming kernels of longer windows, the fold's 16-row tiles,
decode's tiles, the Gluon Hopper stream at 4- and 8-token windows) do so
without register spills (docs/design/architecture.md); the prep and the fold issue their loads before their first store (no serial memory
round trips)."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


TABLE_CONFIGS = {
    "prep": ("verify-prep", "--T", "4", "--block-k", "64", "--warps", "1"),
    "stream": ("verify-stream", "--T", "4", "--block-v", "128", "--block-k", "32", "--warps", "4", "--stages", "3"),
    "stream-finished": ("verify-stream", "--T", "8", "--finish", "--block-v", "64", "--warps", "2", "--stages", "3"),
    "finish": ("verify-finish", "--T", "16", "--prep-block-k", "32", "--warps", "4"),
    "fold": ("fold", "--block-v", "16", "--warps", "1"),
    "lazy-prep": ("verify-prep", "--T", "8", "--block-k", "32", "--warps", "1", "--lazy"),
    "lazy-stream": ("verify-stream", "--T", "4", "--block-v", "128", "--block-k", "32", "--warps", "4", "--lazy"),
    "lazy-stream-finished": ("verify-stream", "--T", "8", "--finish", "--block-v", "64", "--warps", "4", "--lazy"),
    "lazy-finish": ("verify-finish", "--T", "8", "--prep-block-k", "32", "--warps", "1", "--lazy"),
    "materialize": ("materialize", "--block-v", "32", "--warps", "4"),
    "commit": ("commit", "--T", "4"),
    "decode-small-batch": ("decode", "--block-v", "128", "--warps", "4"),
    "decode": ("decode", "--block-v", "32", "--warps", "1"),
    "decode-buffered": ("decode", "--buffered", "--block-v", "32", "--warps", "4"),
    "decode-buffered-factored-small-batch": ("decode", "--buffered", "--factored", "--block-v", "128", "--warps", "8"),
    "decode-buffered-factored": ("decode", "--buffered", "--factored", "--block-v", "32", "--warps", "1"),
    "gluon-stream": ("verify-stream-gluon", "--T", "8"),
    "gluon-stream-gate": ("verify-stream-gluon", "--T", "8", "--gate"),
    "gluon-stream-gate-T4": ("verify-stream-gluon", "--T", "4", "--gate"),
}
LOAD_ORDER_CONFIGS = {
    "prep-T4": ("verify-prep", "--T", "4", "--block-k", "32", "--warps", "1"),
    "prep-T16": ("verify-prep", "--T", "16", "--block-k", "32", "--warps", "2"),
    "fold-16": ("fold", "--block-v", "16", "--warps", "1"),
    "fold-4": ("fold", "--block-v", "4", "--warps", "1"),
}

# Every report below from one process (the tool's imports once): each argument list through the
# tool's command line (``main(argv)``), its output (or its traceback) after a marker line.
BATCH = """
import json, sys, traceback
sys.path.insert(0, sys.argv[1])
import sass_report
for argv in json.loads(sys.argv[2]):
    print("=== " + " ".join(argv), flush=True)
    try:
        sass_report.main(argv)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
"""


@pytest.fixture(scope="module")
def tool_output():
    """``benchmarks/sass_report.py ARGS``'s output for every argument list of this module."""
    runs = {" ".join(args): args for args in [*TABLE_CONFIGS.values(), *LOAD_ORDER_CONFIGS.values()]}
    env = dict(os.environ, TRITON_INTERPRET="0")  # the tool compiles; the interpreter cannot
    r = subprocess.run([sys.executable, "-c", BATCH, os.path.join(ROOT, "benchmarks"), json.dumps(list(runs.values()))],
                       capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    outputs = {}
    for chunk in r.stdout.split("=== ")[1:]:
        head, _, body = chunk.partition("\n")
        outputs[head] = body
    assert set(outputs) == set(runs), r.stdout[-2000:] + r.stderr[-2000:]
    return outputs


def _report(out):
    m = re.search(r"(\d+) registers, (\d+) B stack, \d+ B shared, (\d+) SASS instructions", out)
    assert m, out
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def _loads_after_first_store(out):
    m = re.search(r"in code order: ([LS|]*); loads after the first store before a branch: (\d+)", out)
    assert m, out
    return m.group(1), int(m.group(2))


@pytest.mark.parametrize("args", TABLE_CONFIGS.values(), ids=TABLE_CONFIGS.keys())
def test_table_configs_compile_without_spills(args, tool_output):
    regs, stack, sass = _report(tool_output[" ".join(args)])
    assert 0 < regs <= 255 and sass > 100
    assert stack == 0, f"{args}: {stack} B of spills"


@pytest.mark.parametrize("args", LOAD_ORDER_CONFIGS.values(), ids=LOAD_ORDER_CONFIGS.keys())
def test_loads_precede_the_first_store(args, tool_output):
    """A load placed after a store of a loaded value waits for that load (the compiler keeps
    possibly aliasing memory operations in order): the fold's conv roll once had 8 such
    loads, its prep 3 blocks of them. The tool itself must see the difference."""
    order, late = _loads_after_first_store(tool_output[" ".join(args)])
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
