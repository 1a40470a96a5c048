"""benchmarks/bench_serving.py without a server: the KDA share of a profiler trace, the summary of
measurement rounds, and the rendered table."""

import gzip
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

bench_serving = pytest.importorskip("bench_serving")


def _trace(path, kernels, gap=None):
    """A trace file of GPU kernels; with ``gap``, timed: laid end to end, ``gap`` us apart."""
    events = [{"cat": "kernel", "name": name, "dur": dur} for name, dur in kernels]
    if gap is not None:
        t = 0.0
        for ev in events:
            ev["ts"] = t
            t += ev["dur"] + gap
    events.append({"cat": "cpu_op", "name": "_mtp_verify_kernel", "dur": 1000.0})  # not a GPU kernel
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_kda_share_counts_only_kda_core_kernels(tmp_path):
    _trace(tmp_path / "a-TP-0.trace.json.gz", [
        ("_verify_prep_kernel", 30.0), ("_verify_stream_kernel", 20.0), ("_replayssm_fold_kernel", 10.0),
        ("_verify_prep_kernel", 6.0), ("_commit_records_kernel", 2.0), ("_materialize_records_kernel", 1.0),
        ("fused_recurrent_kda_packed_decode_kernel", 5.0), ("_causal_conv1d_update_kernel", 5.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 100.0), ("flash_fwd_kernel", 30.0),
    ])  # fmt: skip
    share = bench_serving.kda_share(str(tmp_path))
    assert share["trace_files"] == 1
    assert share["kernel_us"] == pytest.approx(209.0)
    assert share["kda_us"] == pytest.approx(79.0)
    assert share["kda_share"] == pytest.approx(79.0 / 209.0)
    assert share["kda_kernels_us"]["_verify_prep_kernel"] == pytest.approx(36.0)
    assert share["kda_kernel_calls"]["_verify_prep_kernel"] == 2
    assert share["kda_kernel_calls"]["_verify_stream_kernel"] == 1
    assert set(share["kda_kernels_us"]) == {
        "_verify_prep_kernel", "_verify_stream_kernel", "_replayssm_fold_kernel",
        "fused_recurrent_kda_packed_decode_kernel", "_causal_conv1d_update_kernel",
        "_commit_records_kernel", "_materialize_records_kernel",
    }  # fmt: skip


def test_kda_step_time_counts_decode_and_verify_forwards_and_leaves_out_prefills(tmp_path):
    # 2 KDA layers; 3 verify forwards (6 streaming launches, 6 preps, 3 folds) and one prefill
    # (chunked KDA + prompt conv on both layers): 3 steps of (6 * 20 + 6 * 10 + 3 * 30) / 3 us
    verify = [("_verify_stream_kernel", 20.0)] * 6 + [("_verify_prep_kernel", 10.0)] * 6
    verify += [("_replayssm_fold_kernel", 30.0)] * 3
    prefill = [("chunk_kda_fwd_kernel_inter_solve_fused", 50.0), ("kda_gate_chunk_cumsum_vector_kernel", 5.0),
               ("_causal_conv1d_fwd_kernel", 7.0)] * 2
    _trace(tmp_path / "a-TP-0.trace.json.gz", verify + prefill + [("sm90_xmma_gemm_bf16bf16_bf16f32", 100.0)])
    share = bench_serving.kda_share(str(tmp_path), kda_layers=2)
    assert share["kda_steps"] == 3
    assert share["kda_step_us"] == pytest.approx((6 * 20.0 + 6 * 10.0 + 3 * 30.0) / 3)
    # SGLang's own verify kernel counts the same way; without the layer count there is no per-step time
    _trace(tmp_path / "a-TP-0.trace.json.gz", [("fused_sigmoid_gating_delta_rule_update_kernel", 40.0)] * 8
           + [("kda_replayssm_exact_fold_kernel", 60.0)] * 2)
    assert bench_serving.kda_share(str(tmp_path), kda_layers=4)["kda_step_us"] == pytest.approx((8 * 40 + 2 * 60) / 2)
    assert bench_serving.kda_share(str(tmp_path))["kda_step_us"] is None


def test_gpu_busy_share_is_the_union_of_kernel_intervals_over_the_span(tmp_path):
    # kernels at [0, 10), [5, 15) (overlapping: counted once), [40, 50): busy 25 of a 50 us span
    events = [{"cat": "kernel", "name": n, "ts": ts, "dur": 10.0} for n, ts in (("a", 0.0), ("b", 5.0), ("c", 40.0))]
    events += [{"cat": "cpu_op", "name": "aten::copy_", "ts": 16.0, "dur": 7.0},
               {"cat": "cpu_op", "name": "aten::copy_", "ts": 30.0, "dur": 3.0},
               {"cat": "user_annotation", "name": "commit", "ts": 15.0, "dur": 20.0},
               {"cat": "python_function", "name": "sglang_dspark_plugin/commit.py(60): commit_verified_states",
                "ts": 15.0, "dur": 4.0}]
    with open(tmp_path / "t.trace.json", "w") as f:
        json.dump({"traceEvents": events}, f)
    share = bench_serving.kda_share(str(tmp_path))
    assert share["kernel_us"] == pytest.approx(30.0)
    assert share["span_us"] == pytest.approx(50.0)
    assert share["gpu_busy_us"] == pytest.approx(25.0)
    assert share["gpu_busy_share"] == pytest.approx(0.5)
    assert share["host_top_us"] == {"commit": 20.0, "aten::copy_": 10.0,
                                    "sglang_dspark_plugin/commit.py(60): commit_verified_states": 4.0}
    assert share["host_kda_us"] == {"sglang_dspark_plugin/commit.py(60): commit_verified_states": 4.0}
    # the one idle stretch, [15, 40), lies after b (the kernel that ended last) and before c
    assert share["idle_gaps_us"] == {"b -> c": {"us": 25.0, "count": 1}}
    assert share["idle_by_gap_size_us"]["5-50 us"] == {"us": 25.0, "count": 1}
    assert sum(size["us"] for size in share["idle_by_gap_size_us"].values()) == pytest.approx(25.0)


