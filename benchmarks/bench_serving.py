"""Serving benchmark on one GPU: output tokens/s and inter-token latency of real SGLang servers on
the Kimi-Linear-shaped test model (``harness.tiny_models.KIMI32``: 32 KDA heads x 128, 3 KDA + 1
MLA layers), stock SGLang against the plugin, with and without DSPARK speculation.

    python3 benchmarks/bench_serving.py [--gamma 3] [--concurrency 1,8,32,64] [--out DIR] [--plot PNG]

Configurations (``CONFIGS``), every one with CUDA graphs for every batch size it meets, the
overlap scheduler and the same draft: ``stock`` (SGLang's own backend, no speculation),
``stock-dspark`` (SGLang's KDA verify path, snapshot commit), ``stock-dspark-replayssm``,
``dspark`` (our backend, plain decode), ``dspark-dspark`` (our verify, snapshot commit),
``dspark-dspark-replayssm`` (our verify + ReplaySSM fold).

Per configuration and concurrency ``c``: ``c`` clients send requests back to back (``requests =
max(8, 4c)``, each a distinct seeded random prompt of ``--prompt-len`` tokens, exactly
``--output-len`` greedy output tokens, streamed). Reported: output tokens/s (all output tokens /
wall time of the level), median inter-token latency (per request ``(t_last - t_first) / (n - 1)``
over streamed chunks, median over requests), median time to first token, and the speculation
accept length. With ``--profile`` the torch profiler records ``--profile-steps`` steps of every
configuration at ``--profile-concurrency`` and reports the share of GPU kernel time in the KDA
attention core (conv + recurrence / verify / fold kernels, matched by name: ``KDA_KERNEL``).

Servers start in parallel (the GPU and Triton cache are shared); each is measured alone, the
others idle. Writes ``serving.json`` and ``serving.md`` to ``--out`` and a plot with ``--plot``.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from sglang_dspark_plugin.harness import tiny_models  # noqa: E402
from sglang_dspark_plugin.harness.serving import SGLangServer, tiny_model_args  # noqa: E402

# Kernels of the KDA attention core, ours and SGLang's (conv, recurrence, verify, fold, snapshot
# copies of conv windows); projections, norms and the output gate of KDA layers are not counted.
KDA_KERNEL = re.compile(
    r"kda|delta_rule|conv1d|replayssm|mtp_verify|_verify_(prep|stream|finish)_kernel|^_decode_kernel"
    r"|copy_conv_windows|_fold_kernel|gating_verify",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Config:
    name: str
    backend: str  # "dspark" or "stock"
    speculative: bool
    replayssm: bool = False


CONFIGS = [
    Config("stock", "stock", False),
    Config("stock-dspark", "stock", True),
    Config("stock-dspark-replayssm", "stock", True, True),
    Config("dspark", "dspark", False),
    Config("dspark-dspark", "dspark", True),
    Config("dspark-dspark-replayssm", "dspark", True, True),
]


def server_args(cfg: Config, args) -> List[str]:
    from sglang_dspark_plugin.plugin import full_attention_delegate

    max_c = max(args.concurrency)
    graph_bs = sorted({1, 2, 4, 8, *range(16, max_c + 1, 8)})
    extra = [
        "--cuda-graph-bs-decode", *map(str, graph_bs),
        "--max-running-requests", str(max_c),
        "--max-mamba-cache-size", str(8 * max_c),
        "--max-total-tokens", str(4 * max_c * (args.prompt_len + args.output_len)),
        "--sampling-backend", "pytorch",
    ]  # fmt: skip
    backend = full_attention_delegate() if cfg.backend == "stock" else "dspark"
    return tiny_model_args(
        args.gamma if cfg.speculative else None,
        spec=tiny_models.SPECS[args.model],
        attention_backend=backend,
        replayssm=cfg.replayssm,
        extra=extra,
    )


def _prompts(n: int, length: int, seed: int) -> List[List[int]]:
    import torch

    emittable = tiny_models.emittable_tokens().nonzero().flatten()
    gen = torch.Generator().manual_seed(seed)
    return emittable[torch.randint(len(emittable), (n, length), generator=gen)].tolist()


def _stream_one(base_url: str, ids: List[int], output_len: int) -> dict:
    """One streamed greedy /generate; chunk arrival times and the final meta_info."""
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    req = urllib.request.Request(
        base_url + "/generate", data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    t0 = time.perf_counter()
    times, counts, meta = [], [], {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            meta = chunk.get("meta_info", meta)
            times.append(time.perf_counter() - t0)
            counts.append(meta.get("completion_tokens", 0))
    n = counts[-1] if counts else 0
    first = next((t for t, c in zip(times, counts) if c > 0), None)
    itl = (times[-1] - first) / (n - 1) if first is not None and n > 1 else None
    return {"tokens": n, "ttft": first, "itl": itl, "accept": meta.get("spec_accept_length")}


def measure_level(base_url: str, prompts: List[List[int]], concurrency: int, output_len: int) -> dict:
    """``concurrency`` clients draining ``prompts`` back to back."""
    queue = list(prompts)
    lock = threading.Lock()
    rows: List[dict] = []

    def client():
        while True:
            with lock:
                if not queue:
                    return
                ids = queue.pop()
            rows.append(_stream_one(base_url, ids, output_len))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in rows)
    accepts = [r["accept"] for r in rows if r["accept"]]
    return {
        "concurrency": concurrency,
        "requests": len(rows),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "median_itl_ms": 1e3 * statistics.median([r["itl"] for r in rows if r["itl"] is not None]),
        "median_ttft_ms": 1e3 * statistics.median([r["ttft"] for r in rows if r["ttft"] is not None]),
        "accept_length": statistics.mean(accepts) if accepts else None,
        "short_requests": sum(r["tokens"] != output_len for r in rows),
    }


def kda_share(trace_dir: str) -> dict:
    """Share of GPU kernel time in KDA-core kernels over every trace file under ``trace_dir``."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True)
    total = kda = 0.0
    names: Dict[str, float] = {}
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for ev in events:
            if ev.get("cat") != "kernel":
                continue
            dur = float(ev.get("dur", 0.0))
            total += dur
            if KDA_KERNEL.search(ev.get("name", "")):
                kda += dur
                names[ev["name"]] = names.get(ev["name"], 0.0) + dur
    return {
        "trace_files": len(files),
        "kernel_us": total,
        "kda_us": kda,
        "kda_share": kda / total if total else None,
        "kda_kernels_us": dict(sorted(names.items(), key=lambda kv: -kv[1])[:12]),
    }


