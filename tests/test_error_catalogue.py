"""Every error code the plugin can raise has an entry in docs/reference/errors.md (message, cause,
fix and a before/after snippet), every message links to that page, and the data path raises
nothing but catalogued errors.

The codes are read from the raise sites themselves (the ``dspark_error(code, what, ...)`` calls,
by AST), not from strings anywhere in the source: a code is "raised" where a call builds it, and
the argument it names there (``what``) must be one its entry documents. Where a helper takes the
code or the argument name as a parameter (``check_index("slot_indices", ...)``), the literals its
callers pass are followed, so ``check_block_v(block_k)`` style mix-ups show up as an undocumented
argument."""

import ast
import pathlib
import re
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sglang_dspark_plugin"
DOC = ROOT / "docs" / "reference" / "errors.md"  # the page every message links to
# Modules on the data path (registration, layout, backend, commit, kernels): they report bad
# input only through errors.dspark_error, so every message has a code and an entry.
DATA_PATH = ["plugin.py", "layout.py", "backend.py", "commit.py", "kernels"]


class _Function:
    def __init__(self, node: ast.FunctionDef):
        self.node = node
        self.params = [a.arg for a in node.args.args + node.args.kwonlyargs]


def _call_name(call: ast.Call):
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _module_code_constants(trees) -> dict:
    """``E_BLOCK_V = "DSPARK-E121"`` style constants (validation.py)."""
    out = {}
    for tree in trees:
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                value = node.value.value
                if isinstance(value, str) and value.startswith("DSPARK-E"):
                    out.update({t.id: value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _index():
    """(functions by name, calls as (caller, call) pairs, code constants) over the package."""
    trees = [(path, ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))]
    constants = _module_code_constants([t for _, t in trees])
    functions, calls = {}, []
    for path, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                function = _Function(node)
                functions.setdefault(node.name, []).append(function)
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Call):
                        calls.append((function, inner, path))
    return functions, calls, constants


def _is_param(expr, function) -> bool:
    return isinstance(expr, ast.Name) and function is not None and expr.id in function.params


def _value(expr, function, constants):
    """The string a non-parameter expression stands for: a literal, a code constant, the leading
    text of an f-string, a local assigned once from one of those; None when it is computed."""
    if isinstance(expr, ast.Constant):
        return expr.value if isinstance(expr.value, str) else None
    if isinstance(expr, ast.JoinedStr):
        head = expr.values[0] if expr.values else None
        return head.value if isinstance(head, ast.Constant) else None
    name = expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute) else None
    if name in constants:
        return constants[name]
    if isinstance(expr, ast.Name) and function is not None:
        assigned = [n.value for n in ast.walk(function.node) if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)]
        if len(assigned) == 1:  # e.g. name = "intermediate_conv"
            return _value(assigned[0], function, constants)
    return None


def _argument(call: ast.Call, function: _Function, param: str):
    keyword = next((k.value for k in call.keywords if k.arg == param), None)
    if keyword is not None:
        return keyword
    position = function.params.index(param)
    if position < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args[: position + 1]):
        return call.args[position]
    return None


def _combinations(items, calls, constants, depth=0):
    """The value tuples that ``items`` (each an ``(expression, function it is evaluated in)``) take
    together: a parameter is followed into every call of its function, so a helper's code and
    argument name stay paired per caller."""
    param_functions = [f for e, f in items if _is_param(e, f)]
    if not param_functions or depth >= 4:
        return {tuple(None if _is_param(e, f) else _value(e, f, constants) for e, f in items)}
    function = param_functions[0]
    out = set()
    for caller, call, _ in calls:
        if _call_name(call) != function.node.name:
            continue
        substituted = []
        for e, f in items:
            if f is function and _is_param(e, f):
                arg = _argument(call, f, e.id)
                substituted.append((arg if arg is not None else ast.Constant(None), caller))
            else:
                substituted.append((e, f))
        out |= _combinations(substituted, calls, constants, depth + 1)
    return out or {tuple(None for _ in items)}


def raise_sites():
    """``{code: {subject, ...}}`` for every ``dspark_error(code, what, ...)`` call in the package;
    a subject of None means the argument name is computed (e.g. a loop over q, k, v)."""
    _, calls, constants = _index()
    sites = defaultdict(set)
    for function, call, path in calls:
        if _call_name(call) != "dspark_error" or len(call.args) < 2:
            continue
        pairs = _combinations([(call.args[0], function), (call.args[1], function)], calls, constants)
        for code, subject in pairs:
            assert code, f"{path.relative_to(ROOT)}:{call.lineno}: cannot tell which code this raises"
            sites[code].add(subject)
    return sites


def doc_entries():
    """``{code: body}`` for each ``### DSPARK-Exxx ...`` heading of the error catalogue."""
    text = DOC.read_text()
    parts = re.split(r"^### (DSPARK-E\d{3})\b.*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_messages_link_to_the_catalogue():
    """``DSparkError`` messages end with ``(see <page>#<code>)``: the page is this catalogue, and
    every entry's heading gives the anchor (GitHub lowercases the code)."""
    from sglang_dspark_plugin.errors import TROUBLESHOOTING, dspark_error

    assert ROOT / TROUBLESHOOTING == DOC and DOC.is_file()
    err = dspark_error("DSPARK-E104", "T", expected="x", got="y", fix="z")
    assert str(err).endswith(f"(see {TROUBLESHOOTING}#dspark-e104)")


def test_every_raised_code_has_an_entry():
    codes = set(raise_sites())
    assert len(codes) >= 20, codes  # the catalogue is real: kernels, layout, backend, registration
    missing = sorted(codes - set(doc_entries()))
    assert not missing, f"no entry in docs/reference/errors.md for {missing}"


def _documented(code: str, subject: str, body: str) -> bool:
    """The entry shows a message for ``subject``: literally (``[DSPARK-E121] block_v: ...``), or as
    a placeholder message (``[DSPARK-E111] <name>: ...``) whose entry names it (a table row)."""
    if f"[{code}] {subject}" in body:
        return True
    return f"[{code}] <" in body and f"`{subject}`" in body


def test_every_argument_a_code_is_raised_for_is_in_its_entry():
    """One code, one problem: each code is raised only for the arguments its entry's messages name
    (``[DSPARK-E121] block_v: ...``). A code reused for another argument or problem -- E121 once
    covered block_v, block_k and impl -- fails here until it gets its own code and entry."""
    entries = doc_entries()
    undocumented = []
    for code, subjects in sorted(raise_sites().items()):
        body = entries.get(code, "")
        for subject in sorted(s for s in subjects if s is not None):
            if not _documented(code, subject, body):
                undocumented.append(f"{code}: {subject!r}")
    assert not undocumented, "raised for arguments its entry does not show:\n" + "\n".join(undocumented)


def test_entries_say_message_cause_fix_and_show_before_after():
    for code, body in doc_entries().items():
        for section in ("**Message**", "**Cause**", "**Fix**"):
            assert section in body, f"{code}: missing {section}"
        assert "```" in body and "# before" in body.lower() and "# after" in body.lower(), (
            f"{code}: needs a before/after snippet"
        )


def test_no_entry_for_a_code_that_no_longer_exists():
    stale = sorted(set(doc_entries()) - set(raise_sites()))
    assert not stale, f"docs/reference/errors.md documents codes the code never raises: {stale}"


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
