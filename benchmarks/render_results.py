"""Render docs/benchmarks.md's tables from a bench_kernels.py JSON (no GPU needed).

    python3 benchmarks/render_results.py benchmarks/results/h200_2026-11-30.json

"ours" is the configuration the launch table (sglang_dspark_plugin/kernels/launch_config.py)
selects today, looked up among the configurations the run timed (a run made with --candidates
times the defaults of that day plus the alternatives); "up" is upstream's best H200 path on the
same inputs: ring verify = min(sglang unfused, sglang fused), fold = sglang commit fold,
decode = sglang conv + packed decode (fla-core's decode, which skips the conv, in its own column),
snapshot verify = sglang unfused.
"""

from __future__ import annotations

import json
import sys

# today's defaults (launch_config.py) as the explicit configurations the run timed
DEFAULT = {
    "verify_ring": {},
    "fold": {},
    "decode": {},
    "verify_snapshot": {},
}
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


def f(r, up=None):
    if r is None:
        return "—"
    s = f"{r['us']:.1f} ({r['us'] / r['floor_us']:.2f}×"
    if up is not None:
        s += f", {up['us'] / r['us']:.2f}"
    return s + ")"


def main(path):
    d = json.load(open(path))
    rows = d["rows"]
    pts = sorted({(r["H"], r["N"], r["T"]) for r in rows})
    out = []
    out.append("| H | N | T | ReplaySSM verify µs (×floor, up/ours) | fold µs (×floor, up/ours) | verify+fold up/ours | "
               "snapshot verify µs (×floor, up/ours) | decode µs (×floor, up/ours) | up: ring verify / fold / snapshot / decode µs | "
               "I/O floor ring verify µs | recurrent / chunked ring verify forced µs (×floor) |")
    out.append("|" + "---|" * 11)
    for H, N, T in pts:
        if T == 1:
            d_ = pick(rows, "decode", H, N, T, DEFAULT["decode"])
            ud = pick(rows, "up_decode", H, N, T, who="up")
            fla = pick(rows, "up_fla_decode", H, N, T, who="up")
            out.append(f"| {H} | {N} | 1 | — | — | — | — | {f(d_, ud)} | decode {ud['us']:.1f} (sglang), "
                       f"{fla['us']:.1f} (fla, no conv) | — | — |" if ud and fla else f"| {H} | {N} | 1 | — | — | — | — | {f(d_, ud)} | — | — | — |")
            continue
        v = pick(rows, "verify_ring", H, N, T, DEFAULT["verify_ring"])
        fo = pick(rows, "fold", H, N, T, DEFAULT["fold"])
        sn = pick(rows, "verify_snapshot", H, N, T, DEFAULT["verify_snapshot"])
        rv = pick(rows, "verify_ring", H, N, T, ROWS)
        ch = pick(rows, "verify_ring", H, N, T, CHUNKED)
        uv = upbest(rows, ["up_verify_unfused_ring", "up_verify_fused_ring"], H, N, T)
        uf = pick(rows, "up_fold", H, N, T, who="up")
        us = pick(rows, "up_verify_unfused_snapshot", H, N, T, who="up")
        step = f"{(uv['us'] + uf['us']) / (v['us'] + fo['us']):.2f}" if v and fo and uv and uf else "—"
        snap = f(sn, us) if sn else "not timed (see below)"
        ups = " / ".join(f"{x['us']:.1f}" if x else "—" for x in (uv, uf, us)) + " / —"
        out.append(f"| {H} | {N} | {T} | {f(v, uv)} | {f(fo, uf)} | {step} | {snap} | — | {ups} | "
                   f"{v['io_floor_us']:.1f} ({v['io_floor_us'] / v['floor_us']:.2f}× S/B) | {f(rv)} / {f(ch)} |")
    print("\n".join(out))
    print()
    print(f"copy bandwidth {d['bandwidth_TBps']:.3f} TB/s; {d['env'].get('gpu')}; driver {d['env'].get('nvidia_smi')}; "
          f"torch {d['env']['torch']}; triton {d['env']['triton']}; {d['env']['date']}")
    for n in d.get("noise", []):
        print(f"noise: {n['kernel']} H={n['H']} N={n['N']} T={n['T']}: {n['first']:.2f} vs {n['second']:.2f} µs")


if __name__ == "__main__":
    main(sys.argv[1])
