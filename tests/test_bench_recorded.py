"""The harness's parsers on pages recorded from a real vLLM 0.28.0 server (tiny MTP k=4 server, H200).

Recorded by tests/gpu/test_smoke.py::test_record_bench_fixtures (2026-11-29): a `vllm bench serve` result
(16 random prompts, concurrency 4) and the server's /metrics page after it. Random weights: the MTP head
accepts almost nothing, which these figures must show.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import report as benchreport

RECORDED = Path(__file__).resolve().parents[1] / "bench" / "fixtures" / "recorded"


def test_recorded_metrics_page_parses():
    page = benchreport.snapshot((RECORDED / "metrics-tiny-mtp.txt").read_text())
    assert page.spec_enabled
    assert page.counters["spec_drafts"] == 1267
    assert page.counters["spec_draft_tokens"] == 5068 == 4 * 1267  # num_speculative_tokens 4
    assert page.counters["spec_accepted"] == 1
    assert sorted(page.accepted_per_pos) == [0, 1, 2, 3]
    assert page.accepted_per_pos[0] == 1 and sum(page.accepted_per_pos.values()) == 1
    assert page.counters["prefix_cache_queries"] == 8480 and page.counters["prefix_cache_hits"] == 2496


def test_recorded_bench_result_gives_cohort_figures():
    bench = json.loads((RECORDED / "bench-serve-tiny-mtp.json").read_text())
    page = benchreport.snapshot((RECORDED / "metrics-tiny-mtp.txt").read_text())
    zero = benchreport.MetricsSnapshot(dict.fromkeys(page.counters, 0.0), {}, True)
    figures = benchreport.cohort_figures(bench, bench["max_concurrency"], benchreport.metrics_delta(zero, page))
    assert figures["decode_tok_s"] == pytest.approx(4 * 1000 / 31.716967383064247)
    assert figures["requests"] == 16 and figures["failed"] == 0
    assert figures["mean_output_tokens"] == 32
    assert figures["tokens_per_step"] == pytest.approx(1 + 1 / 1267)
    assert figures["per_position_acceptance"] == pytest.approx([1 / 1267, 0, 0, 0])
    assert figures["prefix_cache_hit_rate"] == pytest.approx(2496 / 8480)
    # vllm bench serve's own acceptance length over its window agrees: nothing accepted
    assert figures["bench_acceptance_length"] == 1.0
