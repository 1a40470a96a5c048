"""The docs do not drift: no hard-coded test counts (they change with every test added; pytest
prints them), no machine-specific paths, and benchmarks/results/ holds exactly the runs the docs
cite (every file cited, every citation a file)."""

import itertools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "configs" / "deploy" / "README.md"]
RESULTS = ROOT / "benchmarks" / "results"
RUN_PREFIX = "h200_2026-11-30"  # the sessions' short `_s4_probe_t8.log` form means this day


def _lines():
    for path in DOCS:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(ROOT)}:{lineno}", line


def test_no_hard_coded_test_counts():
    count = re.compile(r"\b\d+ (passed|failed|skipped|deselected|errors?|tests?)\b")
    offenders = [f"{where}: {line.strip()}" for where, line in _lines() if count.search(line)]
    assert not offenders, "say what ran, not how many (pytest prints the counts):\n" + "\n".join(offenders)


def test_no_machine_specific_paths():
    offenders = [f"{where}: {line.strip()}" for where, line in _lines() if "/root/" in line]
    assert not offenders, offenders


def _expand_braces(pattern: str):
    """``a{1,2}.{json,log}`` -> a1.json, a1.log, a2.json, a2.log."""
    parts = re.split(r"(\{[^{}]*\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_results():
    """``{pattern: [files]}`` for every result file a doc names in backticks: the full name, a
    ``{a,b}`` alternative, ``name.*`` (every extension of one run), or the short ``_s4_probe_t8.log``
    form the session sections use."""
    cited = {}
    for _, line in _lines():
        for span in re.findall(r"`([^`]+)`", line):
            tokens = span.split()
            for previous, token in zip([""] + tokens, tokens):
                if previous == "--tag":  # a command's run tag, not a file
                    continue
                token = token.strip("(),;").removeprefix("benchmarks/results/")
                if re.match(r"(h[12]00|cpu)_\d{4}-\d{2}-\d{2}", token):  # a dated run's file name (H200, H100, CPU)
                    pattern = token
                elif re.match(r"_(s\d_|sweep_)", token):
                    pattern = RUN_PREFIX + "*" + token
                else:
                    continue
                for name in _expand_braces(pattern):
                    cited[name] = sorted(p.name for p in RESULTS.glob(name))
    return cited


def test_every_cited_result_exists():
    missing = sorted(pattern for pattern, files in cited_results().items() if not files)
    assert not missing, f"cited in the docs but not in benchmarks/results/: {missing}"


def test_results_hold_only_cited_runs():
    cited = {name for files in cited_results().values() for name in files}
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name not in cited)
    assert not uncited, f"in benchmarks/results/ but cited by no doc (delete, or cite where used): {uncited}"
