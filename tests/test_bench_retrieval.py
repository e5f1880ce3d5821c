"""bench/retrieval_depth.py: the depth prompt on the tiny scripted checkpoint (the segment starts at the depth, and the
CPU reference's greedy continuation is the segment), then the tool against the labd fake vLLM
(tests/helpers/labd_server.py, which walks the design's chain as the scripted model's greedy decoding does): a correct
server passes every depth, a server that loses positions past a point fails exactly the depths beyond it, depths
beyond max_model_len are skipped (the fake refuses such requests, as vLLM does), a run resumes, and the follow-up turn
records two TTFTs and the prefix-cache hit tokens of each."""

from __future__ import annotations

import json

import pytest
import torch

from bench import retrieval_depth as rd
from bench import serving
from qwen_serving.checkpoint import scripted, synth
from qwen_serving.checkpoint.scripted_reference import Reference
from tests.helpers.labd_server import BLOCK, FakeVllm, write_design

SEGMENT = rd.SEGMENT_TOKENS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("scripted") / "tiny"
    assert synth.main(["--size", "tiny", "--out", str(out), "--seed", "0", "--behaviour", "scripted"]) == 0
    return out


@pytest.fixture(scope="module")
def design(tmp_path_factory):
    model = tmp_path_factory.mktemp("fake-scripted")
    write_design(model, list(range(1000, 1600)))
    return model


@pytest.mark.parametrize("depth,after", [(8, 0), (137, 40), (700, 16)])
def test_the_segment_starts_at_the_depth_and_the_reference_continues_with_it(tiny, depth, after):
    d = scripted.Design.read(tiny)
    built = scripted.depth_prompt(d, seed=4, depth=depth, segment_len=24, cue_len=8, after=after)
    ids, segment = built["ids"], built["continuation"]
    assert built["quoted_span"] == [depth, depth + 24] and ids[depth:depth + 24] == segment
    assert len(ids) == depth + 24 + after + 8
    # one chain run: the cue before the segment, and the same cue ends the prompt
    assert ids[depth - 8:depth + 24] == d.walk(ids[depth - 8], 31) and ids[-8:] == ids[depth - 8:depth]
    # the segment's tokens sit only at the quote, and no filler token's chain successor lies in the quote
    quote = set(ids[depth - 8:depth + 24])
    filler = ids[:depth - 8] + ids[depth + 24:-8]
    assert all(ids.count(t) == 1 for t in segment) and not quote & set(filler)
    assert not {d.next_in_chain(t) for t in filler} & quote
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        logits = Reference(tiny).logits([*ids, *segment[:-1]])
    finally:
        torch.set_num_threads(threads)
    assert logits[len(ids) - 1:].argmax(-1).tolist() == segment  # greedy reproduces the segment


def test_the_depth_prompt_refuses_what_it_cannot_build(tiny):
    d = scripted.Design.read(tiny)
    with pytest.raises(ValueError, match="0 < cue <= depth"):
        scripted.depth_prompt(d, 0, depth=4, segment_len=24, cue_len=8)
    with pytest.raises(ValueError, match="do not fit the 255-token cycle"):
        scripted.depth_prompt(d, 0, depth=100, segment_len=250, cue_len=8)


def run(server, design, tmp_path, *extra) -> tuple[int, dict]:
    rc = rd.main(["t", "--url", server.url, "--scripted", str(design), "--out", str(tmp_path), *extra])
    return rc, json.loads((tmp_path / "retrieval-t.json").read_text())


def requests_served(server) -> int:
    return int(serving.counter_total(serving.get_text(server.url + "/metrics"), "vllm:request_success"))


