"""The docs do not drift: no hard-coded test counts (they change with every test added; pytest
prints them), no machine-specific paths, pages of a readable size, no session numbers, issue
numbers or remarks about the machines behind a measurement, and benchmarks/results/ holds exactly
the runs the docs cite, each listed in its manifest (benchmarks/results/README.md): every file in
the folder is in the manifest and cited by a doc, every manifest row and every citation is a file."""

import itertools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MANIFEST = RESULTS / "README.md"
ERROR_CATALOGUE = ROOT / "docs" / "reference" / "errors.md"  # one entry per code: may run long
# The pages that state things about the product (the manifest only lists the results)
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")),
         ROOT / "configs" / "deploy" / "README.md"]
DOCS = PAGES + [MANIFEST]
MAX_TOTAL_LINES = 3000  # all docs but the error catalogue
MAX_PAGE_LINES = 600  # any page but the error catalogue
# What the product's repository does not carry (history goes to CHANGELOG.md, in dates)
ORDINAL = (r"(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
           r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
           r"twentieth|thirtieth|fortieth|(twenty|thirty|forty)-\w+)")
SESSION = re.compile(rf"\b{ORDINAL}[- ]sessions?\b|\bsessions? \d+\b", re.I)
ISSUE = re.compile(r"\bissues? #?\d+", re.I)
MACHINES = re.compile(r"\bdevice (tool|machine|call|budget|time)s?\b|\blent\b|\bleases?\b|nvidia-h[12]00",
                      re.I)
REMARKS = {  # in the docs also the short forms: `s36`, a bare `#15` (an upstream `owner/repo#N` is fine)
    "a session number": re.compile(SESSION.pattern + r"|(?-i:\bs\d{1,2}\b)", re.I),
    "an issue number": re.compile(ISSUE.pattern + r"|(?<![\w/.-])#\d+\b", re.I),
    "a remark about the measuring machines": MACHINES,
}
# in code, scripts and recorded results (where `s0` is a variable and `#1` a log field)
CODE_REMARKS = {"a session number": SESSION, "an issue number": ISSUE,
                "a remark about the measuring machines": MACHINES}
# Session tags in result file names (`h100_2026-12-06_s36_kernels.json`)
SESSION_TAG = re.compile(r"_s\d+(_|\.)")
# Where the code, tests and scripts live (not .venv or .git)
SOURCE_DIRS = ["sglang_dspark_plugin", "tests", "benchmarks", "examples", "configs", ".ci"]


def _lines(paths=DOCS):
    for path in paths:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            yield f"{path.relative_to(ROOT)}:{lineno}", line


def test_no_hard_coded_test_counts():
    count = re.compile(r"\b\d+ (passed|failed|skipped|deselected|errors?|tests?)\b")
    offenders = [f"{where}: {line.strip()}" for where, line in _lines() if count.search(line)]
    assert not offenders, "say what ran, not how many (pytest prints the counts):\n" + "\n".join(offenders)


def test_no_machine_specific_paths():
    offenders = [f"{where}: {line.strip()}" for where, line in _lines() if "/root/" in line]
    assert not offenders, offenders


def test_pages_stay_short():
    """No page over 600 lines and all docs together (the error catalogue aside) at most 3000."""
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines())
             for path in DOCS if path != ERROR_CATALOGUE}
    long_pages = {str(p): n for p, n in sizes.items() if n > MAX_PAGE_LINES}
    assert not long_pages, f"pages over {MAX_PAGE_LINES} lines: {long_pages}"
    assert sum(sizes.values()) <= MAX_TOTAL_LINES, f"{sum(sizes.values())} lines of docs: {sizes}"


def _remarks(where_lines, remarks=REMARKS):
    return [f"{where}: {kind}: {line.strip()[:160]}" for where, line in where_lines
            for kind, pattern in remarks.items() if pattern.search(line)]


def test_docs_carry_no_session_issue_or_machine_remarks():
    offenders = _remarks(_lines())
    assert not offenders, "state what is true now; dates, not sessions:\n" + "\n".join(offenders)


