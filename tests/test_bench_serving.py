"""benchmarks/bench_serving.py without a server: the KDA share of a profiler trace, the summary of
measurement rounds, and the rendered table."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

bench_serving = pytest.importorskip("bench_serving")


def _trace(path, kernels):
    events = [{"cat": "kernel", "name": name, "dur": dur} for name, dur in kernels]
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


def test_host_waits_are_attributed_to_the_innermost_sglang_frames(tmp_path):
    """A host wait for the GPU (a CUDA runtime synchronize) is charged to the SGLang / plugin Python
    frames around it on its thread, innermost first; torch frames are skipped, other threads and
    non-waiting runtime calls are not counted."""
    def py(name, ts, dur, tid=1):
        return {"cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}

    def rt(name, ts, dur, tid=1):
        return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [
        py("sglang/srt/managers/scheduler.py(10): event_loop", 0.0, 1000.0),
        py("sglang/srt/managers/overlap_utils.py(587): resolve_seq_lens_cpu", 100.0, 300.0),
        py("torch/cuda/streams.py(5): synchronize", 150.0, 200.0),
        rt("cudaStreamSynchronize", 160.0, 180.0),
        py("sglang_dspark_plugin/commit.py(60): commit_verified_states", 500.0, 100.0),
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
    table = bench_serving.render(result).splitlines()
    assert table[0].startswith("| config | c=1 tok/s | c=8 tok/s |")
    assert "| dspark | 150 (1.50x) | 400 (1.00x) | 2.00 | 2.00 | - | 25% | 2981 | 60% |" in table
    assert any(row.startswith("| stock-dspark | error: ServerStartError: boom") for row in table)
