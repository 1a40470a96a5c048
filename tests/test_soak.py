"""benchmarks/soak.py without SGLang: the workload generator, the bf16 near-tie rule, the verdicts,
and the client against a fake server (stdlib HTTP) that answers like SGLang's /generate, streams,
refuses malformed requests and serves /metrics. The served soak runs on the GPU rig
(``bash benchmarks/gpu_rig.sh soak``) and, small, on CPU (``python benchmarks/soak.py --small``)."""

from __future__ import annotations

import json
import math
import statistics
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak  # noqa: E402

TOKENS = list(range(3, 500))


def _workload(n=2000, seed=7, **kw):
    return soak.make_workload(n, seed=seed, prompt=(8, 2000), output=(1, 512), tokens=TOKENS, **kw)


def test_workload_mix_and_lengths():
    reqs = _workload()
    assert [asdict_key(r) for r in reqs] == [asdict_key(r) for r in _workload()]  # seeded
    assert [asdict_key(r) for r in reqs] != [asdict_key(r) for r in _workload(seed=8)]
    kinds = {k: sum(r.kind == k for r in reqs) for k in soak.KINDS}
    assert kinds == {"complete": 1380, "drop": 200, "branch": 400, "malformed": 20}
    assert reqs[0].kind == "complete" and [r.index for r in reqs] == list(range(2000))
    # every malformed request kind is sent
    assert {r.malformed for r in reqs if r.kind == "malformed"} == set(soak.MALFORMED)
    plain = [r for r in reqs if r.kind in ("complete", "drop", "malformed")]
    lengths = [len(r.input_ids) for r in plain]
    outputs = [r.max_new_tokens for r in reqs if r.kind == "complete"]
    assert min(lengths) >= 8 and max(lengths) <= 2000 and min(outputs) >= 1 and max(outputs) <= 512
    # log-uniform: the median near the geometric mean of the range, a quarter of the draws per
    # quarter of the log range
    assert abs(math.log(statistics.median(lengths)) - math.log(math.sqrt(8 * 2001))) < 0.25
    assert abs(math.log(statistics.median(outputs)) - math.log(math.sqrt(1 * 513))) < 0.35
    logs = [math.log(x) for x in lengths]
    lo, hi = math.log(8), math.log(2001)
    for q in range(4):
        a, b = lo + q * (hi - lo) / 4, lo + (q + 1) * (hi - lo) / 4
        assert 0.2 < sum(a <= x < b for x in logs) / len(logs) < 0.3
    for r in reqs:
        if r.kind == "branch":  # an earlier request's prompt, cut, with a new tail
            parent = reqs[r.parent]
            assert parent.index < r.index and parent.kind != "malformed"
            assert any(r.input_ids[:c] == parent.input_ids[:c] for c in range(1, len(parent.input_ids) + 1))
            assert r.input_ids[0] == parent.input_ids[0] and len(r.input_ids) <= 2000 + len(parent.input_ids)
        if r.kind == "drop":
            assert 1 <= r.drop_after <= r.max_new_tokens // 2 and r.max_new_tokens >= 4
    small = soak.make_workload(24, seed=1, prompt=(8, 48), output=(1, 8), tokens=TOKENS)
    assert all(sum(r.kind == k for r in small) >= 1 for k in soak.KINDS)
    assert {r.malformed for r in small if r.kind == "malformed"} == set(soak.MALFORMED)


def asdict_key(r):
    return (r.kind, tuple(r.input_ids), r.max_new_tokens, r.parent, r.drop_after, r.malformed)


def test_bf16_spacing_is_the_gap_between_bf16_neighbours():
    """Against the bit patterns: the next bf16 number above a positive bf16 value ``x`` has the
    bits of ``x`` plus one in the low bit of its 16."""
    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(2000, generator=gen) * torch.exp(torch.randn(2000, generator=gen) * 4)).abs()
    values = values.to(torch.bfloat16)
    up = (values.view(torch.int16) + 1).view(torch.bfloat16)
    for x, nxt in zip(values.tolist(), up.tolist()):
        assert soak.bf16_spacing(x) == nxt - x, x
        assert soak.bf16_spacing(-x) == nxt - x


