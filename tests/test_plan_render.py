"""The plan renders every configuration of tests/helpers/plan_render.py exactly as it did before the
Structure refactor (tests/fixtures/plan-render.json, rendered on main before any change).

One difference is expected: the stub knobs removed until their features land (LOOKUP,
VLLM_DFLASH2_LOOKUP_*, VISION_OFFLOAD and the VLLM_VISION_CPU_OFFLOAD it exported). Every output line
that names one is dropped from both sides, and the filter must drop lines in exactly the runs where
the old plan printed a stub: `explain` (it lists every knob), the SPEC=dflash2 dry runs (they exported
VLLM_DFLASH2_LOOKUP*), the VISION=1 dry runs (VLLM_VISION_CPU_OFFLOAD) and the refusal that was a
stub's own (VLLM_DFLASH2_LOOKUP_NMIN above _NMAX). A configuration that sets a removed stub must now
render as if it were unset.

The KVarN refusal changed wording too (it no longer points at kvarn/install.sh, which does not
exist); no fixture output carries it (asserted below): the fixture's probe saw no vLLM, and the old plan
did not check the cache dtype then.

Issue #15 ("First start that works") changed three things on purpose, each filtered and asserted below:
- The draft vocabulary (item 1): the old single-mode first start always ran `build_draft_vocab.py --ids
  prepare/draft_vocab_ids.json`, a file that does not exist. The fixture's empty checkout has no list,
  so that step is gone from every single run; SPEC=mtp serves the full lm_head instead
  (`VLLM_MTP_DRAFT_VOCAB=0`, was 1) with a note naming calibrate.sh; explain shows the new DRAFT_IDS
  knob and an "MTP draft head" line. Lines about the draft vocabulary are compared apart (DRAFT_LINES).
- explain ends with a "# not checked yet" section (item 7): cut off the new output before comparing.
- False OKs (item 7): the old plan accepted CTX=huge / KV=kvarn (it only checked the cache dtype when it
  could read an installed vLLM) and an explicit MODEL that does not exist (only a note). Now they are
  refused before and after install: exactly the configurations in FALSE_OK went from rc 0 to rc 2.

Issue #24 ("Two cards: TP=2 as a first-class setting") added the TP knob and changed two things, each
asserted below: explain lists TP (`TP = 1 default`, dropped from the new output once, exactly), and the
tensor-parallel size no longer travels in EXTRA_ARGS: the configuration that passed it there is refused
with a pointer at TP (in FALSE_OK), and EXTRA_ARGS's one-line doc, which a refusal quotes, no longer
suggests it (OLD_EXTRA_ARGS_DOC is replaced by the new doc in the old output).

Issue #18 item 2 (lookup drafting) offers LOOKUP and VLLM_DFLASH2_LOOKUP_{NMIN,NMAX,NSTRONG,AGREE} again, now
read by patches/dflash2-lookup.patch (the spec's defaults: NSTRONG 8, AGREE 2); the old plan's other
VLLM_DFLASH2_LOOKUP_* stubs stay removed. Their lines are dropped from the new output too and asserted apart
(assert_lookup_lines_as_intended), and NMIN above NMAX is refused again, in the new words. Item 3 (the long verify
block) offers VLLM_DFLASH2_LOOKUP_STICKY again (read by patches/dflash2-verify-block.patch), exported beside them;
with DFLASH_TOKENS above 7 the plan notes why LOOKUP stays 1.

Issue #23 ("Images") added one derived line to explain with VISION=1: "vision tower" (the tower's weights and
the encoder cache the memory model counts), dropped from the new output (VISION_LINE), exactly once there and
nowhere else. The fixture's runs have no card, so no KV_MEM=auto figure (which now takes the encoder cache
out) is in it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qwen_serving import knobs
from tests.helpers.plan_render import CONFIGS, render

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "plan-render.json"
STUBS = re.compile(r"\b(LOOKUP|VLLM_DFLASH2_LOOKUP\w*|VISION_OFFLOAD|VLLM_VISION_CPU_OFFLOAD)\b")
LOOKUP_KNOBS = ("LOOKUP", *(var for var, *_ in knobs.LOOKUP_PARAMS), knobs.LOOKUP_STICKY)  # offered again (#18)
LOOKUP_LINE = re.compile(r"\b(LOOKUP|VLLM_DFLASH2_LOOKUP(_NMIN|_NMAX|_NSTRONG|_AGREE|_STICKY)?)\b")
BEFORE = json.loads(FIXTURE.read_text())
ACTIONS = ("--dry-run", "explain")
DRAFT_LINES = re.compile(r"build_draft_vocab|VLLM_MTP_DRAFT_VOCAB|^(note: )?MTP_DRAFT_VOCAB|^DRAFT_IDS |^MTP draft head ",
                         re.M)
NOT_CHECKED = "# not checked yet\n"
FALSE_OK = {("single", "CTX", "huge"): "CTX=huge needs the KVarN long-context KV cache",
            ("batch", "KV", "kvarn"): "KV=kvarn needs the KVarN long-context KV cache",
            ("single", "MODEL", "/no/such/dir"): "MODEL=/no/such/dir does not exist",
            ("batch", "EXTRA_ARGS", "--tensor-parallel-size 2 --seed 1"): "drop it and set TP=2"}
TP_LINE = re.compile(r"^TP += 1 +default\n", re.M)
VISION_LINE = re.compile(r"^vision tower += .*\n", re.M)
OLD_EXTRA_ARGS_DOC = "appended to the vllm argv as is (e.g. `--tensor-parallel-size 2`)"


def false_ok(mode: str, env: dict[str, str]) -> str | None:
    """The refusal a configuration the old plan accepted now gets, or None."""
    return next((why for (m, knob, value), why in FALSE_OK.items() if m == mode and env.get(knob) == value), None)


def split_draft_lines(text: str) -> tuple[str, list[str]]:
    """text without the lines about the draft vocabulary, and those lines."""
    lines = text.splitlines(keepends=True)
    return "".join(line for line in lines if not DRAFT_LINES.search(line)), \
        [line.rstrip("\n") for line in lines if DRAFT_LINES.search(line)]


def without_stubs(text: str) -> tuple[str, int]:
    """text without the lines that name a removed stub; and how many went."""
    lines = text.splitlines(keepends=True)
    kept = [line for line in lines if not STUBS.search(line)]
    return "".join(kept), len(lines) - len(kept)


def printed_a_stub(mode: str, env: dict[str, str], action: str, rc: int) -> bool:
    """Where the pre-refactor plan printed a stub's name (see the module docstring)."""
    if rc != 0:
        return any(STUBS.fullmatch(name) for name in env)
    if action == "explain":
        return True
    dflash2 = mode == "single" and env.get("SPEC") == "dflash2"
    return dflash2 or (env.get("VISION") == "1" and env.get("VISION_OFFLOAD") != "0")