def test_a_correct_server_passes_every_depth_that_fits_and_the_rest_are_skipped(design, tmp_path, capsys):
    with FakeVllm("--design", design, "--max-model-len", 3000, "--chunk-sleep", 0.001) as server:
        rc, report = run(server, design, tmp_path, "--depths", "256,1024,2048,4096", "--followup-prefix", "1000")
    assert rc == 0 and report["summary"]["passed"]
    for depth in (256, 1024, 2048):
        row = report["depths"][str(depth)]
        assert row["placed_at"] == depth and row["verbatim"] and row["first_divergence"] is None
        assert (row["tokens_reproduced"], row["segment_tokens"], row["reproduced_fraction"]) == (SEGMENT, SEGMENT, 1.0)
        assert row["prompt_tokens"] == row["prompt_tokens_sent"] == depth + SEGMENT + rd.AFTER_TOKENS + rd.CUE_TOKENS
        assert row["cache_hit_tokens"] == 0  # every depth is cold
    skipped = report["depths"]["4096"]
    assert "verbatim" not in skipped and "max_model_len is 3,000" in skipped["skipped"]
    assert report["summary"]["skipped_depths"] == [4096] and report["summary"]["failed_depths"] == []
    assert report["identity"]["max_model_len"] == 3000 and report["server"]["model"]["max_model_len"] == 3000
    assert report["machine"]["hostname"] and report["date"] and report["server"]["vllm_version"] == "0.28.0-fake"
    followup = report["followup"]
    assert followup["prefix_tokens"] == 1000 and followup["placed_at"] == 500 and followup["verbatim"]
    assert all(ms is not None and ms > 0 for ms in followup["ttft_ms"])
    # cold: nothing cached under this run's salt; the follow-up: the first turn's whole blocks (never its last token)
    assert followup["cache_hit_tokens"] == [0, BLOCK * ((1000 - 1) // BLOCK)]
    assert followup["cached"]["prompt_tokens"] == 1000 + SEGMENT + rd.FOLLOWUP_SUFFIX + rd.CUE_TOKENS
    captured = capsys.readouterr()
    assert "3/3 depths verbatim, 1 skipped" in captured.out and "| 4,096 | - | - | - | skipped:" in captured.out
    assert "retrieval   [" in captured.err and "] 5/5 " in captured.err  # the progress bar: 4 depths, the follow-up


def test_a_server_that_loses_the_segment_past_a_depth_fails_exactly_those_depths(design, tmp_path, capsys):
    with FakeVllm("--design", design, "--max-model-len", 6000, "--lose-from", 1500) as server:
        rc, report = run(server, design, tmp_path, "--depths", "256,1024,2048,4096,8192", "--followup-prefix", "2000")
    summary = report["summary"]
    assert rc == 1 and not summary["passed"]
    assert summary["failed_depths"] == [2048, 4096] and summary["skipped_depths"] == [8192]
    assert summary["verbatim"] == 2 and summary["run"] == 4
    for depth in (2048, 4096):
        row = report["depths"][str(depth)]
        # the fake changes the middle token of a damaged answer
        assert not row["verbatim"] and row["verdict"] == "corrupted"
        assert row["first_divergence"] == row["tokens_reproduced"] == SEGMENT // 2
    assert report["followup"]["verbatim"]  # its segment sits at 1,000, before the lost positions
    assert "| 2,048 | 2,048 |" in capsys.readouterr().out


def test_a_run_resumes_without_rerunning_what_it_finished(design, tmp_path):
    with FakeVllm("--design", design) as server:
        rc, first = run(server, design, tmp_path, "--depths", "256,1024", "--followup-prefix", "1000")
    assert rc == 0 and first["summary"]["verbatim"] == 2
    # a server that damages every answer: only the new depth is asked, and fails; the finished rows stay
    with FakeVllm("--design", design, "--lose-from", 0) as server:
        rc, resumed = run(server, design, tmp_path, "--depths", "256,1024,2048", "--followup-prefix", "1000")
        assert requests_served(server) == 1
        assert rc == 1 and resumed["summary"]["failed_depths"] == [2048] and resumed["resumed"]
        assert resumed["depths"]["256"] == first["depths"]["256"] and resumed["followup"] == first["followup"]
        assert resumed["date"] == first["date"]
        # other settings are another run: refused, the report kept
        before = (tmp_path / "retrieval-t.json").read_text()
        assert rd.main(["t", "--url", server.url, "--scripted", str(design), "--out", str(tmp_path),
                        "--segment-tokens", "32"]) == 2
        assert (tmp_path / "retrieval-t.json").read_text() == before
        rc, forced = run(server, design, tmp_path, "--depths", "256,1024,2048", "--followup-prefix", "1000", "--force")
    assert rc == 1 and forced["summary"]["failed_depths"] == [256, 1024, 2048] and "resumed" not in forced
    assert forced["followup"]["verbatim"] is False


def test_prompt_tokens_makes_every_prompt_one_length_and_a_finished_run_sends_nothing(design, tmp_path):
    with FakeVllm("--design", design, "--max-model-len", 2000) as server:
        rc, report = run(server, design, tmp_path, "--depths", "64,900", "--prompt-tokens", "1200",
                         "--followup-prefix", "0")
    assert rc == 0 and report["followup"] is None
    assert [report["depths"][d]["prompt_tokens_sent"] for d in ("64", "900")] == [1200, 1200]
    assert report["identity"]["after_tokens"] is None and report["identity"]["prompt_tokens"] == 1200
    with FakeVllm("--design", design, "--max-model-len", 2000) as server:
        rc, again = run(server, design, tmp_path, "--depths", "64,900", "--prompt-tokens", "1200",
                        "--followup-prefix", "0")
        assert rc == 0 and requests_served(server) == 0 and again["summary"]["verbatim"] == 2


def test_a_request_that_fails_is_reported_and_runs_again_on_resume(design, tmp_path, capsys):
    with FakeVllm("--design", design, "--fail-longer-than", 1000) as server:
        rc, report = run(server, design, tmp_path, "--depths", "64,800", "--followup-prefix", "0")
    assert rc == 1 and not report["summary"]["passed"] and "800" not in report["depths"]
    assert report["depths"]["64"]["verbatim"]
    [error] = report["errors"]
    assert error["request"] == "depth 800" and "HTTP 500" in error["error"]
    assert "FAILED to run the depth 800 request" in capsys.readouterr().out
    with FakeVllm("--design", design) as server:
        rc, resumed = run(server, design, tmp_path, "--depths", "64,800", "--followup-prefix", "0")
        assert requests_served(server) == 1
    assert rc == 0 and resumed["errors"] == [] and resumed["depths"]["800"]["verbatim"]


def test_arguments_are_checked(design, tmp_path):
    assert rd.parse_depths("8k, 64k,300") == [300, 8192, 65536]
    for bad in ("", "8m", "-1"):
        with pytest.raises(ValueError):
            rd.parse_depths(bad)
    base = ["t", "--scripted", str(design)]
    for extra in (["--depths", "4"], ["--segment-tokens", "0"], ["--prompt-tokens", "1000", "--depths", "990"],
                  ["--followup-prefix", "40"], ["--after-tokens", "-1"], ["--prompt-tokens", "900", "--after-tokens",
                                                                          "3"]):
        with pytest.raises(SystemExit):
            rd.parse_args([*base, *extra])
    for argv in (["t"], ["t", "--scripted", str(tmp_path)], ["../t", "--scripted", str(design)]):
        with pytest.raises(SystemExit):
            rd.parse_args(argv)


def test_no_server_is_a_clear_error(design, tmp_path, capsys):
    assert rd.main(["t", "--url", "http://127.0.0.1:9", "--scripted", str(design), "--out", str(tmp_path)]) == 3
    assert "no usable vLLM server" in capsys.readouterr().err and not (tmp_path / "retrieval-t.json").exists()


def test_the_metrics_are_read_while_each_request_runs_into_a_file_beside_the_report(design, tmp_path):
    with FakeVllm("--design", design, "--max-model-len", 3000, "--chunk-sleep", 0.002) as server:
        rc, report = run(server, design, tmp_path, "--depths", "256,1024", "--watch-every", "0.05")
    assert rc == 0, report
    lines = [json.loads(line) for line in (tmp_path / "retrieval-t-progress.jsonl").read_text().splitlines()]
    assert {line["label"] for line in lines} <= {"depth 256", "depth 1024"} and lines
    assert all("error" not in line and line["t_s"] > 0 for line in lines), lines[:3]
    assert any(line["running"] == 1 for line in lines)  # read while the request was in the engine
