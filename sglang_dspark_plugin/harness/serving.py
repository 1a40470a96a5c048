"""Start and always stop an SGLang server (``python -m sglang.launch_server``, or ``sglang serve``
with ``launcher="serve"``) from Python.

Used by the demo (``python -m sglang_dspark_plugin.harness.demo``), the examples and the e2e tests::

    from sglang_dspark_plugin.harness.serving import SGLangServer, tiny_model_args

    with SGLangServer(tiny_model_args(gamma=3)) as server:   # prints progress while it starts
        print(server.base_url)                                # http://127.0.0.1:<port>
    # here the server's whole process group is gone

What the launcher does:

* runs the server in its **own process group** (``start_new_session``) with stdout/stderr going
  to a log file, and prints a progress line every ``progress_every`` seconds (elapsed time and
  the server's last log line) until ``GET /health`` answers 200 (SGLang answers 503 until its
  warmup is done), the process exits (the log tail is raised in the error), or the startup
  timeout passes;
* **always stops it**: ``SIGTERM`` to the launcher (SGLang then shuts its scheduler and
  detokenizer down and exits in ~3 s), then ``SIGKILL`` to the whole group for whatever is left
  after a grace period. Signalling every process at once instead makes SGLang believe its
  scheduler crashed and spend ~65 s in "crash diagnostics"; killing only the launcher would
  orphan the scheduler and detokenizer. Also done at interpreter exit for servers still running.
* on a machine **without a GPU** it adds what a CPU-only run needs (docs/guide/cpu-testing.md): the
  environment of ``cpu_env()`` and the flags of ``cpu_flags()``; on CUDA it adds nothing.
  The CPU-only SGLang patches themselves (``cpu_support.py``) are installed inside the server's
  processes by the plugin's ``dspark_cpu`` entry point, which ``SGLANG_DSPARK_CPU=1`` turns on.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from ..settings import CPU_ENV, gpu_available
from .tiny_models import TINY, ModelSpec, default_out_dir, ensure_models

# Resource caps for a CPU-only run (each KDA/MLA state slot is tiny, but SGLang sizes its pools
# from free memory otherwise: about 8 GB of KV plus 7 GB of SSM state on a 24 GB machine).
CPU_MAX_TOTAL_TOKENS = 2048
CPU_MAX_MAMBA_CACHE_SIZE = 16  # DSPARK takes 3 state slots per request: 16 keeps 4 running
CPU_MAX_RUNNING_REQUESTS = 4
CPU_CHUNKED_PREFILL_SIZE = 256

# The server's command line before its arguments. "serve" is the ``sglang serve`` CLI, i.e. the
# console script's ``sglang.cli.main:main`` run by this interpreter (it loads the plugins
# itself, after dispatching to its LLM backend).
LAUNCHERS = {
    "launch_server": [sys.executable, "-m", "sglang.launch_server"],
    "serve": [sys.executable, "-c", "import sys; from sglang.cli.main import main; sys.argv[0] = 'sglang'; "
              "sys.exit(main())", "serve"],
}


def cpu_flags(*, speculative: bool, radix_strategy: Optional[str] = None) -> List[str]:
    """Flags a CPU-only SGLang run needs, each for a reason found by running it (docs/guide/cpu-testing.md).

    * ``--device cpu``: no CUDA device.
    * ``--mamba-radix-cache-strategy no_buffer``: the default ``extra_buffer`` asserts platform
      support for Mamba state snapshots (device gate 7 lets it through when the caller asks for
      it: ``radix_strategy``, the caller's own ``--mamba-radix-cache-strategy``).
    * ``--disable-overlap-schedule``: ``no_buffer`` does not support the overlap scheduler. With
      ``extra_buffer`` the overlap scheduler runs, as on a GPU, and is left on.
    * ``--max-total-tokens/--max-mamba-cache-size/--max-running-requests/--chunked-prefill-size``:
      small pools (see the constants above).
    * ``--skip-server-warmup``: under the interpreter SGLang's warmup request costs ~10 s and
      checks nothing the first real request does not.
    * ``--speculative-draft-attention-backend triton`` (speculative runs): the DSPARK draft would
      otherwise inherit the target's name ("dspark"), which is no draft backend, and fall back to
      flashinfer (CUDA-only).
    """
    flags = ["--device", "cpu"]
    if radix_strategy in (None, "no_buffer"):
        flags += ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]
    flags += [
        "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS),
        "--max-mamba-cache-size", str(CPU_MAX_MAMBA_CACHE_SIZE),
        "--max-running-requests", str(CPU_MAX_RUNNING_REQUESTS),
        "--chunked-prefill-size", str(CPU_CHUNKED_PREFILL_SIZE),
        "--skip-server-warmup",
    ]  # fmt: skip
    if speculative:
        flags += ["--speculative-draft-attention-backend", "triton"]
    return flags


def cpu_env(tp_size: int = 1) -> Dict[str, str]:
    """Environment a CPU-only run needs: Triton's interpreter (there is no Triton CPU driver; it
    must be set before Triton kernels are defined, i.e. in the server's environment) and the opt-in
    to the CPU-only SGLang patches (``cpu_support.py``), which SGLang's processes inherit.

    With ``tp_size > 1`` also ``SGLANG_CPU_OMP_THREADS_BIND``: SGLang's CPU ranks refuse to start
    without it when there are more ranks than NUMA nodes (one here); the machine's cores are split
    into ``tp_size`` consecutive groups (a group reuses a core when there are fewer cores than
    ranks), unless the environment already sets it."""
    env = {"TRITON_INTERPRET": "1", CPU_ENV: "1"}
    if tp_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_thread_groups(tp_size)
    return env


def cpu_thread_groups(ranks: int) -> str:
    """``"0|1"``-style core groups, one per rank, for ``SGLANG_CPU_OMP_THREADS_BIND``."""
    cores = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cores) // ranks)
    groups = []
    for rank in range(ranks):
        group = cores[rank * per_rank:(rank + 1) * per_rank] or [cores[rank % len(cores)]]
        groups.append(",".join(str(core) for core in group))
    return "|".join(groups)


def _flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _merge_flags(base: List[str], extra: Sequence[str]) -> List[str]:
    """``base`` plus the flags of ``extra`` that ``base`` does not already set (caller wins)."""
    out = list(base)
    i = 0
    extra = list(extra)
    while i < len(extra):
        flag = extra[i]
        takes_value = i + 1 < len(extra) and not extra[i + 1].startswith("--")
        if flag not in out and not any(a.startswith(flag + "=") for a in out):
            out.append(flag)
            if takes_value:
                out.append(extra[i + 1])
        i += 2 if takes_value else 1
    return out


# SGLang's breakable prefill CUDA graph up to 512 tokens (8 prompts of 64; the served admissions
# are a few prompts). SGLang leaves it off for KDA models unless asked for; eager prefill forwards
# left about half of the served step's GPU idle at c=64 (H200, kimi48, 2026-12-04). On SGLang 0.5.23
# it gives wrong greedy tokens on KDA models, stock included (docs/guide/gpu-serving.md).
PREFILL_GRAPH_ARGS = ("--cuda-graph-backend-prefill", "breakable", "--cuda-graph-max-bs-prefill", "512")


def tiny_model_args(
    gamma: Optional[int] = None,
    *,
    attention_backend: str = "dspark",
    replayssm: bool = False,
    replayssm_cache_len: Optional[int] = None,
    models_dir: Optional[os.PathLike] = None,
    spec: ModelSpec = TINY,
    extra: Iterable[str] = (),
) -> List[str]:
    """``launch_server`` arguments for a bundled test model (``spec``: the tiny Kimi-Linear by
    default), writing its weights first if they are missing. ``gamma`` set = DSPARK speculation
    with block size ``gamma`` and the model's draft; ``replayssm`` adds
    ``--enable-linear-replayssm-spec`` with a ring length of the smallest power of two
    >= 2*(gamma+1) (SGLang's pool check), at least 4."""
    models_dir = Path(models_dir) if models_dir else default_out_dir()
    ensure_models(spec, models_dir, log=lambda msg: print(f"[tiny_models] {msg}", flush=True))
    args = [
        "--model-path", str(models_dir / spec.target_dir),
        "--attention-backend", attention_backend,
        "--trust-remote-code",
    ]  # fmt: skip
    if spec.random_weights:  # configs only: SGLang's random weights, token ids in and out
        args += ["--load-format", "dummy", "--skip-tokenizer-init"]
    if gamma is not None:
        args += [
            "--speculative-algorithm", "DSPARK",
            "--speculative-draft-model-path", str(models_dir / spec.draft_dir),
            "--speculative-dspark-block-size", str(gamma),
            # The draft cannot use "dspark" (no draft backend of that name; SGLang would fall
            # back to flashinfer, CUDA-only); Triton runs the tiny draft everywhere.
            "--speculative-draft-attention-backend", "triton",
        ]  # fmt: skip
        if spec.random_weights:
            args += ["--speculative-draft-load-format", "dummy"]
        if spec.k3:
            # SGLang pins K3's verify backend (nv_cutedsl: its Triton verify below SM100) only for
            # the multimodal wrapper's architecture; without one it refuses compact verify with
            # --enable-linear-replayssm-spec for the text-only K3 stack of the test models.
            args += ["--linear-attn-verify-backend", "triton"]
        if replayssm:
            if replayssm_cache_len is None:
                replayssm_cache_len = max(4, 1 << (2 * (gamma + 1) - 1).bit_length())
            args += [
                "--enable-linear-replayssm-spec",
                "--linear-replayssm-cache-len", str(replayssm_cache_len),
            ]  # fmt: skip
    elif replayssm:
        raise ValueError("replayssm=True needs speculation (gamma)")
    return args + list(extra)


def tiny_engine_kwargs(args: Sequence[str]) -> Dict[str, object]:
    """``sglang.Engine(**kwargs)`` keyword arguments for ``launch_server`` flags of a bundled test
    model (:func:`tiny_model_args`), the Engine's counterpart of what :class:`SGLangServer` adds:
    without a GPU the CPU flags, and the CPU environment set in ``os.environ`` (the Engine's
    scheduler processes inherit it; Triton's interpreter must be on before any kernel is defined).
    ``--skip-server-warmup`` is an HTTP-server option and is dropped."""
    args = list(args)
    if not gpu_available():
        os.environ.update(cpu_env())
        speculative = _flag_value(args, "--speculative-algorithm") is not None
        strategy = _flag_value(args, "--mamba-radix-cache-strategy")
        args = _merge_flags(args, cpu_flags(speculative=speculative, radix_strategy=strategy))
    kwargs = engine_kwargs(args)
    kwargs.pop("skip_server_warmup", None)
    return kwargs


def engine_kwargs(args: Sequence[str]) -> Dict[str, object]:
    """Turn ``launch_server`` flags into ``sglang.Engine(**kwargs)`` keyword arguments
    (``--max-total-tokens 2048`` -> ``max_total_tokens=2048``, a bare ``--flag`` -> True)."""
    out: Dict[str, object] = {}
    args = list(args)
    i = 0
    while i < len(args):
        flag = args[i]
        if not flag.startswith("--"):
            raise ValueError(f"expected a --flag, got {flag!r}")
        key = flag[2:].replace("-", "_")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            value: object = args[i + 1]
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
            out[key] = value
            i += 2
        else:
            out[key] = True
            i += 1
    return out


_ports_handed_out: "set[int]" = set()


def find_free_port() -> int:
    """A free localhost port, never the same twice in this process (servers started in parallel
    bind their port only tens of seconds later)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        # SGLang also binds a few ports right above --port; keep launches well apart.
        if all(abs(port - other) > 20 for other in _ports_handed_out):
            _ports_handed_out.add(port)
            return port
    raise RuntimeError("no free port found")


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message has its log tail."""


_live_servers: "set[SGLangServer]" = set()


@atexit.register
def _stop_leftover_servers() -> None:
    for server in list(_live_servers):
        server.stop()


class SGLangServer:
    """One ``python -m sglang.launch_server`` process group. Use as a context manager, or call
    ``start()``/``stop()`` (``stop()`` is idempotent and safe to call in ``finally``)."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: Optional[int] = None,
        env: Optional[Dict[str, str]] = None,
        cpu: Optional[bool] = None,
        log_path: Optional[os.PathLike] = None,
        startup_timeout: float = 900.0,
        progress_every: float = 10.0,
        stop_grace: float = 15.0,
        name: str = "sglang",
        quiet: bool = False,
        launcher: str = "launch_server",
    ):
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher {launcher!r}: expected one of {sorted(LAUNCHERS)}")
        self.launcher = launcher
        self.host = host
        self.port = port or find_free_port()
        self.cpu = (not gpu_available()) if cpu is None else cpu
        args = list(args)
        if self.cpu:
            speculative = _flag_value(args, "--speculative-algorithm") is not None
            strategy = _flag_value(args, "--mamba-radix-cache-strategy")
            args = _merge_flags(args, cpu_flags(speculative=speculative, radix_strategy=strategy))
        self.args = _merge_flags(args, ["--host", host, "--port", str(self.port)])
        self.env = dict(os.environ)
        if self.cpu:
            tp_size = int(_flag_value(self.args, "--tp-size") or _flag_value(self.args, "--tp") or 1)
            self.env.update(cpu_env(tp_size))
        self.env.update(env or {})
        self.startup_timeout = startup_timeout
        self.progress_every = progress_every
        self.stop_grace = stop_grace
        self.name = name
        self.quiet = quiet
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self.proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()  # start() may run in another thread than stop()
        self._stop_requested = False
        self.pgid: Optional[int] = None  # == the launcher's pid (start_new_session)
        self.startup_seconds: Optional[float] = None

    # -- properties ---------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> List[str]:
        return [*LAUNCHERS[self.launcher], *self.args]

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def _say(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.name}] {msg}", flush=True)

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "SGLangServer":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "SGLangServer":
        """Launch and wait until ``/health`` answers 200 (raises ``ServerStartError``)."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        env_note = " TRITON_INTERPRET=1 (CPU, no GPU)" if self.cpu else ""
        self._say(f"starting:{env_note} {' '.join(self.command)}")
        self._say(f"log: {self.log_path}")
        with self._lock:
            if self._stop_requested:
                raise ServerStartError(f"{self.name} was stopped before it started")
            log = open(self.log_path, "ab", buffering=0)
            try:
                self.proc = subprocess.Popen(
                    self.command,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.env,
                    start_new_session=True,  # own process group: stop() signals all of it
                )
            finally:
                log.close()
            self.pgid = self.proc.pid
            _live_servers.add(self)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        t0 = time.monotonic()
        next_progress = t0 + self.progress_every
        proc = self.proc
        while True:
            now = time.monotonic()
            if self.proc is None:  # stop() was called (e.g. from another thread) meanwhile
                raise ServerStartError(f"{self.name} was stopped during startup")
            if proc.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {proc.returncode} during startup "
                    f"after {now - t0:.0f} s; last log lines:\n{self.log_tail(40)}"
                )
            if self.healthy():
                self.startup_seconds = now - t0
                self._say(f"ready after {self.startup_seconds:.0f} s at {self.base_url}")
                return
            if now - t0 > self.startup_timeout:
                raise ServerStartError(
                    f"{self.name} not healthy after {self.startup_timeout:.0f} s; "
                    f"last log lines:\n{self.log_tail(40)}"
                )
            if now >= next_progress:
                self._say(f"starting... {now - t0:.0f} s | {self.last_log_line()}")
                next_progress += self.progress_every
            time.sleep(1.0)

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Stop the whole process group; idempotent, never raises for a dead server.

        SIGTERM goes to the launcher first: SGLang then drains, stops its scheduler and
        detokenizer and exits within a few seconds. (A SIGTERM to every process at once makes
        the launcher see its scheduler "crash" and sleep into ~65 s of crash diagnostics.)
        Whatever is left of the group after ``stop_grace`` seconds gets SIGKILL."""
        with self._lock:
            self._stop_requested = True
            proc = self.proc
        if proc is None:
            return
        _live_servers.discard(self)
        pgid = self.pgid
        t0 = time.monotonic()
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = t0 + (self.stop_grace if proc.poll() is None else 1.0)
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        killed = _group_alive(pgid)
        if killed:
            _signal_group(pgid, signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        for _ in range(100):
            if not _group_alive(pgid):
                break
            time.sleep(0.1)
        how = "SIGKILL after grace period" if killed else "SIGTERM"
        self._say(f"stopped (process group {pgid}, {how}) in {time.monotonic() - t0:.1f} s")
        with self._lock:
            self.proc = None

    # -- logs ---------------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n: int = 20) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def last_log_line(self) -> str:
        """The server's last timestamped log line (skipping our own /health polls)."""
        lines = [ln.strip() for ln in self.log_text().splitlines() if ln.strip()]
        for line in reversed(lines):
            if line.startswith("[") and "GET /health" not in line:
                return line[:200]
        return lines[-1][:200] if lines else "(no output yet)"

    # -- small HTTP helpers (stdlib only) -----------------------------------------------------

    def post_json(self, path: str, payload: dict, timeout: float = 600.0) -> dict:
        """POST JSON, return the decoded JSON body; HTTP errors raise ``urllib.error.HTTPError``."""
        req = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def get_json(self, path: str, timeout: float = 60.0) -> dict:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as resp:
            return json.loads(resp.read())


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """True while any live (non-zombie) process of group ``pgid`` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover
        return True
    proc = Path("/proc")
    return bool(group_members(pgid)) if proc.is_dir() else True


def live_processes():
    """``(pid, fields)`` of every live (non-zombie) process (Linux /proc; nothing elsewhere), with
    ``fields`` the ``/proc/<pid>/stat`` fields after the command name: state, ppid, pgrp, session, ..."""
    proc = Path("/proc")
    if not proc.is_dir():
        return
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces or parens, split after the last ")"
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 4 and fields[0] != "Z":
            yield int(entry.name), fields


def group_members(pgid: int) -> List[int]:
    """Live (non-zombie) pids of process group ``pgid`` (Linux /proc); for leak checks."""
    return [pid for pid, fields in live_processes() if int(fields[2]) == pgid]