def test_the_fixture_is_the_helpers_configurations():
    assert [(b["mode"], b["env"]) for b in BEFORE] == [(m, e) for m, e in CONFIGS]
    assert "kvarn/install.sh" not in json.dumps(BEFORE)  # why no filter is needed for the KVarN wording


@pytest.mark.parametrize(("mode", "env", "before"), [(m, e, b) for (m, e), b in zip(CONFIGS, BEFORE, strict=True)],
                         ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in e.items()) or 'default'}" for m, e in CONFIGS])
def test_rendering_is_unchanged(mode, env, before):
    after = render(mode, env)
    stubs_set = {k: v for k, v in env.items() if STUBS.fullmatch(k) and k not in LOOKUP_KNOBS}
    if stubs_set:  # a removed knob is now an unknown variable: ignored
        assert {a: after[a] for a in ACTIONS} == {a: render(mode, {k: v for k, v in env.items() if k not in stubs_set})[a]
                                                 for a in ACTIONS}
    refusal = false_ok(mode, env)
    for action in ACTIONS:
        old, new = before[action], after[action]
        dropped = 0
        draft_old: list[str] = []
        draft_new: list[str] = []
        lookup_new: list[str] = []
        for stream in ("stdout", "stderr"):
            old_text, n = without_stubs(old[stream])
            dropped += n
            new_lines = new[stream].splitlines(keepends=True)
            lookup_new += [line.rstrip("\n") for line in new_lines if LOOKUP_LINE.search(line)]
            new_text = "".join(line for line in new_lines if not LOOKUP_LINE.search(line))
            assert not STUBS.search(new_text), f"{action} {stream} still names a removed stub"
            old_text = old_text.replace(OLD_EXTRA_ARGS_DOC, knobs.BY_NAME["EXTRA_ARGS"].doc)
            if action == "explain" and stream == "stdout" and new["rc"] == 0:
                new_text, cut = new_text.split(NOT_CHECKED)
                assert cut.count("not checked yet") == len(cut.splitlines()) >= 1
                new_text, tp_lines = TP_LINE.subn("", new_text)
                assert tp_lines == 1, "explain lists TP once"
                new_text, vision_lines = VISION_LINE.subn("", new_text)
                assert vision_lines == (env.get("VISION") == "1"), "explain shows the tower with VISION=1 only"
            old_text, old_lines = split_draft_lines(old_text)
            new_text, new_lines = split_draft_lines(new_text)
            draft_old += old_lines
            draft_new += new_lines
            if old["rc"] == new["rc"]:
                assert new_text == old_text, (action, stream)
        assert (dropped > 0) == printed_a_stub(mode, env, action, old["rc"]), (action, "stub filter misfired")
        if old["rc"] == new["rc"] == 0:
            assert_draft_lines_changed_as_intended(mode, env, action, draft_old, draft_new)
        assert_lookup_lines_as_intended(mode, env, action, new["rc"], lookup_new)
        if refusal:  # a false OK is now refused, with the reason
            assert old["rc"] == 0 and new["rc"] == 2 and refusal in new["stderr"] and not new["stdout"], action
        elif old["rc"] != new["rc"]:  # only the refusal of a stub's own value may go
            assert old["rc"] == 2 and new["rc"] == 0 and stubs_set and not without_stubs(old["stderr"])[0], action


