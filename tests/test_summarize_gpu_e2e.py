"""benchmarks/summarize_gpu_e2e.py on a hand-built e2e log folder: equal counts, the differing
sequences with their first position and stock's top-2 gap, and agreement with the reference."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from summarize_gpu_e2e import summarize  # noqa: E402


def _run(waves, openai, config=None):
    results = {"wave64": [dict(prompt=i, output_ids=o, **extra) for i, o, extra in waves], "openai": openai}
    results["wave5"] = results["wave64"][:1]
    return {"config": config or {}, "error": "", "startup_s": 1.0, "workload_s": 2.0, "results": results}


def test_summary_of_a_hand_built_fleet(tmp_path):
    top2 = [[[-0.1, 7], [-0.6, 8]]] * 3  # stock's gap 0.5 at every position
    stock = _run([(0, [7, 7, 7], {"top2": top2}), (1, [5, 5, 5], {"top2": top2})], [{"prompt": 0, "text": "a"}])
    ours = _run([(0, [7, 8, 9], {}), (1, [5, 5, 5], {})], [{"prompt": 0, "text": "b"}])
    fleet = {"runs": {"m-stock": stock, "m-ours": ours}}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    (tmp_path / "prompts-m.json").write_text(json.dumps({"reference": [[7, 7, 7], [5, 5, 6]]}))
    summary = summarize(tmp_path)["m"]
    got = summary["m-ours"]
    # prompt 0 differs in both waves (wave5 repeats it), prompt 1 is equal
    assert got["token_requests"] == 3 and got["token_equal_to_stock"] == 1
    assert got["differing"] == [{"wave": "wave64", "prompt": 0, "first_position": 1, "stock_top2_gap": 0.5},
                                {"wave": "wave5", "prompt": 0, "first_position": 1, "stock_top2_gap": 0.5}]
    assert got["openai_equal_to_stock"] == 0
    assert got["follow_float64_reference"] == {"wave64": "0/2", "wave5": "0/1"}
    assert summary["m-stock"]["follow_float64_reference"] == {"wave64": "1/2", "wave5": "1/1"}


def test_tensor_parallel_fleet_is_also_counted_against_stock_at_tp1(tmp_path):
    stock = _run([(0, [7, 7], {"top2": [[[-0.1, 7], [-0.6, 8]]] * 2})], [{"prompt": 0, "text": "a"}])
    stock_tp1 = _run([(0, [7, 9], {"top2": [[[-0.1, 7], [-0.6, 9]]] * 2})], [{"prompt": 0, "text": "a"}])
    ours = _run([(0, [7, 7], {})], [{"prompt": 0, "text": "a"}])
    fleet = {"runs": {"m-stock": stock, "m-stock-tp1": stock_tp1, "m-ours": ours}}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    (tmp_path / "prompts-m.json").write_text(json.dumps({"reference": [[7, 7]]}))
    summary = summarize(tmp_path)["m"]
    assert summary["m-ours"]["token_equal_to_stock"] == 2 and summary["m-ours"]["token_equal_to_stock_tp1"] == 0
    assert summary["m-ours"]["openai_equal_to_stock_tp1"] == 1
    assert summary["m-stock-tp1"]["token_equal_to_stock"] == 0 and "token_equal_to_stock_tp1" not in summary["m-stock-tp1"]
    del fleet["runs"]["m-stock-tp1"]  # a fleet without stock at TP=1 gets no TP=1 counts
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    assert "token_equal_to_stock_tp1" not in summarize(tmp_path)["m"]["m-ours"]


def test_branches_counted_against_stock(tmp_path):
    """The prefix-hit phase: turn 1 and the branches equal to stock's, a branch compared only where
    its prompt equals stock's, and the branches served from the cache (cached_tokens >= 64)."""
    stock = _run([(0, [7], {})], [])
    stock["results"]["turn1"] = [dict(prompt=0, output_ids=[1, 2]), dict(prompt=1, output_ids=[3, 4])]
    stock["results"]["branch"] = [dict(prompt=0, input_ids=[9, 1], output_ids=[5], cached_tokens=64),
                                  dict(prompt=1, input_ids=[9, 3], output_ids=[6], cached_tokens=64)]
    ours = _run([(0, [7], {})], [])
    ours["results"]["turn1"] = [dict(prompt=0, output_ids=[1, 2]), dict(prompt=1, output_ids=[3, 0])]
    ours["results"]["branch"] = [dict(prompt=0, input_ids=[9, 1], output_ids=[5], cached_tokens=64),
                                 dict(prompt=1, input_ids=[9, 0], output_ids=[6], cached_tokens=0)]
    (tmp_path / "fleet.json").write_text(json.dumps({"runs": {"m-stock": stock, "m-ours": ours}}))
    (tmp_path / "prompts-m.json").write_text(json.dumps({"reference": [[7]]}))
    summary = summarize(tmp_path)["m"]
    got = summary["m-ours"]
    # turn 1 of prompt 1 differs, so its branch (another prompt than stock's) is not compared
    assert got["branch_requests_compared"] == 3 and got["branch_equal_to_stock"] == 2
    assert got["branches_from_cache"] == "1/2" and summary["m-stock"]["branches_from_cache"] == "2/2"


def test_first_difference_position():
    """The position the summary records comes from gpu_kit.divergence (the e2e test's comparison)."""
    from gpu_kit import divergence

    assert divergence([1, 2], {"output_ids": [1, 2]}) is None
    assert divergence([1, 3], {"output_ids": [1, 2]})["position"] == 1
    assert divergence([1], {"output_ids": [1, 2]})["position"] == 1
