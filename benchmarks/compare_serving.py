"""Compare two configurations' served tokens/s round by round (no GPU needed).

    python3 benchmarks/compare_serving.py BASE.json[:CONFIG] NEW.json[:CONFIG] [--concurrency 64] [--skip K]

Each argument is a ``bench_serving.py`` result (``serving.json``) and, where it holds more than one
configuration, the one to read. Round ``r`` at concurrency ``c`` serves the same prompts in every
run (seeded ``1000 r + c``), so round ``r`` of BASE and of NEW pair up even when the two servers ran
in different calls (one kimi48 server fits on an H200 at a time). Printed: both series, the
per-round ratios NEW / BASE, their mean with its standard error, the ratio of the medians, and a
verdict: ``faster`` where the mean ratio minus two standard errors is above 1, ``slower`` where the
mean plus two standard errors is below 1, else ``not resolved``. ``--skip K`` leaves out the first K
rounds of both (a fresh server's transient). Where both runs recorded them, the same statistics
follow for the servers' own pure decode intervals (each round's median of its full-batch "Decode
batch" log intervals without a prefill): the served step without the waves' prefill and admission.

``--profiles`` (both runs made with ``bench_serving.py --profile``): each kernel's GPU time per
decode / verify step (its summed time over the profiled window / that window's ``kda_steps``) in
BASE and NEW, the largest differences first, and per step all kernels' time, the GPU-busy time and
the window's span (span - busy: the GPU idled, waiting for the host), and that idle time per step
by the kernels around each gap and by the gaps' sizes (where both profiles recorded them:
``idle_gaps_us``, ``idle_by_gap_size_us``); with ``--profile-cpu`` windows in both, also the host
frames that idle time was charged to (``host_gap_phases_us``, ``host_gaps_us``).
Prefills that fell in a window count in its totals, so compare windows of many steps.

Runs from two machines (``machine`` in each result: a different boot id) get a warning line: a
partly host-bound server runs at its host's speed, and the served difference between two machines
can exceed the one under test (docs/benchmarks.md, "Method").
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import List, Optional


def load_run(spec: str) -> dict:
    """One configuration's run from ``path[:config]``, the file read once: ``path``, ``spec``,
    ``name``, ``run`` (its entry under ``runs``) and ``machine`` (``{}`` where not recorded)."""
    path, _, name = spec.partition(":")
    with open(path) as f:
        result = json.load(f)
    runs = result["runs"]
    if not name:
        if len(runs) != 1:
            raise SystemExit(f"{path} holds {sorted(runs)}: name one as {path}:CONFIG")
        (name,) = runs
    if name not in runs:
        raise SystemExit(f"{path} has no configuration {name!r} (it has {sorted(runs)})")
    return {"path": path, "spec": spec, "name": name, "run": runs[name], "machine": result.get("machine") or {}}


def rounds_of(loaded: dict, concurrency: int) -> List[float]:
    """Tokens/s per round at ``concurrency`` of a :func:`load_run` result."""
    samples = loaded["run"].get("samples", {}).get(str(concurrency))
    if not samples:
        raise SystemExit(f"{loaded['path']}:{loaded['name']} has no rounds at concurrency {concurrency}")
    return [s["tokens_per_s"] for s in samples]


def decode_rounds_of(loaded: dict, concurrency: int) -> Optional[List[float]]:
    """Per round at ``concurrency``, the median of the server's pure decode intervals
    (``bench_serving.decode_intervals``: full-batch log intervals without a prefill), or None
    where a round recorded none (results from before 2026-12-04, or
    rounds too short for two log lines at the full batch)."""
    samples = loaded["run"].get("samples", {}).get(str(concurrency)) or []
    found = [s.get("decode_intervals_tok_s") for s in samples]
    if not found or not all(found):
        return None
    return [statistics.median(f) for f in found]


def profile_of(loaded: dict) -> dict:
    """The ``profile`` summary (``bench_serving.kda_share``) of a :func:`load_run` result, with its steps."""
    prof = loaded["run"].get("profile") or {}
    if not prof.get("kernels_us") or not prof.get("kda_steps"):
        raise SystemExit(f"{loaded['spec']}: no per-kernel profile with its step count (run bench_serving.py --profile)")
    return prof


def machine_note(base: dict, new: dict) -> Optional[str]:
    """A warning when two results' ``machine`` records differ (or one is missing), else None."""
    if not base.get("boot_id") or not new.get("boot_id"):
        return "machine: not recorded in both runs; runs from two machines are not comparable at the host-bound part of a step"
    if base["boot_id"] == new["boot_id"]:
        return None
    return (f"WARNING: different machines (boot ids {base['boot_id'][:8]} / {new['boot_id'][:8]}; "
            f"CPUs {base.get('cpu')} x{base.get('cpus')} / {new.get('cpu')} x{new.get('cpus')}): "
            "the host-bound part of a served step differs between machines")


