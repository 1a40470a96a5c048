"""Render a kernel table from a bench_kernels.py JSON (no GPU needed).

    python3 benchmarks/render_results.py benchmarks/results/h200_2026-11-30_kernels.json \
        [--previous <an earlier run of the same grid>.json]

"ours" is the wrappers' default configuration of the run (the launch table of that day:
sglang_dspark_plugin/kernels/launch_config.py); "up" is upstream's best H200 path on the same
inputs: ring verify = min(sglang unfused, sglang fused), fold = sglang commit fold, decode = sglang
conv + packed decode (fla-core's decode, which skips the conv, in its own column), snapshot verify =
sglang unfused. "fold" is the fold alone (what upstream's fold does), "fold + conv" the serving
path that also rolls the conv window. ``--previous``: an earlier run's default ring verify at the
same point, with the speedup since.
"""

from __future__ import annotations

import argparse
import json

ROWS = {"impl": "rows"}  # each ring-verify kernel forced, with the table's tiles for it
CHUNKED = {"impl": "chunked"}


def pick(rows, kernel, H, N, T, cfg=None, who="ours"):
    c = [r for r in rows if (r["kernel"], r["H"], r["N"], r["T"]) == (kernel, H, N, T) and r["us"] is not None]
    if who == "ours":
        c = [r for r in c if (r["cfg"] or {}) == (cfg or {})]
    return min(c, key=lambda r: r["us"]) if c else None


def upbest(rows, kernels, H, N, T):
    c = [r for k in kernels for r in [pick(rows, k, H, N, T, who="up")] if r]
    return min(c, key=lambda r: r["us"]) if c else None


def f(r, up=None, io=False):
    """``us (×floor[, ×I/O floor][, up/ours])``."""
    if r is None:
        return "—"
    s = f"{r['us']:.1f} ({r['us'] / r['floor_us']:.2f}×"
    if io and r.get("io_floor_us"):
        s += f", {r['us'] / r['io_floor_us']:.2f}×"
    if up is not None:
        s += f", {up['us'] / r['us']:.2f}"
    return s + ")"


def table(rows, prev_rows=None):
    """Markdown lines: one row per (H, N, T), decode (T = 1) rows with the decode columns only."""
    pts = sorted({(r["H"], r["N"], r["T"]) for r in rows}, key=lambda p: (-p[0], p[2], p[1]))
    snap_timed = any(r["kernel"] == "verify_snapshot" for r in rows)
    decode_timed = any(r["kernel"] == "decode" for r in rows)
    forced = any((r["cfg"] or {}).get("impl") for r in rows if r["kernel"] == "verify_ring")
    head = ["H", "N", "T", "ReplaySSM verify µs (×S/B, ×I/O floor, up/ours)"]
    if prev_rows is not None:
        head.append("previous run µs (previous/now)")
    head += ["fold µs (×2S/B, up/ours)", "fold + conv µs (×2S/B)", "verify+fold up/ours"]
    if snap_timed:
        head.append("snapshot verify µs (×floor, up/ours)")
    if decode_timed:
        head.append("decode µs (×floor, up/ours)")
    head.append("up: ring verify / fold µs")
    if forced:
        head.append("recurrent / chunked verify forced µs (×S/B)")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for H, N, T in pts:
        cells = [str(H), str(N), str(T)]
        if T == 1:
            d_ = pick(rows, "decode", H, N, T)
            ud = pick(rows, "up_decode", H, N, T, who="up")
            fla = pick(rows, "up_fla_decode", H, N, T, who="up")
            cells += ["—"] * (len(head) - 5 - forced)
            cells += [f(d_, ud), f"decode {ud['us']:.1f} (sglang), {fla['us']:.1f} (fla, no conv)" if ud and fla else "—"]
            cells += ["—"] * forced
            out.append("| " + " | ".join(cells) + " |")
            continue
        v = pick(rows, "verify_ring", H, N, T)
        fo = pick(rows, "fold", H, N, T)
        fc = pick(rows, "fold_conv", H, N, T)
        uv = upbest(rows, ["up_verify_unfused_ring", "up_verify_fused_ring"], H, N, T)
        uf = pick(rows, "up_fold", H, N, T, who="up")
        cells.append(f(v, uv, io=True))
        if prev_rows is not None:
            p = pick(prev_rows, "verify_ring", H, N, T)
            cells.append(f"{p['us']:.1f} ({p['us'] / v['us']:.2f}×)" if p and v else "—")
        cells += [f(fo, uf), f(fc), f"{(uv['us'] + uf['us']) / (v['us'] + fo['us']):.2f}" if v and fo and uv and uf else "—"]
        if snap_timed:
            cells.append(f(pick(rows, "verify_snapshot", H, N, T), pick(rows, "up_verify_unfused_snapshot", H, N, T, who="up")))
        cells += ["—"] * decode_timed + [" / ".join(f"{x['us']:.1f}" if x else "—" for x in (uv, uf))]
        if forced:
            cells.append(f"{f(pick(rows, 'verify_ring', H, N, T, ROWS))} / {f(pick(rows, 'verify_ring', H, N, T, CHUNKED))}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="bench_kernels.py JSON")
    ap.add_argument("--previous", default=None, help="an earlier run's JSON to compare the ring verify with")
    a = ap.parse_args(argv)
    d = json.load(open(a.json))
    prev = json.load(open(a.previous))["rows"] if a.previous else None
    print("\n".join(table(d["rows"], prev)))
    print()
    print(f"copy bandwidth {d['bandwidth_TBps']:.3f} TB/s; {d['env'].get('gpu')}; driver {d['env'].get('nvidia_smi')}; "
          f"torch {d['env']['torch']}; triton {d['env']['triton']}; {d['env']['date']}")
    for n in d.get("noise", []):
        print(f"noise: {n['kernel']} H={n['H']} N={n['N']} T={n['T']}: {n['first']:.2f} vs {n['second']:.2f} µs")


if __name__ == "__main__":
    main()
