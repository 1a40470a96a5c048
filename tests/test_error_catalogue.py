"""Every error code the plugin can raise has an entry in docs/troubleshooting.md (message, cause,
fix and a before/after snippet), and the data path raises nothing but catalogued errors."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sglang_dspark_plugin"
DOC = ROOT / "docs" / "troubleshooting.md"
CODE = re.compile(r"DSPARK-E\d{3}")
# Modules on the data path (registration, layout, backend, commit, kernels): they report bad
# input only through errors.dspark_error, so every message has a code and an entry.
DATA_PATH = ["plugin.py", "layout.py", "backend.py", "commit.py", "kernels"]


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def codes_in_code():
    return {c for path in _sources() for c in CODE.findall(path.read_text())}


def doc_entries():
    """``{code: body}`` for each ``### DSPARK-Exxx ...`` heading of the troubleshooting page."""
    text = DOC.read_text()
    parts = re.split(r"^### (DSPARK-E\d{3})\b.*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_raised_code_has_an_entry():
    codes = codes_in_code()
    assert len(codes) >= 20, codes  # the catalogue is real: kernels, layout, backend, registration
    missing = sorted(codes - set(doc_entries()))
    assert not missing, f"no entry in docs/troubleshooting.md for {missing}"


def test_entries_say_message_cause_fix_and_show_before_after():
    for code, body in doc_entries().items():
        for section in ("**Message**", "**Cause**", "**Fix**"):
            assert section in body, f"{code}: missing {section}"
        assert "```" in body and "# before" in body.lower() and "# after" in body.lower(), (
            f"{code}: needs a before/after snippet"
        )


def test_no_entry_for_a_code_that_no_longer_exists():
    stale = sorted(set(doc_entries()) - codes_in_code())
    assert not stale, f"docs/troubleshooting.md documents codes the code never raises: {stale}"


def test_data_path_raises_only_catalogued_errors():
    bare = re.compile(r"raise (ValueError|RuntimeError|TypeError|AssertionError|NotImplementedError)\(")
    offenders = []
    for name in DATA_PATH:
        paths = (PACKAGE / name).rglob("*.py") if (PACKAGE / name).is_dir() else [PACKAGE / name]
        for path in paths:
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                if bare.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "raise through errors.dspark_error instead:\n" + "\n".join(offenders)


def test_sglang_shape_contract_entries_come_first():
    """The page starts with the contract users hit in SGLang today: q/k/v/g shape, beta shape,
    T not a multiple of N, head_dim != 128, state layout/dtype -- in that order."""
    entries = doc_entries()
    assert list(entries)[:5] == ["DSPARK-E101", "DSPARK-E102", "DSPARK-E104", "DSPARK-E103", "DSPARK-E105"]
    assert "expected q/k shape (1, T, H, 128)" in entries["DSPARK-E101"]
