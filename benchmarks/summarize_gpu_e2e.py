"""Summarise a GPU e2e call (``benchmarks/gpu_rig.sh e2e``) for ``benchmarks/results``.

Reads the log folder the call brings back (``gpu-e2e-logs.tgz`` unpacked: ``fleet.json``,
``prompts-<model>.json``) and prints one JSON object per model: for every configuration the
sequences equal to the ``stock`` baseline, each differing one (wave, prompt, first position,
stock's top-2 gap there), the OpenAI completions equal to stock's, how many sequences follow
the float64 reference (the prompts' ``reference`` continuation), and the radix-cache branches
(turn-1 and branch sequences equal to stock's, branches served from the cache); a
tensor-parallel call also counts each configuration's sequences equal to stock at TP=1::

    python3 benchmarks/summarize_gpu_e2e.py /tmp/rig/e2e/gpu-e2e --command "..." --pytest "..."

The counts are recomputed from the served tokens, so the summary does not depend on how the
tests judged them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # served_log, which gpu_kit reads
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
from gpu_kit import STOCK_TP1, divergence  # noqa: E402  (the e2e test's own comparison with the baseline)

WAVES = ("wave64", "wave5")


def _differing(rows: list, baseline: dict) -> list:
    """Each ``(wave, row)`` whose tokens differ from the baseline's wave64 row of its prompt."""
    expected = {row["prompt"]: row for row in baseline["wave64"]}
    out = []
    for wave, row in rows:
        diff = divergence(row["output_ids"], expected[row["prompt"]])
        if diff is not None:
            gap = diff.get("baseline_gap")
            out.append({"wave": wave, "prompt": row["prompt"], "first_position": diff["position"],
                        "stock_top2_gap": None if gap is None else round(gap, 3)})
    return out


def _openai_equal(res: dict, baseline: dict) -> int:
    expected = {row["prompt"]: row for row in baseline["openai"]}
    return sum(r == expected[r["prompt"]] for r in res.get("openai", []))


def _branches(res: dict, baseline: dict) -> dict:
    """The prefix-hit phase (gpu_kit.run_workload's ``turn1`` and ``branch``): sequences equal to
    stock's (a branch only where its prompt equals stock's, i.e. turn 1 agreed) and the branches
    whose ``cached_tokens`` reach the track point."""
    from gpu_kit import TRACK_INTERVAL

    turn1 = {row["prompt"]: row for row in baseline.get("turn1", [])}
    branch = {row["prompt"]: row for row in baseline.get("branch", [])}
    equal = compared = 0
    for row in res.get("turn1", []):
        compared += 1
        equal += divergence(row["output_ids"], turn1[row["prompt"]]) is None
    for row in res.get("branch", []):
        if row["input_ids"] == branch[row["prompt"]]["input_ids"]:
            compared += 1
            equal += divergence(row["output_ids"], branch[row["prompt"]]) is None
    hits = [r.get("cached_tokens") or 0 for r in res.get("branch", [])]
    return {"branch_requests_compared": compared, "branch_equal_to_stock": equal,
            "branches_from_cache": f"{sum(h >= TRACK_INTERVAL for h in hits)}/{len(hits)}"}


def summarize_model(runs: dict, model: str, reference: list) -> dict:
    """``{config id: summary}`` of one model's runs (``fleet.json``'s ``runs``). A tensor-parallel
    fleet (``DSPARK_GPU_E2E_TP``) also has stock at TP=1, ``stock-tp1``: every other run is then
    counted against it too (``token_equal_to_stock_tp1``)."""
    base = runs[f"{model}-stock"]["results"]
    tp1_id = f"{model}-{STOCK_TP1}"
    tp1 = runs[tp1_id]["results"] if tp1_id in runs else None
    out = {}
    for sid, run in sorted(runs.items()):
        if not sid.startswith(f"{model}-"):
            continue
        res = run["results"] or {}
        entry = {"config": run["config"], "error": run["error"], "startup_s": run["startup_s"],
                 "workload_s": run["workload_s"]}
        rows = [(wave, row) for wave in WAVES for row in res.get(wave, [])]
        follow = {wave: [r["output_ids"] == reference[r["prompt"]] for r in res.get(wave, [])] for wave in WAVES}
        entry["follow_float64_reference"] = {wave: f"{sum(ok)}/{len(ok)}" for wave, ok in follow.items()}
        if "branch" in res:  # stock's own row: only whether its branches came from the cache
            branches = _branches(res, base)
            entry.update(branches if sid != f"{model}-stock" else {"branches_from_cache": branches["branches_from_cache"]})
        if sid != f"{model}-stock":
            differing = _differing(rows, base)
            entry.update(token_requests=len(rows), token_equal_to_stock=len(rows) - len(differing),
                         openai_requests=len(res.get("openai", [])),
                         openai_equal_to_stock=_openai_equal(res, base), differing=differing)
            if tp1 is not None and sid != tp1_id:
                entry.update(token_equal_to_stock_tp1=len(rows) - len(_differing(rows, tp1)),
                             openai_equal_to_stock_tp1=_openai_equal(res, tp1))
        out[sid] = entry
    return out


def summarize(log_dir: Path) -> dict:
    fleet = json.loads((log_dir / "fleet.json").read_text())
    models = sorted({sid.rsplit("-stock", 1)[0] for sid in fleet["runs"] if sid.endswith("-stock")})
    return {model: summarize_model(fleet["runs"], model,
                                   json.loads((log_dir / f"prompts-{model}.json").read_text())["reference"])
            for model in models}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log_dir", type=Path, help="the unpacked gpu-e2e folder (fleet.json, prompts-*.json)")
    ap.add_argument("--command", default="", help="the e2e command, recorded with the summary")
    ap.add_argument("--pytest", default="", help="pytest's summary line, recorded with the summary")
    a = ap.parse_args()
    print(json.dumps({"command": a.command, "pytest": a.pytest, "models": summarize(a.log_dir)}, indent=1))


if __name__ == "__main__":
    main()
