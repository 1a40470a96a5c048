"""benchmarks/render_results.py renders a kernel table from a committed H200 run: every point of
the run gets a row, and the cells are the run's numbers (checked against values read straight from
the JSON here). ``--previous`` is checked against a copy of the run with its ring-verify times
scaled, written here (the folder keeps only the runs the docs cite)."""

import contextlib
import importlib.util
import io
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
RUN = os.path.join(RESULTS, "h200_2026-11-30_kernels.json")


def _previous(tmp_path, factor=1.25):
    """The run with every ring-verify time scaled by ``factor``: a stand-in for an earlier run."""
    data = json.load(open(RUN))
    for r in data["rows"]:
        if r["kernel"] == "verify_ring" and r["us"] is not None:
            r["us"] *= factor
    path = tmp_path / "previous.json"
    path.write_text(json.dumps(data))
    return str(path)


def _render(*args):
    spec = importlib.util.spec_from_file_location("render_results", os.path.join(ROOT, "benchmarks", "render_results.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        mod.main(list(args))
    return buf.getvalue()


def _default(rows, kernel, H, N, T):
    (r,) = [r for r in rows if (r["kernel"], r["H"], r["N"], r["T"]) == (kernel, H, N, T) and not r["cfg"]]
    return r


def test_table_rows_match_the_json(tmp_path):
    run = json.load(open(RUN))
    rows = run["rows"]
    previous = _previous(tmp_path)
    prev = json.load(open(previous))["rows"]
    text = _render(RUN, "--previous", previous)
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| H |")]
    assert len(table) == len({(r["H"], r["N"], r["T"]) for r in rows})
    (line,) = [ln for ln in table if ln.startswith("| 32 | 64 | 8 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    v = _default(rows, "verify_ring", 32, 64, 8)
    up = min(r["us"] for r in rows if (r["H"], r["N"], r["T"]) == (32, 64, 8)
             and r["kernel"] in ("up_verify_fused_ring", "up_verify_unfused_ring") and r["us"] is not None)
    assert cells[3] == (f"{v['us']:.1f} ({v['us'] / v['floor_us']:.2f}×, {v['us'] / v['io_floor_us']:.2f}×, "
                        f"{up / v['us']:.2f})")
    p = _default(prev, "verify_ring", 32, 64, 8)
    assert cells[4] == f"{p['us']:.1f} ({p['us'] / v['us']:.2f}×)"
    fc = _default(rows, "fold_conv", 32, 64, 8)
    assert cells[6] == f"{fc['us']:.1f} ({fc['us'] / fc['floor_us']:.2f}×)"
    assert f"{run['bandwidth_TBps']:.3f} TB/s" in text  # the run's copy bandwidth


def test_decode_rows_match_the_json():
    """The run also timed decode (T = 1): its rows carry the decode cell and the upstream decodes,
    and no verify/fold cells."""
    run = RUN
    rows = json.load(open(run))["rows"]
    text = _render(run)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("| 32 | 32 | 1 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    d = _default(rows, "decode", 32, 32, 1)
    up = _default(rows, "up_decode", 32, 32, 1)
    fla = _default(rows, "up_fla_decode", 32, 32, 1)
    # without --previous: H, N, T, verify, fold, fold + conv, verify+fold, decode, upstream
    assert cells[7] == f"{d['us']:.1f} ({d['us'] / d['floor_us']:.2f}×, {up['us'] / d['us']:.2f})"
    assert cells[8] == f"decode {up['us']:.1f} (sglang), {fla['us']:.1f} (fla, no conv)"
    assert cells[3] == cells[4] == "—"
