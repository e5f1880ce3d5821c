"""bench/residue_sweep.py against the labd fake vLLM (tests/helpers/labd_server.py): a server that damages the
cache-hit answer at exactly one prompt-length residue is caught at that residue, with the damage's shape, and a
clean one passes 128/128; the prompt lengths, the cache pairs and the argument errors."""

from __future__ import annotations

import json

import pytest

from bench import residue_sweep as rs
from tests.helpers.labd_server import FakeVllm, write_design


@pytest.fixture(scope="module")
def design(tmp_path_factory):
    model = tmp_path_factory.mktemp("scripted")
    write_design(model, list(range(1000, 1600)))
    return model


def sweep(server, tmp_path, *extra) -> tuple[int, dict]:
    rc = rs.main(["t", "--url", server.url, "--out", str(tmp_path), *extra])
    return rc, json.loads((tmp_path / "t-residue.json").read_text())


def test_one_corrupted_residue_out_of_128_is_named_with_its_shape(design, tmp_path, capsys):
    with FakeVllm("--design", design, "--tokens-per-step", 3, "--corrupt-visit", 2, "--corrupt-residue", 121) as server:
        rc, report = sweep(server, tmp_path, "--scripted", str(design), "--doc-tokens", "40", "--drafts", "4")
    assert rc == 1
    summary = report["summary"]
    assert (summary["passed"], summary["residues"], summary["failed_residues"]) == (127, 128, [121])
    [failure] = summary["failed"]
    assert failure["pass"] == "cached" and failure["verdict"] == "corrupted" and failure["first_divergence"] == 16
    assert summary["suspect_residue"] == 121 and summary["suspect_passed"] is False  # 117 + 4 drafts
    rows = report["rows"]
    assert [row["residue"] for row in rows] == list(range(128))
    assert all(row["length"] % 128 == row["residue"] and row["cold"]["prompt_tokens"] == row["length"] for row in rows)
    # every pair: the cold request hit nothing, its twin the prompt's whole blocks
    assert all(row["cold"]["cache_hit_tokens"] == 0 and row["cached"]["cache_hit_tokens"] > 0 for row in rows)
    assert summary["cached_twins_hit_cache"] == 128
    assert rows[0]["cold"]["tokens_per_step"] == pytest.approx(32 / 11, abs=1e-4)  # 32 tokens in ceil(32 / 3) steps
    assert report["machine"]["hostname"] and report["server"]["vllm_version"] == "0.28.0-fake" and report["date"]
    out = capsys.readouterr().out
    assert "FAILED r=121 (L=249) cached: corrupted" in out and "127/128 residues passed" in out


def test_a_clean_server_passes_and_a_cold_request_is_never_answered_from_an_earlier_run(design, tmp_path):
    with FakeVllm("--design", design) as server:
        rc, report = sweep(server, tmp_path, "--scripted", str(design), "--doc-tokens", "24", "--residues", "0-3")
        assert rc == 0 and report["summary"]["passed"] == 4
        rc, again = sweep(server, tmp_path, "--scripted", str(design), "--doc-tokens", "24", "--residues", "0-3",
                          "--force")
    assert rc == 0 and all(row["cold"]["cache_hit_tokens"] == 0 for row in again["rows"])
    assert again["settings"]["run_id"] != report["settings"]["run_id"]


def test_the_base_clears_one_cache_block_and_twins_that_miss_the_cache_fail_the_sweep(design, tmp_path, capsys):
    # visit 13: a 448-token block, base 384, and not one of 128 twins hit the cache
    with FakeVllm("--design", design, "--block-size", 448) as server:
        rc, report = sweep(server, tmp_path, "--scripted", str(design), "--doc-tokens", "24", "--residues", "0-3")
        assert report["settings"]["base"] == 512  # 449 tokens hold one whole block before the last token
        assert rc == 0 and report["summary"]["cached_twins_hit_cache"] == 4
        assert all(row["cached"]["cache_hit_tokens"] == 448 for row in report["rows"])
        rc, short = sweep(server, tmp_path, "--scripted", str(design), "--doc-tokens", "24", "--residues", "0-3",
                          "--base", "384", "--force")
    assert short["summary"]["passed"] == 4 and short["summary"]["cached_twins_hit_cache"] == 0 and rc == 1
    assert "only 0 of 4 cached twins hit the prefix cache" in capsys.readouterr().out
    assert rs.default_base(300, None) == 384 and rs.default_base(100, 127) == 128 and rs.default_base(100, 128) == 256
    assert rs.default_base(300, 448, 2) == 1024 and rs.default_base(1500, 448, 2) == 1536  # two blocks, or the prompt
    dflash2 = {"cache_config": {"block_size": "448", "mamba_cache_mode": "align"},
               "vllm_config": {"speculative_config": {"method": "dflash", "num_speculative_tokens": 7}}}
    assert rs.blocks_before_a_hit(dflash2) == 2 and rs.block_size_of(dflash2) == 448
    assert rs.blocks_before_a_hit({**dflash2, "vllm_config": {"speculative_config": None}}) == 1  # no drafter
    assert rs.blocks_before_a_hit({**dflash2, "cache_config": {"mamba_cache_mode": "none"}}) == 1


@pytest.mark.parametrize("shape,verdict", [("empty", "empty"), ("truncated", "truncated"), ("unrelated", "unrelated")])
def test_text_prompts_catch_each_shape_of_the_damage(tmp_path, shape, verdict):
    with FakeVllm("--corrupt-visit", 2, "--corrupt-residue", 5, "--corrupt-shape", shape) as server:
        rc, report = sweep(server, tmp_path, "--residues", "3-6", "--doc-chars", "300")
    assert rc == 1 and report["summary"]["failed_residues"] == [5]
    assert report["summary"]["failed"][0]["verdict"] == verdict
    row = report["rows"][0]
    assert row["cold"]["units"] == "chars" and row["cold"]["verdict"] == "verbatim"
    assert row["cold"]["document_len"] <= 300 and report["settings"]["base"] % 128 == 0


def test_bad_arguments_are_refused(tmp_path):
    assert rs.parse_residues("0-3,117") == [0, 1, 2, 3, 117]
    for bad in ("0-128", "x", ""):
        with pytest.raises(ValueError):
            rs.parse_residues(bad)
    for argv in (["--base", "100"], ["--residues", "200"], ["--scripted", str(tmp_path)], ["--doc-tokens", "8"]):
        with pytest.raises(SystemExit):
            rs.parse_args(argv)


def test_an_existing_report_is_kept_and_a_missing_server_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "t-residue.json").write_text("{}")
    assert rs.main(["t", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 2
    assert rs.main(["u", "--url", "http://127.0.0.1:9", "--out", str(tmp_path)]) == 3
    assert "no usable vLLM server" in capsys.readouterr().err
    assert (tmp_path / "t-residue.json").read_text() == "{}"
