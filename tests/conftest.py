"""Shared test setup.

Without a GPU, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` must be set
before any ``@triton.jit`` function is defined, so it is set here, before test modules import
the kernels, with the CPU harness's interpreter speed-up (``cpu_support.patch_language_once_per_launch``).
``gpu`` tests are skipped without CUDA.

Tests marked ``own_process`` change process-wide state (they call the plugin's ``register()`` and
install the CPU-only patches in-process), which must not leak into the other tests of the run.
They run together in one child pytest (``_ChildRun``; they share that state, as they share what they
need of it): the parent collects them as usual (ids, ``-k``, ``-x`` and the summary work as for any
test) but runs neither their fixtures nor their bodies; each reports the outcome the child gave it.
The kernel tests (``tests/kernels``) run the same way in a second child when other tests run too,
and in a run that serves (``e2e`` tests selected) the remaining unit tests in a third, so that a
2-core machine runs them beside the served tests, which mostly wait on their servers; ``pytest
tests/kernels`` runs them in-process (for ``--pdb``, per-test ``--durations``). The children start
when collection ends.

Tests that start an SGLang server are marked ``e2e``, so that the fast loop (``-m "not e2e"``,
README) starts none: a test without the marker that starts one through the harness
(``SGLangServer``: ``launch_server``, ``sglang serve``, the example launch script) fails, saying so.
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from sglang_dspark_plugin.harness import cpu_support
from sglang_dspark_plugin.harness.serving import SGLangServer

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the interpreter speed-up shims (cpu_support, shims 7-9): nothing computed changes
    cpu_support.patch_language_once_per_launch()
    cpu_support.convert_bf16_by_bits()
    cpu_support.numpy_dtype_table_once()

# tests/sglang_kit.py is imported by several test folders.
sys.path.insert(0, os.path.dirname(__file__))

_CHILD_REPORT = "DSPARK_TEST_CHILD_REPORT"  # set in the child: where it writes its outcomes


_RUNNING = {"item": None}  # the test whose setup, call or teardown is running


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _RUNNING["item"] = item
    try:
        yield
    finally:
        _RUNNING["item"] = None


def _starts_sglang(server: SGLangServer) -> bool:
    command = " ".join(server.command)
    return "launch_server" in command or "sglang.cli" in command


def _start_marked_e2e(server: SGLangServer):
    item = _RUNNING["item"]
    if item is not None and item.get_closest_marker("e2e") is None and _starts_sglang(server):
        pytest.fail(f"{item.nodeid} starts an SGLang server ({server.name}) but is not marked e2e: add "
                    "pytest.mark.e2e, which keeps it out of the fast loop (-m 'not e2e')", pytrace=False)
    return _start_sglang_server(server)


_start_sglang_server = SGLangServer.start
SGLangServer.start = _start_marked_e2e


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "own_process: runs in a child pytest of its own test module (changes process-wide state)"
    )


# DSPARK_GPU_E2E_ON_CPU=1: dry-run the GPU end-to-end harness (tests/gpu) on CPU, tiny model only.
GPU_E2E_DRY_RUN = os.environ.get("DSPARK_GPU_E2E_ON_CPU") == "1"
GPU_E2E_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")


def pytest_collection_modifyitems(config, items):
    if not HAS_CUDA:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if GPU_E2E_DRY_RUN and str(item.fspath).startswith(GPU_E2E_DIR):
                continue
            if "gpu" in item.keywords:
                item.add_marker(skip)


KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels") + os.sep


def _child_group(item, with_servers: bool):
    """The child pytest that runs ``item``: ``own_process`` tests (process-wide state), the kernel
    tests (the longest CPU-bound group, beside the others), when the run serves (``with_servers``)
    the other unit tests too (beside the served tests, which wait on their servers most of the
    time), or None (this process: the served tests, or the unit tests of a fast loop)."""
    if item.get_closest_marker("own_process"):
        return "own_process"
    if str(item.fspath).startswith(KERNELS_DIR):
        return "kernels"
    if with_servers and not item.get_closest_marker("e2e"):
        return "unit"
    return None


def pytest_collection_finish(session):
    """Hand each child group of the selected tests to a child pytest started now, beside this
    process's tests (a 2-core machine runs both); the kernel tests only when other tests run too
    (``pytest tests/kernels`` runs them here). Their items here report the children's outcomes."""
    if os.environ.get(_CHILD_REPORT) or session.config.option.collectonly:
        return  # a child runs its tests itself
    groups = {}
    with_servers = any(item.get_closest_marker("e2e") for item in session.items)
    for item in session.items:
        groups.setdefault(_child_group(item, with_servers), []).append(item)
    if None not in groups and "own_process" not in groups:
        groups.pop("kernels", None)
    for name, group in groups.items():
        if name is None:
            continue
        run = _ChildRun(exitfirst=session.config.getoption("maxfail") == 1)
        _CHILD_RUNS.append(run)
        for item in group:
            # Fixtures and body run in the child; here the item only reports the child's outcome.
            item.setup = item.teardown = lambda: None
            item.runtest = lambda nodeid=item.nodeid, run=run: run.report(nodeid)
        run.start([item.nodeid for item in group])


def pytest_sessionfinish(session):
    for run in _CHILD_RUNS:
        run.stop()  # a session cut short (-x) leaves no child behind


def pytest_runtest_logreport(report):
    path = os.environ.get(_CHILD_REPORT)
    if not path or (report.when != "call" and report.passed):
        return
    reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
    entry = dict(nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                 text=report.longreprtext, reason=reason)
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


_CHILD_RUNS = []  # this session's child pytests


class _ChildRun:
    """One child ``pytest`` over a group of the selected tests, started when collection ends
    (``start``); the first of them to report waits for it."""

    def __init__(self, exitfirst: bool):
        self.exitfirst = exitfirst
        self.proc = None
        self.reports = None
        self.output = ""

    def start(self, nodeids) -> None:
        if self.proc is not None or not nodeids:
            return
        rootdir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self._report = tempfile.NamedTemporaryFile("r", suffix=".jsonl")
        self._log = tempfile.TemporaryFile("w+")
        # one torch thread: the child shares the machine with this process's tests
        env = dict(os.environ, **{_CHILD_REPORT: self._report.name})
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids]
        if self.exitfirst:
            cmd.insert(3, "-x")
        self.proc = subprocess.Popen(cmd, cwd=rootdir, env=env, stdout=self._log, stderr=subprocess.STDOUT, text=True)

    def _wait(self) -> None:
        self.proc.wait()
        self._log.seek(0)
        self.output = self._log.read()[-9000:]
        self.reports = {}
        for line in self._report.read().splitlines():
            entry = json.loads(line)
            self.reports.setdefault(entry["nodeid"], []).append(entry)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def report(self, nodeid: str) -> None:
        if self.reports is None:
            self._wait()
        entries = self.reports.get(nodeid)
        if not entries:
            pytest.fail(f"{nodeid} did not run in its child pytest; its output:\n{self.output}", pytrace=False)
        for entry in entries:
            if entry["outcome"] == "failed":
                pytest.fail(f"[in a child pytest, {entry['when']}]\n{entry['text']}", pytrace=False)
        for entry in entries:
            if entry["outcome"] == "skipped":
                pytest.skip(entry["reason"] or entry["text"])
