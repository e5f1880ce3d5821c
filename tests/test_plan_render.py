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
exist), but the fixture's probe sees no vLLM, so the plan never checks the cache dtype there and no
fixture output carries that refusal (asserted below); tests/test_plan.py checks the new wording.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers.plan_render import CONFIGS, render

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "plan-render.json"
STUBS = re.compile(r"\b(LOOKUP|VLLM_DFLASH2_LOOKUP\w*|VISION_OFFLOAD|VLLM_VISION_CPU_OFFLOAD)\b")
BEFORE = json.loads(FIXTURE.read_text())
ACTIONS = ("--dry-run", "explain")


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
    stubs_set = {k: v for k, v in env.items() if STUBS.fullmatch(k)}
    if stubs_set:  # a removed knob is now an unknown variable: ignored
        assert {a: after[a] for a in ACTIONS} == {a: render(mode, {k: v for k, v in env.items() if k not in stubs_set})[a]
                                                 for a in ACTIONS}
    for action in ACTIONS:
        old, new = before[action], after[action]
        dropped = 0
        for stream in ("stdout", "stderr"):
            old_text, n = without_stubs(old[stream])
            dropped += n
            assert not STUBS.search(new[stream]), f"{action} {stream} still names a removed stub"
            if old["rc"] == new["rc"]:
                assert new[stream] == old_text, (action, stream)
        assert (dropped > 0) == printed_a_stub(mode, env, action, old["rc"]), (action, "stub filter misfired")
        if old["rc"] != new["rc"]:  # only the refusal of a stub's own value may go
            assert old["rc"] == 2 and new["rc"] == 0 and stubs_set and not without_stubs(old["stderr"])[0], action
