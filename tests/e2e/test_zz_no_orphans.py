"""Runs last (file order): no process of any server this session started is left.

Each server runs in its own session and process group (``start_new_session``), so the session id
of the launcher identifies every process it (and SGLang's scheduler/detokenizer) ever spawned,
even one that moved to another process group."""

from pathlib import Path

import pytest

from e2e_kit import STARTED

pytestmark = pytest.mark.e2e


def _session_members(sid: int):
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp session ...
        if len(fields) >= 4 and int(fields[3]) == sid and fields[0] != "Z":
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            out.append((int(entry.name), cmd[:160]))
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")
def test_no_server_process_left():
    if not STARTED:
        pytest.skip("no e2e server was started in this session")
    leftovers = {rec.name: _session_members(rec.pgid) for rec in STARTED if rec.pgid}
    leftovers = {name: procs for name, procs in leftovers.items() if procs}
    assert not leftovers, f"orphaned server processes: {leftovers}"