def kernel_diff(base: dict, new: dict, top: int = 15) -> dict:
    """Per-step kernel times of two profiles: ``rows`` of ``(name, base us, new us)`` for the
    ``top`` kernels by the size of the difference, and per step the all-kernel time, the GPU-busy
    time (union of kernel intervals) and the span: span minus busy is the time the GPU idled.
    A kernel outside one profile's top list counts 0 there."""
    per = lambda prof, us: us / prof["kda_steps"]  # noqa: E731
    names = set(base["kernels_us"]) | set(new["kernels_us"])
    rows = [(n, per(base, base["kernels_us"].get(n, 0.0)), per(new, new["kernels_us"].get(n, 0.0))) for n in names]
    rows.sort(key=lambda r: -abs(r[2] - r[1]))
    totals = {key: (per(base, base[key]), per(new, new[key])) for key in ("kernel_us", "gpu_busy_us", "span_us")}
    return {"rows": rows[:top], **totals, "steps": (base["kda_steps"], new["kda_steps"])}


def _per_step(base_us: dict, base_steps: int, new_us: dict, new_steps: int) -> list:
    """``(key, base us, new us)`` per step for every key of two ``{key: {"us": ...}}`` records,
    BASE's keys first in their order; a key outside one record counts 0 there."""
    keys = list(base_us) + [key for key in new_us if key not in base_us]
    per = lambda record, key, steps: record.get(key, {"us": 0.0})["us"] / steps  # noqa: E731
    return [(key, per(base_us, key, base_steps), per(new_us, key, new_steps)) for key in keys]


def _largest(rows: list, top: int) -> list:
    """The ``top`` rows of :func:`_per_step` by the larger of their two values."""
    return sorted(rows, key=lambda r: -max(r[1], r[2]))[:top]


def idle_diff(base: dict, new: dict, top: int = 10) -> Optional[list]:
    """Per-step GPU idle of two profiles by where it happened (``idle_gaps_us``, keyed "A -> B"):
    ``(where, base us, new us)`` for the ``top`` places by the larger of the two, or None where a
    profile predates the record. A place outside one profile's list counts 0 there."""
    if not all(key in prof for key in ("idle_gaps_us", "idle_by_gap_size_us") for prof in (base, new)):
        return None
    return _largest(_per_step(base["idle_gaps_us"], base["kda_steps"], new["idle_gaps_us"], new["kda_steps"]), top)


def idle_by_size(base: dict, new: dict) -> list:
    """Per-step GPU idle of two profiles by gap size (``idle_by_gap_size_us``): ``(size, base us,
    new us)`` in the order the profiles list the sizes."""
    return _per_step(base["idle_by_gap_size_us"], base["kda_steps"], new["idle_by_gap_size_us"], new["kda_steps"])


def host_gap_diff(base: dict, new: dict, top: int = 10, record: str = "host_gaps_us") -> Optional[list]:
    """Per-step GPU idle of two ``--profile-cpu`` windows by the host frames it was charged to
    (``profile["host"][record]``: ``host_gaps_us``, innermost frames, or ``host_gap_phases_us``,
    the frames below the scheduler's event loop; :func:`bench_serving.host_gaps`): ``(frames, base us, new us)`` for the ``top`` by
    the larger of the two, or None where either run has no such record."""
    hosts = [prof.get("host") or {} for prof in (base, new)]
    if not all(h.get(record) is not None and h.get("kda_steps") for h in hosts):
        return None
    b, n = hosts
    return _largest(_per_step(b[record], b["kda_steps"], n[record], n["kda_steps"]), top)


def _diff_table(key: str, base_name: str, new_name: str, rows: list) -> None:
    """Print ``(label, base us, new us)`` rows as a markdown table with their difference."""
    print(f"| {key} | {base_name} | {new_name} | difference |")
    print("|---|---|---|---|")
    for label, b, n in rows:
        print(f"| {label} | {b:.1f} | {n:.1f} | {n - b:+.1f} |")