def test_near_tie_rule():
    """A divergence is a near-tie only where the reference's top-2 gap is within the bf16 spacing
    of the logits there and the server took the other of the reference's top two."""
    ref = {"output_ids": [5, 6, 7], "top2": [[[-0.1, 5], [-3.0, 9]], [[-0.50, 6], [-0.52, 8]], [[-0.1, 7], [-2, 1]]]}
    logits = lambda pos, t1, t2: (12.3, 12.28)  # noqa: E731 - spacing at 12.3: 2^(3-7) = 0.0625
    assert soak.judge([5, 6, 7], ref, logits) is None
    tie = soak.judge([5, 8, 1], ref, logits)  # gap 0.02 <= 0.0625, the runner-up
    assert tie["near_tie"] and tie["position"] == 1 and tie["spacing"] == 0.0625
    assert not soak.judge([5, 4, 1], ref, logits)["near_tie"]  # not the runner-up
    small = lambda pos, t1, t2: (0.9, 0.88)  # noqa: E731 - spacing at 0.9: 2^-8
    assert not soak.judge([5, 8, 1], ref, small)["near_tie"]  # the same gap, smaller logits: outside
    assert not soak.judge([9, 6, 7], ref, logits)["near_tie"]  # gap 2.9 at position 0
    assert not soak.judge([5, 6], ref, logits)["near_tie"]  # shorter: no token to judge
    # an exact tie listed in the other order than the reference's pick: the server took the other
    tied = {"output_ids": [5, 8], "top2": [[[-0.1, 5], [-3.0, 9]], [[-0.5, 6], [-0.5, 8]]]}
    flip = soak.judge([5, 6], tied, logits)
    assert flip["near_tie"] and flip["top1"] == 6 and flip["runner_up"] == 8
    assert flip["float64_spacings"] == pytest.approx(0.02 / 0.0625)
    assert not soak.judge([5, 3], tied, logits)["near_tie"]  # a third token
    # the plugin's count against the control's
    assert soak.within_noise(3, 1) and soak.within_noise(10, 4) and not soak.within_noise(12, 1)


