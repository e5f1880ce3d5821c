"""The harness's figures from recorded fixtures (bench/fixtures/), every expected value derived by hand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench import report as br
from bench import serving

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "bench" / "fixtures"


def load(name: str) -> str:
    return (FIX / name).read_text()


@pytest.fixture(scope="module")
def delta() -> br.MetricsSnapshot:
    return br.metrics_delta(br.snapshot(load("metrics_before.txt")), br.snapshot(load("metrics_after.txt")))


def test_metrics_page_counters_and_labels():
    snap = br.snapshot(load("metrics_before.txt"))
    # 200 earlier verify steps (4 drafts each), accepted 4,3,0,1,2 repeating -> 40 x (4+3+0+1+2)
    assert snap.spec_enabled
    assert snap.counters["spec_drafts"] == 200
    assert snap.counters["spec_draft_tokens"] == 800
    assert snap.counters["spec_accepted"] == 400
    # position p is accepted on every step that accepted more than p drafts: 4, 3, 2, 1 of every 5
    assert snap.accepted_per_pos == {0: 160, 1: 120, 2: 80, 3: 40}
    # request_success is summed over its finished_reason label sets (length 2 + stop 0)
    assert snap.counters["requests_finished"] == 2
    assert snap.cache_config["block_size"] == "16"
    assert "engine" not in snap.cache_config


def test_metrics_delta_gives_run_only_figures(delta):
    c = delta.counters
    assert (c["spec_drafts"], c["spec_draft_tokens"], c["spec_accepted"]) == (2730, 10920, 5460)
    assert c["generation_tokens"] == 8 * 1024
    assert c["prompt_tokens"] == 8 * 120
    assert c["requests_finished"] == 8
    assert c["prefix_cache_hits"] == 0
    spec = br.spec_figures(delta)
    # 1260 steps accepted 3, 840 accepted 1, 420 accepted 0, 210 accepted 4 -> 5460 / 2730 = 2 per step
    assert spec["tokens_per_step"] == pytest.approx(3.0)
    assert spec["acceptance_rate"] == pytest.approx(0.5)
    assert spec["draft_tokens_per_step"] == pytest.approx(4.0)
    assert spec["per_position_acceptance"] == pytest.approx([2310 / 2730, 1470 / 2730, 1470 / 2730, 210 / 2730])


def test_cohort_figures_from_saved_result(delta):
    bench = json.loads(load("vllm_bench_serve_C1.json"))
    fig = br.cohort_figures(bench, 1, delta)
    # TPOT of request i is 8 + 0.5 i ms, i = 0..7 -> mean 9.75 ms -> 1000 / 9.75 tok/s
    assert fig["decode_tok_s"] == pytest.approx(1000 / 9.75)
    assert fig["per_stream_decode_tok_s"] == pytest.approx(1000 / 9.75)
    # the run is sequential: duration = sum of latencies = sum(ttft_i + 1023 tpot_i)
    duration = sum(0.1 + 0.01 * i + 1023 * (0.008 + 0.0005 * i) for i in range(8))
    assert fig["e2e_output_tok_s"] == pytest.approx(8192 / duration)
    assert fig["ttft_ms"]["mean"] == pytest.approx(135.0)  # mean of 100, 110, ..., 170
    assert fig["mean_output_tokens"] == 1024
    assert fig["tokens_per_step"] == pytest.approx(3.0)
    assert fig["ms_per_step"] == pytest.approx(9.75 * 3.0)
    assert fig["prefix_cache_hit_rate"] == 0.0
    # vllm bench serve's own /metrics reading of the same pages agrees with ours
    assert fig["bench_acceptance_length"] == pytest.approx(fig["tokens_per_step"])
    assert bench["spec_decode_per_position_acceptance_rates"] == pytest.approx(fig["per_position_acceptance"])
    # the same result at C4 is four streams' worth of decode
    assert br.cohort_figures(bench, 4, delta)["decode_tok_s"] == pytest.approx(4000 / 9.75)


def test_prefill_figures():
    bench = {"completed": 3, "total_input_tokens": 3 * 4096, "mean_ttft_ms": 2048.0}
    assert br.prefill_figures(bench, 4096)["prefill_tok_s"] == pytest.approx(2000.0)


def test_no_speculation_is_one_token_per_step():
    page = 'vllm:generation_tokens_total{engine="0",model_name="m"} 100.0\n'
    after = 'vllm:generation_tokens_total{engine="0",model_name="m"} 612.0\n'
    d = br.metrics_delta(br.snapshot(page), br.snapshot(after))
    assert d.counters["generation_tokens"] == 512
    spec = br.spec_figures(d)
    assert spec == {"speculative": False, "tokens_per_step": 1.0, "drafts": 0, "acceptance_rate": None,
                    "per_position_acceptance": []}


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="line 2"):
        br.snapshot("# HELP x\nnot a sample line at all {\n")
    with pytest.raises(ValueError, match="restarted"):
        br.metrics_delta(br.snapshot(load("metrics_after.txt")), br.snapshot(load("metrics_before.txt")))
    bench = json.loads(load("vllm_bench_serve_C1.json"))
    no_tpot = {k: v for k, v in bench.items() if "tpot" not in k}
    with pytest.raises(ValueError, match="mean_tpot_ms.*tokenizer"):
        br.cohort_figures(no_tpot, 1, br.snapshot(""))
    with pytest.raises(ValueError, match="no request completed"):
        br.cohort_figures({**bench, "completed": 0, "failed": 8}, 1, br.snapshot(""))


def test_ladder_window_and_per_stream():
    # two streams start at t=0; stream 0 emits at 1.0, 1.1, ..., 2.0; stream 1 at 1.5, 1.6, ..., 3.0
    s0 = [1.0 + 0.1 * i for i in range(11)]
    s1 = [1.5 + 0.1 * i for i in range(16)]
    fig = br.ladder_figures([0.0, 0.0], [s0, s1])
    assert fig["per_stream"][0]["decode_tok_s"] == pytest.approx(10.0)
    assert fig["per_stream"][1]["ttft_ms"] == pytest.approx(1500.0)
    # both decode in (1.5, 2.0]: stream 0 has 1.6..2.0 (5), stream 1 has 1.6..2.0 (5) -> 10 tokens / 0.5 s
    assert fig["aggregate_decode_tok_s"] == pytest.approx(20.0)
    assert fig["e2e_aggregate_tok_s"] == pytest.approx(27 / 3.0)
    serial = br.ladder_figures([0.0, 2.0], [[1.0, 1.5], [2.5, 3.0]])
    assert serial["aggregate_decode_tok_s"] is None
    with pytest.raises(ValueError, match="non-decreasing"):
        br.stream_figures(0.0, [1.0, 0.5])


def test_report_json_and_summary(tmp_path, delta):
    bench = json.loads(load("vllm_bench_serve_C1.json"))
    cohort = br.cohort_figures(bench, 1, delta)
    report = br.build_report(tag="t", mode="single", machine={"gpu": {"name": "NVIDIA H200"}}, server={},
                             runs={"cohorts": {"C1": cohort}}, notes=["random weights: acceptance is meaningless"])
    path = tmp_path / "r" / "t.json"
    serving.write_json_atomic(path, report)
    assert json.loads(path.read_text())["cohorts"]["C1"]["decode_tok_s"] == pytest.approx(1000 / 9.75)
    text = br.summary_markdown(report)
    assert "| C1 | 102.6 | 102.6 |" in text and "85% / 54% / 54% / 8%" in text
    assert "random weights" in text


def test_png_is_optional(tmp_path, delta):
    bench = json.loads(load("vllm_bench_serve_C1.json"))
    report = br.build_report(tag="t", mode="single", machine={}, server={}, notes=[],
                             runs={"cohorts": {"C1": br.cohort_figures(bench, 1, delta)}})
    png = tmp_path / "t.png"
    if importlib.util.find_spec("matplotlib") is None:
        with pytest.warns(UserWarning, match="matplotlib"):
            assert br.plot_report(report, png) is False
        assert not png.exists()
    else:
        assert br.plot_report(report, png) is True
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fixture_matches_what_vllm_bench_serve_writes(tmp_path):
    """vLLM 0.28.0's own main_async (fake requests, /metrics served from the fixture pages) writes a
    result with the fixture's keys and the fixture's figures."""
    spec = importlib.util.spec_from_file_location("make_fixtures", FIX / "make_fixtures.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    fresh = make.run_vllm_bench(load("metrics_before.txt"), load("metrics_after.txt"), tmp_path)
    saved = json.loads(load("vllm_bench_serve_C1.json"))
    assert set(fresh) == set(saved)
    for key in ("mean_tpot_ms", "mean_ttft_ms", "p99_itl_ms", "output_throughput", "spec_decode_acceptance_length",
                "spec_decode_per_position_acceptance_rates", "total_output_tokens"):
        assert fresh[key] == pytest.approx(saved[key]), key


def test_sweep_markdown_sets_each_rate_against_its_own_and_stocks_plain_decode():
    rows = [{"stack": "patched", "k": 0, "tokens_per_step": 1.0, "ms_per_step": 8.0, "decode_tok_s": 125.0},
            {"stack": "patched", "k": 4, "tokens_per_step": 3.0, "ms_per_step": 15.0, "decode_tok_s": 200.0},
            {"stack": "stock", "k": 0, "tokens_per_step": 1.0, "ms_per_step": 10.0, "decode_tok_s": 100.0},
            {"stack": "stock", "k": 2, "tokens_per_step": 2.0, "ms_per_step": 13.0, "decode_tok_s": None}]
    lines = br.sweep_markdown(rows).splitlines()
    assert lines[3] == "| patched | 4 | 3.00 | 15.00 | 200.0 | 1.60x | 2.00x |"
    assert lines[4] == "| stock | 0 | 1.00 | 10.00 | 100.0 | 1.00x | 1.00x |"
    assert lines[5].endswith("| - | - |") and len(lines) == 6  # a server without a rate has no speed-up