def assert_lookup_lines_as_intended(mode: str, env: dict[str, str], action: str, rc: int, lines: list[str]) -> None:
    long_block = int(env.get("DFLASH_TOKENS", "7")) > 7  # LOOKUP's default is a bound there, with a note
    if rc != 0:
        nmin_refused = "is above VLLM_DFLASH2_LOOKUP_NMAX" in "".join(lines)
        assert nmin_refused == ("VLLM_DFLASH2_LOOKUP_NMIN" in env) and len(lines) == nmin_refused, lines
    elif mode == "batch":
        assert lines == [], action
    elif action == "explain":
        noted = ["note:"] if mode == "single" and env.get("SPEC") == "dflash2" and long_block else []
        assert [line.split()[0] for line in lines] == [*LOOKUP_KNOBS, *noted], lines
    elif env.get("SPEC") != "dflash2":
        assert lines == [], lines
    elif env.get("LOOKUP") == "0":
        assert lines == ["export VLLM_DFLASH2_LOOKUP=0"], lines
    else:
        defaults = [f"export {var}={default}" for var, _, default, _ in knobs.LOOKUP_PARAMS]
        note = ["note: LOOKUP=1 because SPEC=dflash2, DFLASH_TOKENS>7: only the lookup fills the block past the "
                "drafter's 7"] if long_block else []
        assert lines == ["export VLLM_DFLASH2_LOOKUP=1", *defaults, f"export {knobs.LOOKUP_STICKY}=3", *note], lines


def assert_draft_lines_changed_as_intended(mode: str, env: dict[str, str], action: str, old: list[str],
                                           new: list[str]) -> None:
    if mode == "batch":
        assert old == new == [], action
        return
    step = "prepare/build_draft_vocab.py models/Qwen3.8-27B-W4A16-AutoRound --ids prepare/draft_vocab_ids.json"
    assert sum(step in line for line in old) == 1 and not any("build_draft_vocab" in line for line in new), action
    mtp = env.get("SPEC", "mtp") == "mtp"
    fallback = mtp and env.get("MTP_DRAFT_VOCAB") != "0"
    if action == "--dry-run":
        exported = "export VLLM_MTP_DRAFT_VOCAB=" + ("0" if mtp else "")
        assert [line for line in new if line.startswith("export")] == ([exported] if mtp else []), new
        assert [line for line in old if line.startswith("export")] == \
            ([f"export VLLM_MTP_DRAFT_VOCAB={env.get('MTP_DRAFT_VOCAB', '1')}"] if mtp else []), old
        notes = [line for line in new if line.startswith("note: MTP_DRAFT_VOCAB=0 because")]
        assert len(notes) == fallback and all("single-user/calibrate.sh" in n for n in notes), new
    else:
        assert any(line.startswith("DRAFT_IDS ") for line in new)
        assert any(line.startswith("MTP draft head ") for line in new) == fallback, new

