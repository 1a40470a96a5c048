"""One place for settings: every environment variable the plugin reads is defined in
``settings.py`` (one prefix, ``SGLANG_DSPARK_``), read there only, and documented in README.md's
table and in a section of docs/reference/settings.md."""

import ast
import pathlib
import re

import pytest

from sglang_dspark_plugin import settings

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sglang_dspark_plugin"
ENV_NAME = re.compile(r"\bSGLANG_DSPARK_[A-Z0-9_]+\b")
# The product (what SGLang runs); harness/ (demo, launcher, tiny models, CPU shims) is not.
PRODUCT = [p for p in PACKAGE.rglob("*.py") if "harness" not in p.relative_to(PACKAGE).parts]


def readme_settings_table() -> dict:
    """``{variable: row}`` of the table in README.md's "Settings" section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(SGLANG_DSPARK_[A-Z0-9_]+)` \|(.*)$", section, flags=re.M)
    return dict(rows)


def reference_settings_sections() -> list:
    """The variables of the ``### `SGLANG_DSPARK_...` `` headings of docs/reference/settings.md."""
    text = (ROOT / "docs" / "reference" / "settings.md").read_text()
    return re.findall(r"^### `(SGLANG_DSPARK_[A-Z0-9_]+)`$", text, flags=re.M)


def test_every_variable_has_one_prefix_and_a_description():
    assert settings.ENV_VARS
    for name, description in settings.ENV_VARS.items():
        assert name.startswith("SGLANG_DSPARK_") and description, name


def test_readme_table_lists_exactly_the_settings_variables():
    assert set(readme_settings_table()) == set(settings.ENV_VARS)


def test_reference_page_has_one_section_per_settings_variable():
    sections = reference_settings_sections()
    assert len(sections) == len(set(sections)), sections
    assert set(sections) == set(settings.ENV_VARS)


def test_package_names_no_variable_that_settings_does_not_define():
    """A ``SGLANG_DSPARK_*`` name anywhere in the package (harness included) is one of settings'."""
    named = {m for path in PACKAGE.rglob("*.py") for m in ENV_NAME.findall(path.read_text())}
    assert named <= set(settings.ENV_VARS), sorted(named - set(settings.ENV_VARS))


def product_nodes_outside_settings():
    """``(path, node)`` for every AST node of the product's modules except settings.py."""
    for path in PRODUCT:
        if path.name != "settings.py":
            for node in ast.walk(ast.parse(path.read_text())):
                yield path, node


def test_product_reads_the_environment_only_in_settings():
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}" for path, node in product_nodes_outside_settings()
                 if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv")]
    assert not offenders, offenders


def test_constants_are_defined_once():
    """HEAD_DIM, CONV_WIDTH and the activation dtypes live in settings.py only."""
    offenders = []
    for path, node in product_nodes_outside_settings():
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id in ("HEAD_DIM", "CONV_WIDTH", "ACTIVATION_DTYPES",
                                                                    "ACT_DTYPES"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {target.id}")
        if isinstance(node, ast.FunctionDef) and node.name == "gpu_available":
            offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} gpu_available")
    assert not offenders, offenders


def test_lazy_records_on_by_default_off_with_0_and_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv(settings.LAZY_RECORDS_ENV, raising=False)
    assert settings.lazy_records_enabled() and not settings.lazy_records_any_window()
    for value, on, any_window in (("", True, False), ("1", True, False), ("all", True, True), ("0", False, False)):
        monkeypatch.setenv(settings.LAZY_RECORDS_ENV, value)
        assert (settings.lazy_records_enabled(), settings.lazy_records_any_window()) == (on, any_window), value
    monkeypatch.setenv(settings.LAZY_RECORDS_ENV, "off")
    with pytest.raises(ValueError) as err:
        settings.lazy_records_enabled()
    assert "SGLANG_DSPARK_LAZY_RECORDS='off'" in str(err.value) and "use 1 (the default), all or 0" in str(err.value)


def test_buffered_decode_impl_reads_the_variable_and_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv(settings.BUFFERED_DECODE_ENV, raising=False)
    assert settings.buffered_decode_impl() == "factored"
    monkeypatch.setenv(settings.BUFFERED_DECODE_ENV, "rows")
    assert settings.buffered_decode_impl() == "rows"
    monkeypatch.setenv(settings.BUFFERED_DECODE_ENV, "fast")
    with pytest.raises(ValueError) as err:
        settings.buffered_decode_impl()
    assert "SGLANG_DSPARK_BUFFERED_DECODE='fast'" in str(err.value) and "factored, rows" in str(err.value)


def test_output_gate_on_by_default_off_with_0_and_refuses_unknown_values(monkeypatch):
    monkeypatch.delenv(settings.OUTPUT_GATE_ENV, raising=False)
    assert settings.output_gate_enabled()
    for value, on in (("", True), ("1", True), ("0", False)):
        monkeypatch.setenv(settings.OUTPUT_GATE_ENV, value)
        assert settings.output_gate_enabled() is on, value
    monkeypatch.setenv(settings.OUTPUT_GATE_ENV, "yes")
    with pytest.raises(ValueError) as err:
        settings.output_gate_enabled()
    assert "SGLANG_DSPARK_OUTPUT_GATE='yes'" in str(err.value) and "use 1 (the default) or 0" in str(err.value)
