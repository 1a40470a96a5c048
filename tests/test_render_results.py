"""benchmarks/render_results.py renders the docs' table from a committed H200 run: every point of
the run gets a row, and the cells are the run's numbers (checked against values read straight from
the JSON here)."""

import contextlib
import importlib.util
import io
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
RUN = os.path.join(RESULTS, "h200_2026-11-30_s5_final.json")
PREVIOUS = os.path.join(RESULTS, "h200_2026-11-30_s4_final.json")


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


def test_table_rows_match_the_json():
    rows = json.load(open(RUN))["rows"]
    prev = json.load(open(PREVIOUS))["rows"]
    text = _render(RUN, "--previous", PREVIOUS)
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
    assert "4.242 TB/s" in text  # the run's copy bandwidth


def test_decode_rows_match_the_json():
    """The sixth-session run also timed decode (T = 1): its rows carry the decode cell and the
    upstream decodes, and no verify/fold cells."""
    run = os.path.join(RESULTS, "h200_2026-11-30_s6_final.json")
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