def profile(server: SGLangServer, prompts: List[List[int]], args, out_dir: str) -> dict:
    """Torch-profile ``--profile-steps`` steps at ``--profile-concurrency`` under load."""
    os.makedirs(out_dir, exist_ok=True)
    done = threading.Event()
    load = threading.Thread(
        target=lambda: (measure_level(server.base_url, prompts, args.profile_concurrency, args.output_len), done.set())
    )
    load.start()
    time.sleep(2.0)  # past prefill, into steady decode / verify
    server.post_json("/start_profile", {"output_dir": out_dir, "num_steps": args.profile_steps, "activities": ["GPU"]})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not glob.glob(os.path.join(out_dir, "**", "*.json*"), recursive=True):
        time.sleep(1.0)
    time.sleep(3.0)  # let the writer finish
    load.join()
    return kda_share(out_dir)


def run_config(cfg: Config, args, prompts: Dict[int, List[List[int]]], gate: threading.Semaphore,
               start_gate: threading.Semaphore, log_dir: str) -> dict:  # fmt: skip
    """Start (in parallel with the others), then measure alone (``gate``), then stop."""
    row: dict = {"config": cfg.__dict__, "levels": []}
    server = SGLangServer(server_args(cfg, args), log_path=os.path.join(log_dir, f"{cfg.name}.log"),
                          name=cfg.name, startup_timeout=1200, progress_every=60)  # fmt: skip
    try:
        with start_gate:
            server.start()
        row["startup_s"] = server.startup_seconds
        with gate:
            warm = prompts[max(args.concurrency)][: max(args.concurrency)]
            measure_level(server.base_url, warm, max(args.concurrency), 8)  # warm every batch size
            for c in args.concurrency:
                level = measure_level(server.base_url, prompts[c], c, args.output_len)
                print(f"[{cfg.name}] c={c}: {level['tokens_per_s']:.0f} tok/s, ITL {level['median_itl_ms']:.2f} ms, "
                      f"accept {level['accept_length']}", flush=True)  # fmt: skip
                row["levels"].append(level)
            if args.profile:
                row["profile"] = profile(server, prompts[args.profile_concurrency], args,
                                         os.path.join(log_dir, f"profile-{cfg.name}"))  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - recorded in the results
        row["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
        print(f"[{cfg.name}] ERROR {row['error']}", flush=True)
    finally:
        server.stop()
    return row


def render(result: dict) -> str:
    """Markdown table: tokens/s (x stock without speculation) and median ITL per concurrency."""
    levels = result["args"]["concurrency"]
    head = ["config"] + [f"c={c} tok/s" for c in levels] + [f"c={c} ITL ms" for c in levels]
    head += ["accept length", "KDA share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    stock = {lv["concurrency"]: lv["tokens_per_s"] for lv in result["runs"].get("stock", {}).get("levels", [])}
    for name, row in result["runs"].items():
        if row.get("error"):
            lines.append(f"| {name} | error: {row['error'][:100]} |")
            continue
        by_c = {lv["concurrency"]: lv for lv in row["levels"]}
        tps = [
            f"{by_c[c]['tokens_per_s']:.0f}" + (f" ({by_c[c]['tokens_per_s'] / stock[c]:.2f}x)" if stock.get(c) else "")
            for c in levels
        ]
        itl = [f"{by_c[c]['median_itl_ms']:.2f}" for c in levels]
        accepts = [lv["accept_length"] for lv in row["levels"] if lv["accept_length"]]
        accept = f"{statistics.mean(accepts):.2f}" if accepts else "-"
        share = (row.get("profile") or {}).get("kda_share")
        lines.append("| " + " | ".join([name, *tps, *itl, accept, f"{share:.0%}" if share is not None else "-"]) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in result["runs"].items():
        if row.get("levels"):
            xs = [lv["concurrency"] for lv in row["levels"]]
            ax.plot(xs, [lv["tokens_per_s"] for lv in row["levels"]], marker="o", label=name,
                    linestyle="-" if name.startswith("dspark") else "--")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    a = result["args"]
    ax.set_title(f"{a['model']} test model, {result['device']}, gamma={a['gamma']}, {a['output_len']} output tokens")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(tiny_models.SPECS), default="kimi32", help="tiny: CPU dry run")
    p.add_argument("--gamma", type=int, default=3)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    p.add_argument("--parallel-starts", type=int, default=6)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-concurrency", type=int, default=32)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--log-dir", default="/tmp/bench-serving")
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)

    import torch

    os.makedirs(args.log_dir, exist_ok=True)
    tiny_models.ensure_models(tiny_models.SPECS[args.model], log=lambda m: print(f"[models] {m}", flush=True))
    prompts = {c: _prompts(max(8, 4 * c), args.prompt_len, seed=1000 + c) for c in set(args.concurrency)}
    if args.profile:
        c = args.profile_concurrency
        prompts.setdefault(c, _prompts(max(8, 4 * c), args.prompt_len, seed=1000 + c))
    chosen = [c for c in CONFIGS if c.name in args.configs.split(",")]
    gate, start_gate = threading.Semaphore(1), threading.Semaphore(args.parallel_starts)
    with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
        futures = {c.name: pool.submit(run_config, c, args, prompts, gate, start_gate, args.log_dir) for c in chosen}
        runs = {name: f.result() for name, f in futures.items()}
    result = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "sglang": __import__("sglang").__version__,
        "driver": subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip() if torch.cuda.is_available() else None,
        "args": vars(args),
        "runs": runs,
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "serving.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = render(result)
    with open(os.path.join(args.out, "serving.md"), "w") as f:
        f.write(table + "\n")
    if args.plot:
        plot(result, args.plot)
    print(table)
    return 0 if not any(r.get("error") for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