def compare(base: List[float], new: List[float], skip: int = 0) -> dict:
    """Paired statistics of ``new[r] / base[r]`` over the rounds both have, the first ``skip`` left out.
    One round has no spread: its standard error is NaN and the verdict "not resolved (one round)"."""
    pairs = list(zip(base, new))[skip:]
    if not pairs:
        raise ValueError(f"need at least 1 paired round after skipping {skip}, got none")
    ratios = [n / b for b, n in pairs]
    mean = statistics.mean(ratios)
    if len(pairs) == 1:
        se, verdict = math.nan, "not resolved (one round)"
    else:
        se = statistics.stdev(ratios) / math.sqrt(len(ratios))
        verdict = "faster" if mean - 2 * se > 1 else "slower" if mean + 2 * se < 1 else "not resolved"
    return {
        "rounds": len(pairs),
        "ratios": ratios,
        "mean_ratio": mean,
        "se": se,
        "median_ratio": statistics.median(ratios),
        "ratio_of_medians": statistics.median(n for _, n in pairs) / statistics.median(b for b, _ in pairs),
        "verdict": verdict,
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--skip", type=int, default=0, help="leave out the first K rounds of both")
    p.add_argument("--profiles", action="store_true", help="also diff the two profiles' kernels per step")
    args = p.parse_args(argv)
    base_run, new_run = load_run(args.base), load_run(args.new)
    base_name, new_name = base_run["name"], new_run["name"]
    base, new = rounds_of(base_run, args.concurrency), rounds_of(new_run, args.concurrency)
    r = compare(base, new, args.skip)
    print(f"c={args.concurrency}, rounds {args.skip + 1}..{args.skip + r['rounds']}: {new_name} / {base_name}")
    print("| round | " + base_name + " tok/s | " + new_name + " tok/s | ratio |")
    print("|---|---|---|---|")
    for i, ratio in enumerate(r["ratios"]):
        k = args.skip + i
        print(f"| {k + 1} | {base[k]:.0f} | {new[k]:.0f} | {ratio:.3f} |")
    print(f"mean ratio {r['mean_ratio']:.3f} +- {r['se']:.3f} (standard error), median ratio "
          f"{r['median_ratio']:.3f}, ratio of medians {r['ratio_of_medians']:.3f}: {r['verdict']}")
    base_decode, new_decode = decode_rounds_of(base_run, args.concurrency), decode_rounds_of(new_run, args.concurrency)
    if base_decode and new_decode:
        d = compare(base_decode, new_decode, args.skip)
        print(f"server's pure decode intervals (full batch, no prefill; median per round): "
              f"{' '.join(f'{x:.3f}' for x in d['ratios'])}; mean ratio {d['mean_ratio']:.3f} +- {d['se']:.3f}, "
              f"ratio of medians {d['ratio_of_medians']:.3f}: {d['verdict']}")
    else:
        print("server's pure decode intervals: not recorded in every round of both runs")
    note = machine_note(base_run["machine"], new_run["machine"])
    if note:
        print(note)
    if args.profiles:
        d = kernel_diff(profile_of(base_run), profile_of(new_run))
        print(f"\nGPU us per decode / verify step ({d['steps'][0]} and {d['steps'][1]} steps profiled)")
        totals = [("all kernels", *d["kernel_us"]), ("GPU busy (kernels' union)", *d["gpu_busy_us"]),
                  ("span (first kernel to last)", *d["span_us"])]
        _diff_table("kernel", base_name, new_name, totals + [(name[:80], b, n) for name, b, n in d["rows"]])
        idle = idle_diff(profile_of(base_run), profile_of(new_run))
        if idle is None:
            print("\nGPU idle by place: not recorded in both profiles (bench_serving.py before 2026-12-04)")
        else:
            print("\nGPU idle us per step, by the kernel before the gap -> the kernel after it")
            _diff_table("where", base_name, new_name, idle)
            print()
            sizes = idle_by_size(profile_of(base_run), profile_of(new_run))
            _diff_table("gap size", base_name, new_name, [(f"all gaps {size}", b, n) for size, b, n in sizes])
        for record, title in (("host_gap_phases_us", "phase of the scheduler loop (frames below its event loop)"),
                              ("host_gaps_us", "innermost host frames")):
            host = host_gap_diff(profile_of(base_run), profile_of(new_run), record=record)
            if host:
                print(f"\nGPU idle (gaps of 50 us and more, --profile-cpu window) by the {title}, us per step")
                _diff_table("frames", base_name, new_name, [(frames[:160], b, n) for frames, b, n in host])
    return 0


if __name__ == "__main__":
    sys.exit(main())
