"""Runs last (file order): no process of any server this session started is left.

Each server runs in its own session and process group (``start_new_session``), so the session id
of the launcher identifies every process it (and SGLang's scheduler/detokenizer) ever spawned,
even one that moved to another process group."""

from pathlib import Path

import pytest

from e2e_kit import STARTED

from sglang_dspark_plugin.harness.serving import live_processes

pytestmark = pytest.mark.e2e


def _session_members(sid: int):
    out = []
    for pid, fields in live_processes():  # fields: state ppid pgrp session ...
        if int(fields[3]) == sid:
            try:
                raw = (Path("/proc") / str(pid) / "cmdline").read_bytes()
                cmd = raw.replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            out.append((pid, cmd[:160]))
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_no_server_process_left():
    if not STARTED:
        pytest.skip("no e2e server was started in this session")
    leftovers = {rec.name: _session_members(rec.pgid) for rec in STARTED if rec.pgid}
    leftovers = {name: procs for name, procs in leftovers.items() if procs}
    assert not leftovers, f"orphaned server processes: {leftovers}"