class _FakeSGLang(BaseHTTPRequestHandler):
    """/generate like SGLang's: output token i = (sum of the input ids + i) % 500, 4xx for a
    negative temperature or max_new_tokens, unparsable JSON, an out-of-range logprob token or a
    prompt longer than the context; 500 for prompts starting with token 13 (a server bug); SSE
    streams; /metrics with idle gauges."""

    context = 64
    served = []

    def log_message(self, *args):
        pass

    def _send(self, code, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/metrics":
            self._send(200, "# HELP x\n" + "".join(f'{g}{{model_name="m"}} 0.0\n' for g in soak.IDLE_GAUGES),
                       "text/plain")
        else:
            self._send(200, {})

    def do_POST(self):
        raw = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            body = json.loads(raw)
        except ValueError:
            return self._send(400, {"error": "bad json"})
        sp = body.get("sampling_params", {})
        ids = body["input_ids"]
        if (sp.get("temperature", 0) < 0 or sp.get("max_new_tokens", 1) < 0 or len(ids) > self.context
                or any(t >= 500 for t in body.get("token_ids_logprob", []))):
            return self._send(400, {"error": "invalid"})
        if ids[0] == 13:
            return self._send(500, {"error": "boom"})
        out = [(sum(ids) + i) % 500 for i in range(sp["max_new_tokens"])]
        type(self).served.append(len(ids))
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for i in range(len(out)):
                    self.wfile.write(f"data: {json.dumps({'output_ids': out[: i + 1]})}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            return
        meta = {"spec_verify_ct": 0}
        if body.get("return_logprob"):
            meta["output_top_logprobs"] = [[[-0.1, t, None], [-2.0, (t + 1) % 500, None]] for t in out]
        self._send(200, {"output_ids": out, "meta_info": meta})


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_client_against_a_fake_server(fake_server):
    reqs = soak.make_workload(60, seed=3, prompt=(8, 40), output=(4, 12), tokens=[t for t in TOKENS if t != 13])
    bug = next(r.index for r in reqs[1:] if r.kind == "complete")
    reqs[bug].input_ids[0] = 13  # the fake's "server bug": a 500
    run = soak.run_workload(fake_server, reqs, concurrency=4, logprobs=True, context_len=64, vocab=500)
    rows = run["rows"]
    assert [r["index"] for r in rows] == list(range(60))
    assert rows[bug]["status"] == 500
    for req, row in zip(reqs, rows):
        if req.index == bug:
            continue
        if req.kind == "malformed":
            assert 400 <= row["status"] < 500, (req.malformed, row)
        elif req.kind == "drop":
            assert row["status"] == 200 and row["chunks"] == req.drop_after  # the client hung up there
        else:
            assert row["status"] == 200
            assert row["output_ids"] == [(sum(req.input_ids) + i) % 500 for i in range(req.max_new_tokens)]
            assert len(row["top2"]) == req.max_new_tokens
    done = [r for q, r in zip(reqs, rows) if q.kind in ("complete", "branch") and r["status"] == 200]
    assert run["output_tokens"] == sum(len(r["output_ids"]) for r in done) and run["tokens_per_s"] > 0
    run.update(alive=True, idle=soak.idle_state(fake_server, wait_s=0), leak_lines=0)
    assert run["idle"]["idle"]
    checks = soak.verdicts("x", run, reqs, None, None, plugin=False)
    assert checks["no 5xx"] is False and checks["no failed request"] is False  # the 500
    assert checks["malformed 4xx"] and checks["no leak"] and checks["alive"]

    # the same outputs compared with themselves, then one changed token
    ref_rows = [dict(r) for r in rows]
    logits = lambda prompt, output, pos, t1, t2: (10.0, 9.99)  # noqa: E731
    same = soak.compare(reqs, ref_rows, rows, logits)
    assert same["divergences"] == 0 and same["compared"] == len(done)
    i = next(k for k, r in enumerate(rows) if reqs[k].kind == "complete" and r["status"] == 200)
    changed = [dict(r) for r in rows]
    changed[i]["output_ids"] = list(rows[i]["output_ids"])
    changed[i]["output_ids"][2] = (changed[i]["output_ids"][2] + 1) % 500  # the reference's runner-up
    found = soak.compare(reqs, ref_rows, changed, logits)
    assert found["divergences"] == 1 and found["near_ties"] == 0  # gap 1.9 > spacing 2^-4 at 10
    assert found["outside_rule"][0]["index"] == i and found["outside_rule"][0]["position"] == 2
    plugin = soak.verdicts("p", dict(run, rows=changed), reqs, found, same, plugin=True)
    assert not plugin["no divergence outside the bf16 rule"]


def test_memory_flat_and_idle_gauges():
    assert soak.memory_flat([1000, 1500, 1900, 2000, 2010, 2020, 2030]) is True  # growth early only
    assert soak.memory_flat([1000, 1100, 1200, 1300, 1600, 1900]) is False
    assert soak.memory_flat([None, None]) is None  # no GPU
    run = dict(rows=[], alive=True, idle={"idle": True}, leak_lines=0, gpu=True, memory_flat=None)
    assert soak.verdicts("x", run, [], None, None, plugin=False)["GPU memory flat"] is False  # not measured
    assert soak.verdicts("x", dict(run, memory_flat=True), [], None, None, plugin=False)["GPU memory flat"]
    assert "GPU memory flat" not in soak.verdicts("x", dict(run, gpu=False), [], None, None, plugin=False)
    assert not soak.verdicts("x", dict(run, leak_lines=1), [], None, None, plugin=False)["no leak"]


def test_the_saved_result_drops_the_reference_top2_and_leaves_the_run_alone():
    rows = [dict(index=0, kind="complete", status=200, output_ids=[1, 2], top2=[[[-0.1, 1], [-2.0, 7]]] * 2)]
    result = dict(servers={"reference": dict(rows=rows, wall_s=1.0), "control": dict(error="boom")})
    saved = soak.for_file(result)
    assert saved["servers"]["reference"]["rows"] == [dict(index=0, kind="complete", status=200, output_ids=[1, 2])]
    assert saved["servers"]["control"] == {"error": "boom"}
    assert "top2" in result["servers"]["reference"]["rows"][0]  # the judge still reads it


def test_render_a_saved_result(tmp_path, capsys):
    """``--render``: the table of a saved soak.json / .json.gz, with the largest float64 gap from a
    divergence's logits where the run did not record it."""
    import gzip

    rows = [dict(kind="complete", status=200), dict(kind="malformed", status=400), dict(kind="drop", status=200)]
    run = dict(rows=rows, tokens_per_s=123.4, verdicts={"alive": True, "no leak": True})
    divergences = [dict(near_tie=True, logits=[16.5, 16.45], spacing=0.125),
                   dict(near_tie=False, logits=[14.0, 13.8], spacing=0.0625, float64_spacings=3.2)]
    result = dict(servers={"reference": run, "dspark-g3": dict(run, comparison=dict(
        compared=1, divergences=2, near_ties=1, outside_rule=divergences[1:], all=divergences))})
    path = tmp_path / "soak.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(result, f)
    assert soak.main(["--render", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[3].startswith("| dspark-g3 | 1/1 | 0 | 1/1 | 1 | 1 | 2 | 1 | 1 | 3.20 | 123 |")
    assert "| - | 123 |" in table[2]  # the reference: nothing compared


def test_each_plugin_server_is_judged_against_the_control_of_its_block_size():
    by_name = {s.name: s for s in soak.SERVERS}
    assert soak.control_for(by_name["dspark-g3"]) == "control"
    assert soak.control_for(by_name["dspark-g7"]) == "control-g7"
    assert [(by_name[c].backend, by_name[c].gamma) for c in ("control", "control-g7")] == [("stock", 3), ("stock", 7)]
    # a control runs before the plugin server judged against it (servers run in SERVERS order)
    order = [s.name for s in soak.SERVERS]
    assert order.index("control-g7") < order.index("dspark-g7") and order.index("control") < order.index("dspark-g3")