def test_idle_gaps_are_charged_to_the_kernel_that_ended_last_and_add_up_to_span_minus_busy():
    # "short" runs inside "long" and ends first: the gap after them belongs to "long"; overlapping
    # kernels leave no gap; two gaps between the same kernels add up
    kernels = [(0.0, 20.0, "long"), (2.0, 5.0, "short"), (26.0, 30.0, "verify"), (29.0, 31.0, "commit"),
               (40.0, 45.0, "long"), (50.0, 51.0, "verify"), (52.0, 53.0, "commit")]
    gaps = bench_serving.idle_gaps(kernels)
    assert gaps == {"long -> verify": [11.0, 2], "commit -> long": [9.0, 1], "verify -> commit": [1.0, 1]}
    span = max(b for _, b, _ in kernels) - min(a for a, _, _ in kernels)
    busy = bench_serving._union_us([(a, b) for a, b, _ in kernels])
    assert sum(us for us, _ in gaps.values()) == pytest.approx(span - busy)
    # by size: the gaps are 6, 9, 5 (a bound belongs to the class above it) and 1 us
    assert bench_serving.gap_sizes(kernels) == {"< 5 us": [1.0, 1], "5-50 us": [20.0, 3], "50-500 us": [0.0, 0],
                                                ">= 500 us": [0.0, 0]}


def _python_frame(name, ts, dur, tid=1):
    """A ``python_function`` event of a ``--profile-cpu`` trace."""
    return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_host_waits_are_attributed_to_the_innermost_sglang_frames(tmp_path):
    """A host wait for the GPU (a CUDA runtime synchronize) is charged to the SGLang / plugin Python
    frames around it on its thread, innermost first; torch frames are skipped, other threads and
    non-waiting runtime calls are not counted."""
    def rt(name, ts, dur, tid=1):
        return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        _python_frame("sglang/srt/managers/scheduler.py(10): event_loop", 0.0, 1000.0),
        _python_frame("sglang/srt/managers/overlap_utils.py(587): resolve_seq_lens_cpu", 100.0, 300.0),
        _python_frame("torch/cuda/streams.py(5): synchronize", 150.0, 200.0),
        rt("cudaStreamSynchronize", 160.0, 180.0),
        _python_frame("sglang_dspark_plugin/commit.py(60): commit_verified_states", 500.0, 100.0),
        rt("cudaLaunchKernel", 510.0, 5.0),  # not a wait
        rt("cudaEventSynchronize", 520.0, 30.0),
        rt("cudaStreamSynchronize", 700.0, 40.0),  # only the event loop around it
        rt("cudaStreamSynchronize", 50.0, 70.0, tid=2),  # a thread without Python frames
    ]
    waits = bench_serving.host_waits(events, depth=2)
    assert waits == {
        "sglang/srt/managers/overlap_utils.py(587): resolve_seq_lens_cpu <- "
        "sglang/srt/managers/scheduler.py(10): event_loop": [180.0, 1],
        "sglang_dspark_plugin/commit.py(60): commit_verified_states <- "
        "sglang/srt/managers/scheduler.py(10): event_loop": [30.0, 1],
        "sglang/srt/managers/scheduler.py(10): event_loop": [40.0, 1],
        "(no SGLang frame)": [70.0, 1],
    }
    with open(tmp_path / "t.trace.json", "w") as f:
        json.dump({"traceEvents": events}, f)
    summary = bench_serving.kda_share(str(tmp_path))["host_waits_us"]
    assert list(summary)[0].startswith("sglang/srt/managers/overlap_utils.py(587)")  # largest first
    assert summary["(no SGLang frame)"] == {"us": 70.0, "count": 1}


