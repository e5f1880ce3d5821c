"""bench/verbatim.py: the judge's verdict on each shape the spec saw (empty, truncated, fluent but wrong) and on a
clean copy and a copy with one corrupted token, its figures, its CLI, and the exact-length prompt layout against
the labd fake vLLM's tokenizer."""

from __future__ import annotations

import random

import pytest

from bench import serving
from bench import verbatim as vb
from tests.helpers.labd_server import FakeVllm


@pytest.mark.parametrize("name,document,answer,expected", vb.self_test_cases(), ids=lambda v: v if isinstance(v, str)
                         and len(v) < 60 else "")
def test_every_self_test_shape_gets_its_verdict(name, document, answer, expected):
    result = vb.judge(document, answer)
    assert result.verdict == expected, (name, result)
    assert result.passed == (expected in vb.PASSING)


def test_the_figures_of_a_copy_with_one_corrupted_token():
    doc = random.Random(5).sample(range(50_000), 300)
    answer = doc[:120] + [doc[120] + 1] + doc[121:]
    result = vb.judge(doc, answer)
    assert (result.common_prefix, result.first_divergence) == (120, 120)
    assert result.longest_run == 179 and result.runs == 2  # the runs on either side of the changed token
    assert result.coverage == pytest.approx(299 / 300)
    assert result.verdict == "corrupted" and not result.passed


def test_a_clean_copy_has_no_divergence_and_a_truncated_one_diverges_where_it_stops():
    doc = list(range(100, 400))
    assert vb.judge(doc, doc).first_divergence is None
    truncated = vb.judge(doc, doc[:90])
    assert (truncated.first_divergence, truncated.coverage, truncated.verdict) == (90, 0.3, "truncated")


def test_fluent_but_wrong_text_covers_almost_nothing_and_a_fenced_copy_all_of_it():
    en, da = vb.TEXTS.joinpath("en.txt").read_text(), vb.TEXTS.joinpath("da.txt").read_text()
    wrong = vb.judge(en, da)
    assert wrong.verdict == "unrelated" and wrong.coverage < 0.02 and wrong.common_prefix == 0
    fenced = vb.judge(en, "```\n" + en + "\n```")
    assert (fenced.verdict, fenced.coverage, fenced.common_prefix) == ("embedded", 1.0, 0)


def test_a_copy_that_skips_a_paragraph_is_corrupted_with_the_runs_around_the_gap():
    text = vb.TEXTS.joinpath("en.txt").read_text().strip()
    paragraphs = text.split("\n\n")
    answer = "\n\n".join(paragraphs[:2] + paragraphs[3:])
    result = vb.judge(text, answer)
    assert result.verdict == "corrupted" and result.runs == 2
    assert result.first_divergence == len("\n\n".join(paragraphs[:2])) + 2
    assert result.coverage == pytest.approx(1 - (len(paragraphs[2]) + 2) / len(text), abs=1e-3)


def test_text_and_ids_are_never_compared():
    with pytest.raises(TypeError):
        vb.judge("abc", [1, 2, 3])


def test_the_cli_self_test_passes_and_judges_files(tmp_path, capsys):
    assert vb.main([]) == 0
    assert "12/12 shapes judged as expected" in capsys.readouterr().out
    doc, answer = tmp_path / "doc.txt", tmp_path / "answer.txt"
    doc.write_text("one two three four five six seven eight nine ten eleven twelve")
    answer.write_text("one two three")
    assert vb.main(["--document", str(doc), "--answer", str(answer)]) == 1
    assert capsys.readouterr().out.startswith("truncated:")
    with pytest.raises(SystemExit):
        vb.main(["--document", str(doc)])


def test_a_layout_gives_every_length_exactly():
    layout = vb.Layout([1, 2, 3], 9, [4, 5])
    assert layout.prompt(6) == [1, 2, 3, 9, 4, 5] and layout.prompt(9) == [1, 2, 3, 9, 9, 9, 9, 4, 5]
    with pytest.raises(ValueError, match="shorter than its layout"):
        layout.prompt(5)


def test_the_filler_is_found_in_the_servers_own_chat_template():
    with FakeVllm() as server:
        client = serving.Client(server.url)
        tokenizer = vb.ServerTokenizer(client, "fake")
        layout = tokenizer.padded("", "\n\nReproduce this.\n\n<document>\nabc\n</document>")
        for length in (layout.minimum, layout.minimum + 37):
            prompt = layout.prompt(length)
            assert len(prompt) == length
            # the same ids the server gives the message with that many filler units
            units = length - len(layout.head) - len(layout.tail)
            assert prompt == tokenizer.chat(" ." * units + "\n\nReproduce this.\n\n<document>\nabc\n</document>")