def test_code_and_results_carry_no_session_issue_or_machine_remarks():
    """The same for comments, docstrings, scripts and the recorded results (``"a session"`` in
    pytest's sense is fine: only numbered sessions count)."""
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*"))
             if p.is_file() and p.suffix in (".py", ".sh", ".md", ".json", ".log", ".txt", ".toml", "")
             and "__pycache__" not in p.parts and p not in DOCS]
    files += [ROOT / "pyproject.toml", ROOT / ".gitignore"]
    offenders = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        lines = ((f"{path.relative_to(ROOT)}:{n}", line) for n, line in enumerate(text.splitlines(), 1))
        offenders += _remarks(lines, CODE_REMARKS)
    assert not offenders, "\n".join(offenders)


def test_result_file_names_carry_no_session_tags():
    offenders = sorted(p.name for p in RESULTS.iterdir() if SESSION_TAG.search(p.name)
                       or any(pattern.search(p.name.replace("_", " ")) for pattern in REMARKS.values()))
    assert not offenders, f"name results by GPU, date and what they hold: {offenders}"


def _expand_braces(pattern: str):
    """``a{1,2}.{json,log}`` -> a1.json, a1.log, a2.json, a2.log."""
    parts = re.split(r"(\{[^{}]*\})", pattern)
    choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*choices)]


def cited_results(paths=PAGES):
    """``{pattern: [files]}`` for every result file a page names in backticks: the full name, a
    ``{a,b}`` alternative or ``name.*`` (every extension of one run)."""
    cited = {}
    for _, line in _lines(paths):
        for span in re.findall(r"`([^`]+)`", line):
            for token in span.split():
                token = token.strip("(),;").removeprefix("benchmarks/results/")
                if re.match(r"(h[12]00|cpu)_\d{4}-\d{2}-\d{2}", token):  # a dated run's file name (H200, H100, CPU)
                    for name in _expand_braces(token):
                        cited[name] = sorted(p.name for p in RESULTS.glob(name))
    return cited


def manifest_rows():
    """The file names of the manifest's table rows (``| `name` | what | command | GPU | stack |``)."""
    return re.findall(r"^\| `([^`]+)` \|", MANIFEST.read_text(), flags=re.M)


def _results():
    return sorted(p.name for p in RESULTS.iterdir() if p != MANIFEST)


def test_every_cited_result_exists():
    missing = sorted(pattern for pattern, files in cited_results(DOCS).items() if not files)
    assert not missing, f"cited in the docs but not in benchmarks/results/: {missing}"


def test_manifest_lists_exactly_the_results_folder():
    rows = manifest_rows()
    assert len(rows) == len(set(rows)), "a file listed twice in benchmarks/results/README.md"
    missing = sorted(set(_results()) - set(rows))
    stale = sorted(set(rows) - set(_results()))
    assert not missing, f"in benchmarks/results/ but not in its README.md: {missing}"
    assert not stale, f"in benchmarks/results/README.md but not in the folder: {stale}"


def test_every_result_is_cited_by_a_doc():
    """A doc cites a run by one of its files: ``X.json`` covers ``X.log`` and ``X.md``, the same run."""
    cited_runs = {name.split(".", 1)[0] for files in cited_results().values() for name in files}
    uncited = sorted(name for name in _results() if name.split(".", 1)[0] not in cited_runs)
    assert not uncited, f"in benchmarks/results/ but cited by no doc (delete, or cite where used): {uncited}"


def test_the_fast_loop_leaves_out_every_server_test():
    """README's fast loop (also in docs/guide/cpu-testing.md) deselects the ``e2e`` marker, which
    pyproject.toml declares and every module of the served suites carries (tests/conftest.py also
    fails a test that starts a server without it); .ci/run runs the README's whole-suite command."""
    import tomllib

    fast = 'python -m pytest -m "not e2e"'
    assert f".venv/bin/{fast}" in (ROOT / "README.md").read_text()
    assert fast in (ROOT / "docs" / "guide" / "cpu-testing.md").read_text()
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("e2e:") for m in markers)
    served = sorted((ROOT / "tests" / "e2e").glob("test_*.py")) + sorted((ROOT / "tests" / "gpu").glob("test_*.py"))
    unmarked = [p.name for p in served if not re.search(r"^pytestmark = .*pytest\.mark\.e2e", p.read_text(), re.M)]
    assert served and not unmarked, unmarked
    whole_suite = ".venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest -ra"
    assert whole_suite in (ROOT / "README.md").read_text() and whole_suite in (ROOT / ".ci" / "run").read_text()