def test_gpu_idle_is_charged_to_the_host_frames_of_the_thread_that_launched_the_next_kernel(tmp_path):
    """Each gap of 50 us or more is charged to the SGLang / plugin frames open at its midpoint on
    the thread whose CUDA runtime or driver call launched the kernel that ended it (Triton launches
    through the driver only); shorter gaps and the time before the first kernel are not counted,
    and a kernel without a traced launch says so."""
    def kernel(ts, dur, correlation):
        return {"cat": "kernel", "name": f"k{correlation}", "ts": ts, "dur": dur, "args": {"correlation": correlation}}

    def launch(correlation, ts, tid=1, cat="cuda_runtime"):
        name = {"cuda_runtime": "cudaLaunchKernel", "cuda_driver": "cuLaunchKernelEx"}[cat]
        return {"cat": cat, "name": name, "ts": ts, "dur": 2.0, "tid": tid, "args": {"correlation": correlation}}

    loop, verify = "sglang/srt/managers/scheduler.py(10): event_loop", "sglang/srt/speculative/worker.py(99): verify"
    commit, detok = "sglang_dspark_plugin/commit.py(60): commit_verified_states", "sglang/srt/managers/detok.py(5): loop"
    events = [
        _python_frame(loop, 0.0, 1000.0), _python_frame(verify, 100.0, 300.0), _python_frame(commit, 500.0, 120.0),
        _python_frame("torch/nn/modules/module.py(1): _call_impl", 510.0, 90.0),  # not an SGLang frame
        _python_frame(detok, 0.0, 1100.0, tid=2),
        kernel(60.0, 10.0, 1),    # 60 us after the trace starts: not a gap
        kernel(200.0, 10.0, 2),   # gap [70, 200): midpoint 135, inside verify
        kernel(230.0, 10.0, 3),   # a 20 us gap: a launch gap, not counted
        kernel(800.0, 10.0, 4),   # gap [240, 800): midpoint 520, inside commit (the torch frame skipped)
        kernel(900.0, 5.0, 5),    # gap [810, 900): no traced launch
        kernel(1000.0, 5.0, 6),   # gap [905, 1000): a Triton launch (driver only) from thread 2
        {"cat": "kernel", "name": "memcpy", "ts": 1010.0, "dur": 2.0},  # no correlation at all
        kernel(1100.0, 5.0, 7),   # gap [1012, 1100) after it: no frame open on thread 1 then
    ] + [launch(c, 50.0 * c) for c in (1, 2, 3, 4)] + [launch(6, 990.0, tid=2, cat="cuda_driver"), launch(7, 1090.0)]
    gaps = bench_serving.host_gaps(events, depth=2)
    assert gaps == {f"{verify} <- {loop}": [130.0, 1], f"{commit} <- {loop}": [560.0, 1],
                    "(launch not traced)": [90.0, 1], detok: [95.0, 1], "(no SGLang frame)": [88.0, 1]}
    # by phase: the outermost SGLang frames below the event loop, outermost first (a thread
    # without an event loop frame keeps all of its frames)
    phases = bench_serving.host_gaps(events, depth=1, outer=True)
    assert phases == {verify: [130.0, 1], commit: [560.0, 1], "(launch not traced)": [90.0, 1], detok: [95.0, 1],
                      "(no SGLang frame)": [88.0, 1]}
    with open(tmp_path / "t.trace.json", "w") as f:
        json.dump({"traceEvents": events}, f)
    summary = bench_serving.kda_share(str(tmp_path))["host_gaps_us"]
    assert list(summary)[0] == f"{commit} <- {loop}"  # largest first, depth 3 (no third SGLang frame here)
    phases = bench_serving.kda_share(str(tmp_path))["host_gap_phases_us"]
    assert list(phases)[0] == commit  # below the event loop, depth HOST_PHASE_DEPTH
    # a trace without host frames (GPU activity only) has nothing to charge
    with open(tmp_path / "t.trace.json", "w") as f:
        json.dump({"traceEvents": [ev for ev in events if ev["cat"] != "python_function"]}, f)
    assert bench_serving.kda_share(str(tmp_path))["host_gaps_us"] == {}


def test_summary_is_the_median_of_rounds_with_spread():
    samples = [
        {"tokens_per_s": tps, "median_itl_ms": itl, "median_ttft_ms": 10.0, "accept_length": acc}
        for tps, itl, acc in ((100.0, 3.0, 2.0), (300.0, 1.0, 2.5), (200.0, 2.0, None))
    ]
    (level,) = bench_serving.summarize({"samples": {"8": samples}})
    assert (level["concurrency"], level["rounds"]) == (8, 3)
    assert (level["tokens_per_s"], level["tokens_per_s_min"], level["tokens_per_s_max"]) == (200.0, 100.0, 300.0)
    assert level["median_itl_ms"] == 2.0
    assert level["accept_length"] == pytest.approx(2.25)
    assert (level["decode_tok_s"], level["decode_intervals"]) == (None, 0)  # rounds from before the log parse
    # the server's pure decode intervals of all rounds pooled: the median of 7 values, not of round medians
    for s, found in zip(samples, ([10.0, 20.0, 30.0], [], [40.0, 50.0, 60.0, 70.0])):
        s["decode_intervals_tok_s"] = found
    (level,) = bench_serving.summarize({"samples": {"8": samples}})
    assert (level["decode_tok_s"], level["decode_intervals"]) == (40.0, 7)


def _decode_line(running, tok_s, extra=""):
    return (f"[2026-12-04 20:25:27] Decode batch{extra}, #running-req: {running}, #full token: 8310, "
            f"full token usage: 0.07, mamba num: 128, mamba usage: 0.25, cuda graph: True, "
            f"gen throughput (token/s): {tok_s:.2f}, #queue-req: 0")


def _prefill_line(new_seq):
    return (f"[2026-12-04 20:25:26] Prefill batch, #new-seq: {new_seq}, #new-token: 4032, #cached-token: 0, "
            f"#running-req: 1, #queue-req: 0, cuda graph: False, input throughput (token/s): 21911.53")


def test_decode_intervals_are_the_full_batch_intervals_without_a_prefill():
    log = "\n".join([
        _prefill_line(1), _prefill_line(63),
        _decode_line(64, 126.78),  # its interval holds the prefills: left out
        _decode_line(64, 6258.17),  # pure, full batch
        _decode_line(64, 6074.49, extra=" [812]"),  # SGLANG_LOG_FORWARD_ITERS form
        "[2026-12-04 20:25:28] some other scheduler line",
        _decode_line(64, 5907.26).replace("cuda graph: True, ", "accept len: 1.12, accept rate: 0.04, cuda graph: True, "),
        _prefill_line(1),
        _decode_line(64, 3523.73),  # after a prefill: left out
        _decode_line(63, 6100.00),  # one request short: left out
        _decode_line(64, 6200.00),  # the previous line was not at the full batch: left out
        _decode_line(64, 6300.00),  # pure again
    ])  # fmt: skip
    assert bench_serving.decode_intervals(log, 64) == [6258.17, 6074.49, 5907.26, 6300.00]
    assert bench_serving.decode_intervals(log, 63) == []
    assert bench_serving.decode_intervals("", 64) == []


