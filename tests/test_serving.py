"""serving.py without SGLang: flags, and start/stop semantics on a stand-in server process."""

import os
import sys
import textwrap
import time

import pytest

from sglang_dspark_plugin.harness import serving
from sglang_dspark_plugin.harness.serving import SGLangServer, ServerStartError, group_members

# A stand-in for launch_server: forks a child into its process group (like SGLang's scheduler),
# answers /health with 503 for a second, then 200; exits cleanly on SIGTERM.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    t0 = time.time()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if time.time() - t0 > 1 else 503); self.end_headers()
        def log_message(self, *a):
            print("GET", self.path, flush=True)
    def bye(*_):
        child.terminate(); child.wait(); os._exit(0)
    signal.signal(signal.SIGTERM, bye)
    print("fake server up", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


class FakeServer(SGLangServer):
    def __init__(self, script, **kw):
        self.script = script
        super().__init__([], cpu=False, quiet=True, progress_every=1, **kw)

    @property
    def command(self):
        return [sys.executable, "-c", self.script, *self.args]


def test_start_wait_healthy_and_stop_whole_group(tmp_path):
    server = FakeServer(FAKE_SERVER, log_path=tmp_path / "fake.log")
    with server:
        assert server.healthy()
        members = group_members(server.pgid)
        assert len(members) == 2  # launcher + its child, one process group
        pgid = server.pgid
    assert group_members(pgid) == []
    assert not server.alive()
    server.stop()  # idempotent


def test_sigkill_after_grace_when_sigterm_is_ignored(tmp_path):
    stubborn = FAKE_SERVER.replace("signal.signal(signal.SIGTERM, bye)", "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    server = FakeServer(stubborn, log_path=tmp_path / "fake.log", stop_grace=1.0)
    server.start()
    pgid = server.pgid
    t0 = time.monotonic()
    server.stop()
    assert time.monotonic() - t0 < 15
    assert group_members(pgid) == []


def test_startup_failure_raises_with_log_tail_and_leaves_nothing(tmp_path):
    server = FakeServer("import sys; print('boom: bad flag', flush=True); sys.exit(3)", log_path=tmp_path / "f.log")
    with pytest.raises(ServerStartError, match="boom: bad flag"):
        with server:
            pass
    assert group_members(server.pgid) == []


def test_cpu_flags_only_without_gpu():
    cpu = SGLangServer(["--speculative-algorithm", "DSPARK", "--max-running-requests", "2"], cpu=True)
    assert "--device" in cpu.args and cpu.env["TRITON_INTERPRET"] == "1"
    assert cpu.env["SGLANG_DSPARK_CPU"] == "1"  # the opt-in to the CPU-only patches (cpu_support.py)
    assert "--speculative-draft-attention-backend" in cpu.args
    # caller's value wins over the CPU default
    i = cpu.args.index("--max-running-requests")
    assert cpu.args[i + 1] == "2" and cpu.args.count("--max-running-requests") == 1
    gpu = SGLangServer(["--attention-backend", "dspark"], cpu=False)
    assert "--device" not in gpu.args and "--skip-server-warmup" not in gpu.args
    assert gpu.env.get("SGLANG_DSPARK_CPU") == os.environ.get("SGLANG_DSPARK_CPU")  # nothing added
    assert gpu.args[:2] == ["--attention-backend", "dspark"] and "--port" in gpu.args


def test_cpu_radix_strategy_decides_the_overlap_scheduler():
    """no_buffer (the CPU default) needs --disable-overlap-schedule; a caller's extra_buffer keeps
    SGLang's overlap scheduler, as on a GPU, and is not overridden."""
    default = SGLangServer(["--attention-backend", "dspark"], cpu=True).args
    i = default.index("--mamba-radix-cache-strategy")
    assert default[i + 1] == "no_buffer" and "--disable-overlap-schedule" in default
    extra = SGLangServer(["--mamba-radix-cache-strategy", "extra_buffer"], cpu=True).args
    assert extra.count("--mamba-radix-cache-strategy") == 1 and "extra_buffer" in extra
    assert "--disable-overlap-schedule" not in extra
    off = SGLangServer(["--disable-radix-cache"], cpu=True).args
    assert "--disable-overlap-schedule" in off


def test_cpu_tensor_parallel_ranks_get_core_groups(monkeypatch):
    """SGLang's CPU ranks need SGLANG_CPU_OMP_THREADS_BIND (one '|' group per rank) when there are
    more ranks than NUMA nodes; the launcher sets it for --tp-size > 1 unless the caller did."""
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    one = SGLangServer(["--attention-backend", "dspark"], cpu=True)
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in one.env
    two = SGLangServer(["--attention-backend", "dspark", "--tp-size", "2"], cpu=True)
    groups = two.env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")
    cores = {str(c) for c in os.sched_getaffinity(0)}
    assert len(groups) == 2 and all(g and set(g.split(",")) <= cores for g in groups)
    if len(cores) >= 2:  # ranks get disjoint cores when there are enough
        assert not set(groups[0].split(",")) & set(groups[1].split(","))
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-7|8-15")
    assert SGLangServer(["--tp-size", "2"], cpu=True).env["SGLANG_CPU_OMP_THREADS_BIND"] == "0-7|8-15"


@pytest.mark.parametrize("gamma,ring", [(1, 4), (3, 8), (4, 16), (7, 16), (8, 32)])
def test_replayssm_ring_is_power_of_two_at_least_twice_the_window(gamma, ring):
    args = serving.tiny_model_args(gamma, replayssm=True)
    assert args[args.index("--linear-replayssm-cache-len") + 1] == str(ring)
    assert "--enable-linear-replayssm-spec" in args
    assert args[args.index("--speculative-dspark-block-size") + 1] == str(gamma)


def test_engine_kwargs():
    kw = serving.engine_kwargs(["--device", "cpu", "--disable-overlap-schedule", "--max-total-tokens", "2048"])
    assert kw == {"device": "cpu", "disable_overlap_schedule": True, "max_total_tokens": 2048}


def test_free_ports_are_distinct():
    ports = [serving.find_free_port() for _ in range(5)]
    assert len(set(ports)) == 5


def test_launcher_runs_launch_server_or_the_sglang_serve_cli():
    args = ["--model-path", "m"]
    plain = SGLangServer(args, cpu=False, quiet=True)
    assert plain.command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    cli = SGLangServer(args, cpu=False, quiet=True, launcher="serve")
    assert cli.command[0] == sys.executable and cli.command[-len(cli.args) - 1 :] == ["serve", *cli.args]
    # the -c program runs what SGLang's `sglang` console script names
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="sglang")
    module, func = script.value.split(":")
    assert f"from {module} import {func}" in cli.command[2] and f"sys.exit({func}())" in cli.command[2]
    assert cli.args[:2] == ["--model-path", "m"] and "--port" in cli.args
    with pytest.raises(ValueError, match="launcher 'sglang'"):
        SGLangServer(args, cpu=False, quiet=True, launcher="sglang")


def test_tiny_engine_kwargs_adds_the_cpu_run_without_a_gpu(monkeypatch):
    args = serving.tiny_model_args(3, attention_backend="dspark")
    for name in serving.cpu_env():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(serving, "gpu_available", lambda: False)
    kw = serving.tiny_engine_kwargs(args)
    assert kw["device"] == "cpu" and kw["speculative_draft_attention_backend"] == "triton"
    assert kw["attention_backend"] == "dspark" and "skip_server_warmup" not in kw
    assert {k: os.environ.get(k) for k in serving.cpu_env()} == serving.cpu_env()  # the engine's processes inherit it
    monkeypatch.setattr(serving, "gpu_available", lambda: True)
    assert serving.tiny_engine_kwargs(args) == {k: v for k, v in serving.engine_kwargs(args).items()
                                                if k != "skip_server_warmup"}


@pytest.mark.parametrize("launcher", ["launch_server", "serve"])
def test_a_test_not_marked_e2e_cannot_start_an_sglang_server(tmp_path, launcher):
    """tests/conftest.py keeps the fast loop (``-m "not e2e"``) free of servers: a test without the
    ``e2e`` marker that starts an SGLang server fails at the start, before anything is launched
    (the stand-in servers above, which are not SGLang, start as usual)."""
    server = SGLangServer(["--model-path", str(tmp_path)], cpu=False, quiet=True, log_path=tmp_path / "s.log",
                          startup_timeout=1, launcher=launcher)
    try:
        with pytest.raises(pytest.fail.Exception, match="not marked e2e"):
            server.start()
        assert server.proc is None
    finally:
        server.stop()
