"""Compare two configurations' served tokens/s round by round (no GPU needed).

    python3 benchmarks/compare_serving.py BASE.json[:CONFIG] NEW.json[:CONFIG] [--concurrency 64] [--skip K]

Each argument is a ``bench_serving.py`` result (``serving.json``) and, where it holds more than one
configuration, the one to read. Round ``r`` at concurrency ``c`` serves the same prompts in every
run (seeded ``1000 r + c``), so round ``r`` of BASE and of NEW pair up even when the two servers ran
in different device calls (one kimi48 server fits on an H200 at a time). Printed: both series, the
per-round ratios NEW / BASE, their mean with its standard error, the ratio of the medians, and a
verdict: ``faster`` where the mean ratio minus two standard errors is above 1, ``slower`` where the
mean plus two standard errors is below 1, else ``not resolved``. ``--skip K`` leaves out the first K
rounds of both (a fresh server's transient).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import List, Optional


def load_rounds(spec: str, concurrency: int) -> tuple:
    """``(config name, [tokens/s per round])`` from ``path[:config]``."""
    path, _, name = spec.partition(":")
    with open(path) as f:
        runs = json.load(f)["runs"]
    if not name:
        if len(runs) != 1:
            raise SystemExit(f"{path} holds {sorted(runs)}: name one as {path}:CONFIG")
        (name,) = runs
    if name not in runs:
        raise SystemExit(f"{path} has no configuration {name!r} (it has {sorted(runs)})")
    samples = runs[name].get("samples", {}).get(str(concurrency))
    if not samples:
        raise SystemExit(f"{path}:{name} has no rounds at concurrency {concurrency}")
    return name, [s["tokens_per_s"] for s in samples]


def compare(base: List[float], new: List[float], skip: int = 0) -> dict:
    """Paired statistics of ``new[r] / base[r]`` over the rounds both have, the first ``skip`` left out."""
    pairs = list(zip(base, new))[skip:]
    if len(pairs) < 2:
        raise ValueError(f"need at least 2 paired rounds after skipping {skip}, got {len(pairs)}")
    ratios = [n / b for b, n in pairs]
    mean = statistics.mean(ratios)
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
    args = p.parse_args(argv)
    base_name, base = load_rounds(args.base, args.concurrency)
    new_name, new = load_rounds(args.new, args.concurrency)
    r = compare(base, new, args.skip)
    print(f"c={args.concurrency}, rounds {args.skip + 1}..{args.skip + r['rounds']}: {new_name} / {base_name}")
    print("| round | " + base_name + " tok/s | " + new_name + " tok/s | ratio |")
    print("|---|---|---|---|")
    for i, ratio in enumerate(r["ratios"]):
        k = args.skip + i
        print(f"| {k + 1} | {base[k]:.0f} | {new[k]:.0f} | {ratio:.3f} |")
    print(f"mean ratio {r['mean_ratio']:.3f} +- {r['se']:.3f} (standard error), median ratio "
          f"{r['median_ratio']:.3f}, ratio of medians {r['ratio_of_medians']:.3f}: {r['verdict']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