def test_table_shows_speedup_over_stock_and_errors():
    level = lambda c, tps: {"concurrency": c, "tokens_per_s": tps, "median_itl_ms": 2.0, "accept_length": None}  # noqa: E731
    result = {
        "args": {"concurrency": [1, 8]},
        "runs": {
            "stock": {"levels": [level(1, 100.0), level(8, 400.0)]},
            "dspark": {"levels": [level(1, 150.0), level(8, 400.0)], "profile": {"kda_share": 0.25, "gpu_busy_share": 0.6,
                                                                       "kda_step_us": 2981.4}},
            "stock-dspark": {"error": "ServerStartError: boom", "levels": []},
        },
    }
    result["runs"]["dspark"]["levels"][1].update(decode_tok_s=7610.4, decode_intervals=412)
    table = bench_serving.render(result).splitlines()
    assert table[0].startswith("| config | c=1 tok/s | c=8 tok/s | c=1 ITL ms | c=8 ITL ms | c=1 decode tok/s")
    assert "| dspark | 150 (1.50x) | 400 (1.00x) | 2.00 | 2.00 | - | 7610 (412) | - | 25% | 2981 | 60% |" in table
    assert any(row.startswith("| stock-dspark | error: ServerStartError: boom") for row in table)


def test_warmup_rounds_are_served_in_full_but_not_recorded(monkeypatch, tmp_path):
    served = []  # (seed, concurrency, requests, output_len) of every level the client served
    log = tmp_path / "server.log"

    def fake_level(server, args, *, concurrency, num_prompts, output_len, seed, name):
        served.append((seed, concurrency, num_prompts, output_len))
        # the server logs two full-batch decode intervals of this level (the first follows a prefill)
        with open(log, "a") as f:
            f.write("\n".join([_prefill_line(concurrency), _decode_line(concurrency, 1.0),
                               _decode_line(concurrency, 100.0 * len(served))]) + "\n")
        return {"tokens_per_s": float(len(served)), "median_itl_ms": 1.0, "accept_length": None}

    monkeypatch.setattr(bench_serving, "measure_level", fake_level)

    class Server:
        base_url = "http://x"
        log_path = log

    runs = {"a": {"server": Server(), "samples": {}}, "dead": {"server": None, "samples": {}}}
    args = type("Args", (), {"concurrency": [2, 4], "prompt_len": 8, "output_len": 32, "repeats": 2, "warmup_rounds": 1})
    bench_serving.measure_all(runs, args, save=lambda: None)
    # the batch-size warm-up (8 tokens), one full-length warm-up round per level, then the rounds
    assert served[0] == (7, 4, 4, 8)
    warm = served[1:3]
    assert [(c, n, out) for _, c, n, out in warm] == [(2, 16, 32), (4, 32, 32)]  # max(16, 8c) requests
    measured = served[3:]
    assert [s for s, _, _, _ in measured] == [1002, 1004, 2002, 2004]  # seeds 1000 r + c, as before
    assert not {s for s, _, _, _ in warm} & {s for s, _, _, _ in measured}
    # only the measured rounds are recorded, in order
    assert [x["tokens_per_s"] for x in runs["a"]["samples"]["2"]] == [4.0, 6.0]
    assert [x["tokens_per_s"] for x in runs["a"]["samples"]["4"]] == [5.0, 7.0]
    # each recorded level keeps the pure decode intervals its server logged while it ran, no others
    assert [x["decode_intervals_tok_s"] for x in runs["a"]["samples"]["2"]] == [[400.0], [600.0]]
    assert [x["decode_intervals_tok_s"] for x in runs["a"]["samples"]["4"]] == [[500.0], [700.0]]
    assert runs["dead"]["samples"] == {}


compare_serving = pytest.importorskip("compare_serving")


def _serving_json(path, runs, machine=None):
    result = {"runs": {name: {"samples": {"64": [{"tokens_per_s": t} for t in tps]}} for name, tps in runs.items()}}
    if machine is not None:
        result["machine"] = machine
    with open(path, "w") as f:
        json.dump(result, f)
    return str(path)


def test_compare_pairs_rounds_and_says_faster_only_beyond_two_standard_errors(tmp_path):
    base = [100.0, 200.0, 300.0, 400.0]
    r = compare_serving.compare(base, [b * k for b, k in zip(base, (1.10, 1.12, 1.09, 1.11))])
    # by hand: ratios 1.10, 1.12, 1.09, 1.11; mean 1.105; sample variance 0.0005 / 3
    assert r["mean_ratio"] == pytest.approx(1.105)
    assert r["se"] == pytest.approx((0.0005 / 3) ** 0.5 / 2)
    assert r["median_ratio"] == pytest.approx(1.105)
    assert r["ratio_of_medians"] == pytest.approx((224.0 + 327.0) / 2 / 250.0)  # new: 110, 224, 327, 444
    assert r["verdict"] == "faster"
    assert compare_serving.compare(base, [b * 0.9 for b in base])["verdict"] == "slower"
    noisy = compare_serving.compare(base, [b * k for b, k in zip(base, (1.2, 0.9, 1.15, 0.95))])
    assert noisy["verdict"] == "not resolved"
    # --skip leaves out the first rounds of both; one pair has no spread; no pair is an error
    assert compare_serving.compare(base, [1.0, 2.0, 330.0, 440.0], skip=2)["ratios"] == pytest.approx([1.1, 1.1])
    one = compare_serving.compare(base, [1.0, 2.0, 3.0, 480.0], skip=3)
    assert one["mean_ratio"] == pytest.approx(1.2) and math.isnan(one["se"])
    assert one["verdict"] == "not resolved (one round)"
    with pytest.raises(ValueError, match="at least 1"):
        compare_serving.compare(base, base, skip=4)


