"""Knobs as data: every rule resolvable in one pass, every default valid, README tables generated."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from qwen_serving import knobs
from qwen_serving.knobs import KNOBS, KnobError, Ref

REPO = Path(__file__).resolve().parents[1]
TABLES = {"README.md": "common", "batch/README.md": "batch", "single-user/README.md": "single"}
ISSUE_KNOBS = """MODEL HOST PORT MAX_SEQS MAX_LEN GPU_UTIL KV_MEM CTX KV SPEC DRAFT_TOKENS DFLASH_TOKENS DFLASH_MAX_LEN
DRAFT DRAFT_SAMPLE SPEC_ATTN MTP_DRAFT_VOCAB PREFIX_CACHE INT8_ACT INT8_LAYERS PREFILL_ATTN TOOLS
TOOL_PARSER VISION VISION_OFFLOAD REQ_METRICS API_SERVERS ASYNC_SCHED CUDAGRAPH_MODE EXTRA_ARGS LOOKUP
VLLM_DFLASH2_LOOKUP_NMIN""".split()
# knobs for features not built yet: offered again when the issue that builds them lands them
NOT_BUILT: tuple[str, ...] = ()


def test_every_knob_the_launchers_promise_exists():
    names = {k.name for k in KNOBS}
    assert set(ISSUE_KNOBS) <= names
    assert not names & set(NOT_BUILT)
    assert len(names) == len(KNOBS)


def test_values_has_one_typed_field_per_knob():
    fields = [f.name for f in dataclasses.fields(knobs.Values)]
    assert fields == ["mode", "explicit", *(k.name.lower() for k in KNOBS)]
    for mode in knobs.MODES:
        v = knobs.Values.of(mode, knobs.resolve(mode, {}))
        hints = typing.get_type_hints(knobs.Values)
        for k in KNOBS:
            assert isinstance(getattr(v, k.name.lower()), hints[k.name.lower()]), (mode, k.name)
    assert knobs.Values.of("batch", knobs.resolve("batch", {})).spec == "off"  # batch never speculates


def test_every_rendering_knob_has_one_place_in_the_render_order():
    rendering = {k.name for k in KNOBS if k.argv or k.export}
    order = [n for n in knobs.RENDER_ORDER if n != knobs.BATCHED_TOKENS]
    assert sorted(order) == sorted(rendering) and len(order) == len(set(order))


def test_rules_only_read_knobs_resolved_before_them():
    for mode in knobs.MODES:
        seen: set[str] = set()
        names = {k.name for k in knobs.knobs_for(mode)}
        for knob in knobs.knobs_for(mode):
            for rule in knob.defaults:
                if "mode" in rule.when and not knobs.holds(rule.when["mode"], mode):
                    continue
                if any(key != "mode" and key not in names for key in rule.when):
                    continue  # a rule for the other mode's knobs never matches here
                for key in rule.when:
                    if key != "mode":
                        assert key in seen, f"{knob.name} reads {key} before it is resolved"
                if isinstance(rule.value, Ref):
                    assert rule.value.knob in seen
            assert not knob.defaults[-1].when or knob.defaults[-1].when.keys() == {"mode"}, knob.name
            seen.add(knob.name)


@pytest.mark.parametrize("mode", knobs.MODES)
def test_every_default_is_a_value_its_own_parser_accepts(mode):
    for knob in knobs.knobs_for(mode):
        for rule in knob.defaults:
            if isinstance(rule.value, Ref) or rule.value in ("", "auto"):
                continue
            assert knob.parse(str(rule.value)) == rule.value, knob.name
        assert knob.doc and "\n" not in knob.doc
        for sample in knob.samples:  # tests/test_knob_effects.py tries each knob at these
            knob.parse(sample)


def test_resolve_reads_env_and_falls_back_to_rules():
    s = knobs.resolve("single", {"SPEC": "dflash2", "DFLASH_TOKENS": "15", "PORT": ""})
    assert s["SPEC"].source == "env" and s["PORT"].value == 18020  # empty counts as unset
    assert s["MAX_SEQS"].value == 4 and s["MAX_LEN"].value == s["DFLASH_MAX_LEN"].value
    assert knobs.resolve("single", {"KV_MEM": ""})["KV_MEM"].value == ""
    assert knobs.resolve("single", {"KV_MEM": "5.2GiB"})["KV_MEM"].value == int(5.2 * (1 << 30))
    assert knobs.resolve("batch", {})["MAX_SEQS"].value == 64
    with pytest.raises(KnobError, match="mode 'both'"):
        knobs.resolve("both", {})


def test_loopback():
    assert all(map(knobs.is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(knobs.is_loopback, ["0.0.0.0", "::", "192.168.1.2", "example.org"]))


def table_in(path: Path) -> str:
    text = path.read_text()
    match = re.search(r"<!-- knobs:begin -->\n(.*?)<!-- knobs:end -->", text, re.S)
    assert match, f"{path} has no <!-- knobs:begin --> ... <!-- knobs:end --> block"
    return match.group(1)


@pytest.mark.parametrize(("readme", "mode"), TABLES.items())
def test_readme_tables_are_generated(readme, mode):
    """Fails when a README's knob table drifts from knobs.py: regenerate with the command below."""
    expected = knobs.markdown(mode)
    assert table_in(REPO / readme) == expected, (
        f"{readme} is stale: python -m qwen_serving.knobs --markdown --mode {mode} --update {readme}")


def test_markdown_tables_are_well_formed():
    for mode in ("batch", "single", "common"):
        rows = knobs.markdown(mode).strip().splitlines()
        widths = {len(re.findall(r"(?<!\\)\|", row)) for row in rows}
        assert len(widths) == 1, f"{mode}: a cell carries an unescaped |"


def test_update_rewrites_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- knobs:begin -->\nold\n<!-- knobs:end -->\n\ntail\n")
    assert knobs.update_readme(readme, "batch") is True
    assert readme.read_text() == "# x\n\n<!-- knobs:begin -->\n" + knobs.markdown("batch") + "<!-- knobs:end -->\n\ntail\n"
    assert knobs.update_readme(readme, "batch") is False
    (tmp_path / "plain.md").write_text("no markers\n")
    with pytest.raises(KnobError, match="no <!-- knobs:begin -->"):
        knobs.update_readme(tmp_path / "plain.md", "batch")


def test_cli_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "qwen_serving.knobs", "--markdown", "--mode", "single"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert out == knobs.markdown("single")
