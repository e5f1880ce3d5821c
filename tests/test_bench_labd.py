"""bench/labd_bench.py and bench/labd_soak.py against the labd fake vLLM (tests/helpers/labd_server.py): tokens per
step from the server's spec-decode counters and the decode rate per task, the scripted documents' construction
(how much of each answer the document holds), the text document at a context length, and the soak catching the
round whose copy differs."""

from __future__ import annotations

import json

import pytest

from bench import labd_bench as lb
from bench import labd_soak as ls
from bench import verbatim as vb
from tests.helpers.labd_server import FakeVllm, write_design


@pytest.fixture(scope="module")
def design(tmp_path_factory):
    model = tmp_path_factory.mktemp("scripted")
    write_design(model, list(range(1000, 5000)))
    return model


def test_tokens_per_step_and_decode_rate_per_task_from_the_servers_counters(design, tmp_path, capsys):
    with FakeVllm("--design", design, "--tokens-per-step", 2.5, "--chunk-sleep", 0.001) as server:
        rc = lb.main(["b", "--url", server.url, "--scripted", str(design), "--ctx", "6000", "--max-tokens", "100",
                      "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "b-labd.json").read_text())
    assert list(report["tasks"]) == list(lb.TASKS)
    for row in report["tasks"].values():
        # 100 tokens in ceil(100 / 2.5) = 40 verify steps: 40 drafts, 60 accepted
        assert (row["drafts"], row["accepted_tokens"], row["tokens_per_step"]) == (40, 60, 2.5)
        assert row["completion_tokens"] == 100 and row["decode_tok_s"] > 0 and row["ttft_ms"] > 0
        assert row["verdict"] == "verbatim" and row["prompt_tokens"] <= 6000
        assert row["cache_hit_tokens"] > 0  # the warm-up put the document in the prefix cache
    assert report["all"]["tokens_per_step"] == 2.5 and report["all"]["completion_tokens"] == 600
    assert report["machine"]["gpu"] and report["server"]["vllm_version"] == "0.28.0-fake" and report["date"]
    assert "| copy | 2.5 |" in capsys.readouterr().out


def test_overall_tokens_per_step_weighs_tasks_by_their_steps():
    rows = {"a": {"drafts": 10, "accepted_tokens": 90, "completion_tokens": 100, "decode_s": 1.0},
            "b": {"drafts": 30, "accepted_tokens": 0, "completion_tokens": 30, "decode_s": 1.0}}
    assert lb.overall(rows) == {"tokens_per_step": 1 + 90 / 40, "decode_tok_s": (99 + 29) / 2.0,
                                "completion_tokens": 130}


def _shared(answer: list[int], prompt: list[int]) -> int:
    """How many leading answer tokens the prompt holds right after the answer's cue."""
    return vb.judge(prompt, answer).longest_run


def test_each_scripted_task_quotes_its_share_of_the_answer_and_no_more(design):
    cases, facts = lb.scripted_cases(design, 0, list(lb.TASKS), 8192, None)
    assert facts["document_tokens"] == 8192 - 8 - 1024
    for case in cases:
        assert len(case.prompt) + case.max_tokens <= 8192 and case.expected == vb.ScriptedChain(design).answer(
            case.prompt[-1], case.max_tokens)
        quoted = round(lb.TASKS[case.name].quoted_share * case.max_tokens)
        assert _shared(case.expected, case.prompt[:-8]) == quoted, case.name
    # no two answers share a token: every task walks its own part of the cycle
    seen = [t for case in cases for t in case.expected]
    assert len(seen) == len(set(seen))
    with pytest.raises(ValueError, match="too short"):
        lb.scripted_cases(design, 0, list(lb.TASKS), 1500, None)


def test_a_cycle_too_short_for_the_answers_is_refused(tmp_path):
    write_design(tmp_path, list(range(1000, 1600)))
    with pytest.raises(ValueError, match="need 3696 distinct chain tokens, the cycle has 600"):
        lb.scripted_cases(tmp_path, 0, list(lb.TASKS), 20000, None)
    assert len(lb.scripted_cases(tmp_path, 0, list(lb.TASKS), 20000, 80)[0]) == 6


def test_the_bundled_texts_are_repeated_to_fill_the_context(tmp_path):
    with FakeVllm("--tokens-per-step", 3) as server:
        rc = lb.main(["b", "--url", server.url, "--ctx", "30000", "--tasks", "copy,qa", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "b-labd.json").read_text())
    settings = report["settings"]
    target = 30000 - 1024 - 256  # the context less the longest answer and the prompt around the document
    assert settings["source_copies"] >= 2 and target - 800 <= settings["document_tokens"] <= target
    # the fake's tokenizer spends a token per character: 60 lines of code do not fit the copy's 1,024 tokens
    assert "below the" in settings["copy_not_judged"] and "verdict" not in report["tasks"]["copy"]
    assert report["tasks"]["qa"]["tokens_per_step"] == pytest.approx(3, abs=0.02)


def test_a_text_documents_copy_is_judged_on_its_first_60_lines(tmp_path):
    document = tmp_path / "doc.txt"
    document.write_text("\n".join(f"make t{i}" for i in range(2000)))
    with FakeVllm("--tokens-per-step", 3) as server:
        rc = lb.main(["b", "--url", server.url, "--ctx", "8000", "--document", str(document), "--tasks", "copy,qa",
                      "--out", str(tmp_path)])
    report = json.loads((tmp_path / "b-labd.json").read_text())
    copy = report["tasks"]["copy"]
    assert rc == 0 and copy["units"] == "chars" and copy["document_len"] == len("\n".join(
        document.read_text().splitlines()[:60]))
    assert copy["verdict"] == "embedded"  # the fake copies the whole document, on past the 60 lines
    assert report["settings"]["source_copies"] == 1 and report["settings"]["document_tokens"] <= 8000 - 1024 - 256


def test_bench_arguments_are_checked():
    for argv in (["--tasks", "copy,bogus"], ["--tasks", "copy,copy"], ["--ctx", "100"], ["--max-tokens", "0"]):
        with pytest.raises(SystemExit):
            lb.parse_args(argv)
    for argv in (["--others", "quote,summary"], ["--others", "copy,summary,qa"], ["--rounds", "1"]):
        with pytest.raises(SystemExit):
            ls.parse_args(argv)


def soak(server, design, tmp_path, *extra) -> tuple[int, dict]:
    rc = ls.main(["s", "--url", server.url, "--scripted", str(design), "--max-tokens", "96", "--jitter-ms", "20",
                  "--out", str(tmp_path), *extra])
    return rc, json.loads((tmp_path / "s-labd-soak.json").read_text())


def test_the_soak_passes_when_every_round_is_the_same(design, tmp_path):
    with FakeVllm("--design", design, "--chunk-sleep", 0.002) as server:
        rc, report = soak(server, design, tmp_path)
    assert rc == 0 and report["summary"]["passed"] and report["summary"]["copy_identical_rounds"] == 3
    for round_ in report["rounds"]:
        assert set(round_["requests"]) == {"copy", "quote", "summary", "qa"}
        assert round_["requests"]["copy"]["verdict"] == "verbatim"
    assert report["summary"]["batches_formed"] == 3  # the four were in flight together every round


def test_the_soak_names_the_round_whose_copy_differs(design, tmp_path, capsys):
    # the fake damages every answer the third time it sees its prompt: round 3
    with FakeVllm("--design", design, "--chunk-sleep", 0.002, "--corrupt-visit", 3) as server:
        rc, report = soak(server, design, tmp_path, "--rounds", "4")
    summary = report["summary"]
    assert rc == 1 and not summary["passed"]
    assert summary["copy_differing_rounds"] == [3] and summary["copy_not_verbatim_rounds"] == [3]
    copy = report["rounds"][2]["requests"]["copy"]
    assert copy["first_divergence"] == 48 and copy["verdict"] == "corrupted"
    assert summary["others_differing_rounds"] == {"quote": [3], "summary": [3], "qa": [3]}
    assert "round 3: copy DIFFERS from token 48" in capsys.readouterr().out


def test_the_soak_compares_rounds_even_where_the_answer_is_not_known(tmp_path):
    with FakeVllm("--chunk-sleep", 0.002, "--corrupt-visit", 2, "--corrupt-shape", "truncated") as server:
        rc = ls.main(["s", "--url", server.url, "--ctx", "4096", "--max-tokens", "64", "--jitter-ms", "10",
                      "--out", str(tmp_path)])
    report = json.loads((tmp_path / "s-labd-soak.json").read_text())
    assert rc == 1 and report["summary"]["copy_differing_rounds"] == [2]
    assert "copy_not_judged" in report["settings"]  # 64 tokens cannot hold the copy's 60 lines