def test_compare_reads_a_named_configuration_and_says_which_exist(tmp_path, capsys):
    one = _serving_json(tmp_path / "one.json", {"fold": [100.0, 110.0, 90.0]})
    two = _serving_json(tmp_path / "two.json", {"stock": [1.0, 1.0, 1.0], "lazy": [105.0, 112.0, 95.0]})
    assert compare_serving.main([one, f"{two}:lazy"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | 90 | 95 | 1.056 |" in out
    assert "lazy / fold" in out
    with pytest.raises(SystemExit, match="name one as"):
        compare_serving.main([one, two])
    with pytest.raises(SystemExit, match="no configuration 'eager'"):
        compare_serving.main([one, f"{two}:eager"])
    with pytest.raises(SystemExit, match="no rounds at concurrency 8"):
        compare_serving.main([one, f"{two}:lazy", "--concurrency", "8"])


def test_compare_also_pairs_the_servers_pure_decode_intervals(tmp_path, capsys):
    def run(tps, intervals):
        return {"samples": {"64": [{"tokens_per_s": t, "decode_intervals_tok_s": f} for t, f in zip(tps, intervals)]}}

    path = tmp_path / "both.json"
    with open(path, "w") as f:
        json.dump({"runs": {
            "stock": run([100.0, 100.0], [[6900.0, 7000.0, 6800.0], [7000.0, 7100.0]]),
            "ours": run([101.0, 99.0], [[7600.0, 7800.0, 7700.0], [7700.0, 7600.0, 7800.0, 7900.0]]),
            "old": {"samples": {"64": [{"tokens_per_s": 100.0}, {"tokens_per_s": 100.0}]}},
        }}, f)  # fmt: skip
    assert compare_serving.decode_rounds_of(compare_serving.load_run(f"{path}:stock"), 64) == [6900.0, 7050.0]
    assert compare_serving.main([f"{path}:stock", f"{path}:ours"]) == 0
    out = capsys.readouterr().out
    # by hand: round medians 6900 / 7700 and 7050 / 7750; ratios 1.116, 1.099
    assert "server's pure decode intervals (full batch, no prefill; median per round): 1.116 1.099;" in out
    assert "ratio of medians 1.108" in out
    # a run from before the log parse, or a round without intervals, says so instead
    assert compare_serving.main([f"{path}:old", f"{path}:ours"]) == 0
    assert "server's pure decode intervals: not recorded in every round of both runs" in capsys.readouterr().out


def test_ring_length_and_radix_cache_flags_reach_the_server_arguments():
    import argparse

    from sglang.srt.server_args import ServerArgs

    by_name = {c.name: c for c in bench_serving.CONFIGS}
    lazy, stock = by_name["dspark-dspark-replayssm"], by_name["stock"]

    def flags(cfg, *argv):
        return bench_serving.server_args(cfg, bench_serving.build_parser().parse_args(["--model", "kimi48", *argv]))

    default = flags(lazy, "--concurrency", "64")
    assert default[default.index("--linear-replayssm-cache-len") + 1] == "8"  # gamma 3: 2 windows
    assert "--disable-radix-cache" not in default
    chosen = flags(lazy, "--concurrency", "192", "--ring-len", "16", "--disable-radix-cache")
    assert chosen[chosen.index("--linear-replayssm-cache-len") + 1] == "16"
    assert "--disable-radix-cache" in chosen
    assert "--linear-replayssm-cache-len" not in flags(stock, "--ring-len", "16")  # no spec ReplaySSM there
    # SGLang 0.5.23's launch_server reads both flags
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--linear-replayssm-cache-len", "16", "--disable-radix-cache"])
    assert (ns.linear_replayssm_cache_len, ns.disable_radix_cache) == (16, True)
    # the prefill-graph configurations add SGLang's breakable prefill graph, which it parses
    graph = flags(by_name["dspark-dspark-replayssm-eager-prefill-graph"], "--concurrency", "64")
    assert graph[: len(default)] == flags(by_name["dspark-dspark-replayssm-eager"], "--concurrency", "64")
    assert graph[len(default):] == list(bench_serving.PREFILL_GRAPH_ARGS)
    ns = parser.parse_args(["--model-path", "m", *bench_serving.PREFILL_GRAPH_ARGS])
    assert (ns.cuda_graph_backend_prefill, ns.cuda_graph_max_bs_prefill) == ("breakable", 512)


def test_profile_sums_every_kernel_and_compare_diffs_them_per_step(tmp_path, capsys):
    # 2 KDA layers; BASE: 3 verify forwards (each: 2 streams, 1 fold, one gemm); NEW: 4 forwards
    # (2 streams, 1 commit, one gemm each) and one extra kernel in its window
    base_events = ([("_verify_stream_kernel", 20.0)] * 2 + [("_replayssm_fold_kernel", 30.0),
                                                            ("sm90_xmma_gemm_bf16bf16_bf16f32", 100.0)]) * 3
    new_events = ([("_verify_stream_kernel", 25.0)] * 2 + [("_commit_records_kernel", 2.0),
                                                           ("sm90_xmma_gemm_bf16bf16_bf16f32", 100.0)]) * 4
    new_events += [("elementwise_kernel", 8.0)]
    profiles = {}
    for label, events in (("base", base_events), ("new", new_events)):
        trace_dir = tmp_path / label
        trace_dir.mkdir()
        _trace(trace_dir / "a-TP-0.trace.json.gz", events, gap=1.0)
        profiles[label] = bench_serving.kda_share(str(trace_dir), kda_layers=2)
    assert profiles["base"]["kernels_us"] == {"sm90_xmma_gemm_bf16bf16_bf16f32": 300.0, "_verify_stream_kernel": 120.0,
                                              "_replayssm_fold_kernel": 90.0}
    assert profiles["new"]["kernel_calls"]["_verify_stream_kernel"] == 8
    d = compare_serving.kernel_diff(profiles["base"], profiles["new"])
    per_step = {name: (b, n) for name, b, n in d["rows"]}
    # by hand, per step: fold 30 -> 0, stream 40 -> 50, commit 0 -> 2, extra 0 -> 2, gemm 100 -> 100
    assert per_step["_replayssm_fold_kernel"] == pytest.approx((30.0, 0.0))
    assert per_step["_verify_stream_kernel"] == pytest.approx((40.0, 50.0))
    assert per_step["_commit_records_kernel"] == pytest.approx((0.0, 2.0))
    assert per_step["elementwise_kernel"] == pytest.approx((0.0, 2.0))
    assert [name for name, _, _ in d["rows"]][:2] == ["_replayssm_fold_kernel", "_verify_stream_kernel"]
    assert d["kernel_us"] == pytest.approx((170.0, 154.0))
    # the kernels lie end to end, 1 us apart: busy = kernel time; span = that + the gaps between
    # the 12 (BASE) and 17 (NEW) kernels
    assert d["gpu_busy_us"] == pytest.approx((170.0, 154.0))
    assert d["span_us"] == pytest.approx(((510.0 + 11) / 3, (616.0 + 16) / 4))
    assert d["steps"] == (3, 4)
    # through the command line, from two result files
    for label in ("base", "new"):
        with open(tmp_path / f"{label}.json", "w") as f:
            json.dump({"runs": {label: {"samples": {"64": [{"tokens_per_s": 100.0}, {"tokens_per_s": 110.0}]},
                                        "profile": profiles[label]}}}, f)
    assert compare_serving.main([str(tmp_path / "base.json"), str(tmp_path / "new.json"), "--profiles"]) == 0
    out = capsys.readouterr().out
    assert "| _replayssm_fold_kernel | 30.0 | 0.0 | -30.0 |" in out
    assert "| all kernels | 170.0 | 154.0 | -16.0 |" in out
    assert "| span (first kernel to last) | 173.7 | 158.0 | -15.7 |" in out
    # idle per step by place: BASE 3 steps, a 1 us gap between each pair of its 12 kernels; NEW 4
    # steps and 17 kernels, the last gap before the extra kernel
    idle = {where: (b, n) for where, b, n in compare_serving.idle_diff(profiles["base"], profiles["new"])}
    assert idle["_verify_stream_kernel -> _verify_stream_kernel"] == pytest.approx((1.0, 1.0))
    assert idle["_verify_stream_kernel -> _replayssm_fold_kernel"] == pytest.approx((1.0, 0.0))
    assert idle["sm90_xmma_gemm_bf16bf16_bf16f32 -> _verify_stream_kernel"] == pytest.approx((2 / 3, 3 / 4))
    assert idle["sm90_xmma_gemm_bf16bf16_bf16f32 -> elementwise_kernel"] == pytest.approx((0.0, 1 / 4))
    assert sum(b for b, _ in idle.values()) == pytest.approx(d["span_us"][0] - d["gpu_busy_us"][0])
    assert "| _verify_stream_kernel -> _commit_records_kernel | 0.0 | 1.0 | +1.0 |" in out
    assert "| all gaps < 5 us | 3.7 | 4.0 | +0.3 |" in out
    assert "--profile-cpu window) by the" not in out  # no --profile-cpu window in these runs
    # with --profile-cpu windows (their own step counts): the host frames per step, largest first
    commit = "sglang_dspark_plugin/commit.py(60): commit_verified_states"
    phase = "sglang/srt/managers/scheduler.py(1): event_loop_overlap > sglang/srt/managers/scheduler.py(2): run_batch"
    base_host = {"kda_steps": 2, "host_gaps_us": {commit: {"us": 300.0, "count": 2}, "(launch not traced)": {"us": 10.0, "count": 1}},
                 "host_gap_phases_us": {phase: {"us": 310.0, "count": 3}}}
    new_host = {"kda_steps": 5, "host_gaps_us": {"sglang/x.py(1): f": {"us": 100.0, "count": 5}},
                "host_gap_phases_us": {phase: {"us": 100.0, "count": 5}}}
    rows = compare_serving.host_gap_diff({**profiles["base"], "host": base_host}, {**profiles["new"], "host": new_host})
    assert rows == [(commit, 150.0, 0.0), ("sglang/x.py(1): f", 0.0, 20.0), ("(launch not traced)", 5.0, 0.0)]
    for label, host in (("base", base_host), ("new", new_host)):
        with open(tmp_path / f"{label}-host.json", "w") as f:
            json.dump({"runs": {label: {"samples": {"64": [{"tokens_per_s": 100.0}, {"tokens_per_s": 110.0}]},
                                        "profile": {**profiles[label], "host": host}}}}, f)
    assert compare_serving.main([str(tmp_path / "base-host.json"), str(tmp_path / "new-host.json"), "--profiles"]) == 0
    out = capsys.readouterr().out
    assert f"| {commit} | 150.0 | 0.0 | -150.0 |" in out
    assert f"| {phase} | 155.0 | 20.0 | -135.0 |" in out
    assert out.index("by the phase of the scheduler loop") < out.index("by the innermost host frames")
    with open(tmp_path / "bare.json", "w") as f:
        json.dump({"runs": {"x": {"samples": {"64": [{"tokens_per_s": 1.0}, {"tokens_per_s": 1.0}]}}}}, f)
    with pytest.raises(SystemExit, match="no per-kernel profile"):
        compare_serving.main([str(tmp_path / "bare.json"), str(tmp_path / "new.json"), "--profiles"])
    # a profile from before the idle record: the table is left out and the output says why
    del profiles["base"]["idle_by_gap_size_us"]
    with open(tmp_path / "old.json", "w") as f:
        json.dump({"runs": {"old": {"samples": {"64": [{"tokens_per_s": 100.0}, {"tokens_per_s": 110.0}]},
                                    "profile": profiles["base"]}}}, f)
    assert compare_serving.main([str(tmp_path / "old.json"), str(tmp_path / "new.json"), "--profiles"]) == 0
    assert "GPU idle by place: not recorded in both profiles" in capsys.readouterr().out


def test_results_record_the_machine_and_compare_warns_across_machines(tmp_path, capsys):
    import uuid

    m = bench_serving.machine()
    assert m["cpus"] == os.cpu_count()
    uuid.UUID(m["boot_id"])  # the kernel's boot id is a UUID
    with open("/proc/cpuinfo") as f:
        assert f"model name\t: {m['cpu']}\n" in f.read()
    a = {"cpu": "CPU A", "cpus": 16, "boot_id": "11111111-aaaa"}
    b = {"cpu": "CPU B", "cpus": 16, "boot_id": "22222222-bbbb"}
    same = _serving_json(tmp_path / "same.json", {"lazy": [105.0, 112.0, 95.0]}, machine=a)
    other = _serving_json(tmp_path / "other.json", {"lazy": [105.0, 112.0, 95.0]}, machine=b)
    unknown = _serving_json(tmp_path / "unknown.json", {"lazy": [105.0, 112.0, 95.0]})
    fold = _serving_json(tmp_path / "fold.json", {"fold": [100.0, 110.0, 90.0]}, machine=a)
    compare_serving.main([fold, same])
    assert "machine" not in capsys.readouterr().out
    compare_serving.main([fold, other])
    assert "WARNING: different machines (boot ids 11111111 / 22222222; CPUs CPU A x16 / CPU B x16)" in capsys.readouterr().out
    compare_serving.main([fold, unknown])
    assert "machine: not recorded in both runs" in capsys.readouterr().out


def test_configs_run_in_the_order_given():
    """``--configs b,a`` serves b first (two calls in opposite orders are the fair served comparison;
    until 2026-12-04 the table's order won silently), duplicates once, unknown names stop the run."""
    names = [c.name for c in bench_serving.CONFIGS]
    assert [c.name for c in bench_serving.selected_configs("dspark-ring,stock-ring")] == ["dspark-ring", "stock-ring"]
    assert [c.name for c in bench_serving.selected_configs("stock-ring,dspark-ring,stock-ring")] == [
        "stock-ring", "dspark-ring"]
    assert [c.name for c in bench_serving.selected_configs(",".join(reversed(names)))] == names[::-1]
    with pytest.raises(SystemExit, match="no-such-config"):
        bench_serving.selected_configs("stock-ring,no-such-config")


def _client_args(monkeypatch, cmd):
    """``cmd`` (a :func:`bench_serving.client_command`) as the client's own parser reads it: its
    ``cli_main`` with ``run_benchmark`` replaced by a catch (nothing is sent)."""
    serving = pytest.importorskip("sglang.benchmark.serving")
    assert cmd[:3] == [sys.executable, "-m", "sglang.benchmark.serving"]
    parsed = []
    monkeypatch.setattr(serving, "run_benchmark", parsed.append)
    monkeypatch.setattr(sys, "argv", ["serving.py", *cmd[3:]])
    serving.cli_main()
    (args,) = parsed
    return args


def test_load_comes_from_sglangs_serving_benchmark_with_the_levels_parameters(monkeypatch):
    import sglang.bench_serving  # the name users run: in SGLang 0.5.23 an alias of sglang.benchmark.serving
    import sglang.benchmark.serving as serving

    assert sglang.bench_serving.cli_main is serving.cli_main
    cmd = bench_serving.client_command("http://127.0.0.1:30000", concurrency=8, num_prompts=64, prompt_len=48,
                                       output_len=128, seed=1008, tokenizer="/tok", output_file="/out.jsonl")
    args = _client_args(monkeypatch, cmd)
    assert (args.backend, args.base_url, args.tokenizer, args.output_file) == (
        "sglang", "http://127.0.0.1:30000", "/tok", "/out.jsonl")
    # seeded random token ids, sent as ids: no dataset download, exactly 48 prompt tokens
    assert (args.dataset_name, args.tokenize_prompt, args.seed) == ("random-ids", True, 1008)
    assert (args.random_input_len, args.random_output_len, args.random_range_ratio) == (48, 128, 1.0)
    assert (args.num_prompts, args.max_concurrency, args.request_rate) == (64, 8, float("inf"))
    # greedy, streamed, exactly output_len tokens per request
    assert (args.temperature, args.disable_ignore_eos, args.disable_stream) == (0.0, False, False)


def test_the_clients_prompts_have_the_exact_length_and_the_seed_fixes_them(monkeypatch):
    """Round r at concurrency c serves the same prompts in every run (seed 1000 r + c): the client's
    own dataset code, as its run seeds it, on the tokenizer ``client_tokenizer`` gives it."""
    import random

    import numpy as np
    from sglang.benchmark.datasets import get_dataset
    from sglang.benchmark.utils import get_tokenizer

    tokenizers = {name: bench_serving.client_tokenizer(bench_serving.tiny_models.SPECS[name]) for name in ("kimi32", "kimi48")}
    assert tokenizers["kimi48"].endswith("tiny-kimi-linear")  # served token ids only: the tiny model's tokenizer
    tokenizer = get_tokenizer(tokenizers["kimi48"])

    def prompts(seed, n=16):
        cmd = bench_serving.client_command("http://x", concurrency=2, num_prompts=n, prompt_len=48, output_len=8,
                                           seed=seed, tokenizer=tokenizers["kimi48"], output_file="/o")
        args = _client_args(monkeypatch, cmd)
        random.seed(args.seed)  # what the client's run does first
        np.random.seed(args.seed)
        return get_dataset(args, tokenizer, "m")

    first, again, other = prompts(1002), prompts(1002), prompts(2002)
    assert [r.prompt for r in first] == [r.prompt for r in again]
    assert [r.prompt for r in first] != [r.prompt for r in other]
    assert len({tuple(r.prompt) for r in first}) == 16  # distinct prompts
    for row in first:
        assert len(row.prompt) == row.prompt_len == 48 and row.output_len == 8
        assert all(isinstance(t, int) and 0 <= t < tokenizer.vocab_size for t in row.prompt)


CLIENT_OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bench_serving")


def test_a_level_is_read_from_the_clients_json_output():
    """Real output files of ``sglang.benchmark.serving`` (the command line of ``client_command``,
    2 in flight, 16-token prompts, 6 output tokens), their ``server_info`` (the server's
    arguments) left out: the tiny model on CPU with the plugin and DSPARK gamma 3 (16 requests;
    text streamed), and the same server started with ``--skip-tokenizer-init`` (4 requests;
    token ids only, as the configs-only benchmark models serve)."""
    with open(os.path.join(CLIENT_OUTPUT, "tiny_dspark_g3_c2.jsonl")) as f:
        raw = json.loads(f.read())
    level = bench_serving.read_client_result(os.path.join(CLIENT_OUTPUT, "tiny_dspark_g3_c2.jsonl"), num_prompts=16)
    assert (level["concurrency"], level["requests"], level["failed_requests"]) == (2, 16, 0)
    assert level["output_tokens"] == 16 * 6 == raw["total_output_tokens"]
    assert level["tokens_per_s"] == raw["output_throughput"] == pytest.approx(level["output_tokens"] / level["wall_s"])
    assert (level["median_itl_ms"], level["median_ttft_ms"]) == (raw["median_itl_ms"], raw["median_ttft_ms"])
    assert level["median_itl_ms"] > 0 and level["median_ttft_ms"] > 0
    assert level["accept_length"] == raw["accept_length"] and 1.0 < level["accept_length"] <= 4.0  # gamma 3
    # the client's record rides along, as strict JSON (its infinite request rate as None)
    assert "server_info" not in level["bench_serving"] and level["bench_serving"]["request_rate"] is None
    assert level["bench_serving"]["p99_itl_ms"] == raw["p99_itl_ms"]
    json.dumps(level, allow_nan=False)

    ids_only = bench_serving.read_client_result(os.path.join(CLIENT_OUTPUT, "tiny_token_ids_only_c2.jsonl"), num_prompts=5)
    assert (ids_only["requests"], ids_only["failed_requests"], ids_only["output_tokens"]) == (4, 1, 4 * 6)
    assert ids_only["bench_serving"]["median_ttft_ms"] == ids_only["bench_serving"]["median_itl_ms"] == 0.0
    assert ids_only["median_itl_ms"] is None and ids_only["median_ttft_ms"] is None  # not timed: no text
    assert ids_only["tokens_per_s"] > 0


def test_untimed_levels_show_as_missing_in_the_summary_and_the_table():
    timed = {"tokens_per_s": 10.0, "median_itl_ms": 3.0, "median_ttft_ms": 9.0, "accept_length": None}
    untimed = {"tokens_per_s": 12.0, "median_itl_ms": None, "median_ttft_ms": None, "accept_length": None}
    (level,) = bench_serving.summarize({"samples": {"4": [timed, untimed]}})
    assert (level["tokens_per_s"], level["median_itl_ms"], level["median_ttft_ms"]) == (11.0, 3.0, 9.0)
    (level,) = bench_serving.summarize({"samples": {"4": [untimed]}})
    assert level["median_itl_ms"] is None and level["median_ttft_ms"] is None
    table = bench_serving.render({"args": {"concurrency": [4]}, "runs": {"kimi48": {"levels": [level]}}})
    assert "| kimi48 | 12 | - | - | - | - | - | - |" in table
