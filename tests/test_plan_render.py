"""What the plan prints and runs for every configuration of tests/helpers/plan_render.py (the README's examples, one
per knob rule and per refusal), against the snapshot tests/fixtures/plan-render.json.

Any change to a dry run or an explain (a note, an export, an argv, an exit code) fails here. When the change is
meant, render the snapshot again and read its diff before committing it:

    python -m tests.helpers.plan_render > tests/fixtures/plan-render.json

The snapshot was first taken on main before the Structure refactor, and the changes of issues #15, #18, #23 and #24
were each asserted against it as filters; it was taken again on 2026-12-02, when those filters had all held and the
DRAFT_TOKENS / DFLASH_MAX_LEN defaults stopped printing notes outside SPEC=mtp / SPEC=dflash2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.plan_render import CONFIGS, render

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "plan-render.json"
SNAPSHOT = json.loads(FIXTURE.read_text())
ACTIONS = ("--dry-run", "explain")
REGENERATE = "python -m tests.helpers.plan_render > tests/fixtures/plan-render.json"


def test_the_snapshot_is_the_helpers_configurations():
    assert [(s["mode"], s["env"]) for s in SNAPSHOT] == [(m, e) for m, e in CONFIGS], f"stale snapshot: {REGENERATE}"


@pytest.mark.parametrize(("mode", "env", "snapshot"), [(m, e, s) for (m, e), s in zip(CONFIGS, SNAPSHOT, strict=True)],
                         ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in e.items()) or 'default'}" for m, e in CONFIGS])
def test_rendering_matches_the_snapshot(mode, env, snapshot):
    after = render(mode, env)
    for action in ACTIONS:
        for stream in ("rc", "stdout", "stderr"):
            assert after[action][stream] == snapshot[action][stream], (
                f"{mode} {action} {stream} changed; if that is meant: {REGENERATE}, and read the diff")
