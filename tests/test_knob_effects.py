"""A knob that does nothing is not offered: every variable the plan can export is read by a patch, by
our engine hooks or by vLLM 0.28.0 itself, and every knob changes the argv or the exports for some value
(or is refused with a reason). The values tried come from the knobs' own data (each parser's samples),
never from a hand list, and a synthetic violation of each rule is caught."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from qwen_serving import knobs, plan
from qwen_serving.engine import env_vars

REPO = Path(__file__).resolve().parents[1]
BIT = knobs.BY_NAME["VISION"].parse  # a 0/1 parser, for the synthetic knobs
Rendering = tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | str  # (argv, exports), or a refusal


@pytest.fixture(scope="module")
def readers(pristine_vllm) -> dict[str, str]:
    """Where an exported variable may be read: the lines our patches add, the engine hooks, vLLM's envs.py."""
    added = [line[1:] for patch in sorted((REPO / "patches").glob("*.patch"))
             for line in patch.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    engine = [path.read_text() for path in sorted((REPO / "qwen_serving" / "engine").rglob("*.py"))]
    return {"patches": "\n".join(added), "qwen_serving/engine": "\n".join(engine),
            "vllm envs.py": (pristine_vllm / "envs.py").read_text()}


def unread(names: Iterable[str], readers: Mapping[str, str]) -> list[str]:
    return sorted(n for n in names if not any(re.search(rf"\b{re.escape(n)}\b", text) for text in readers.values()))


def bases(mode: str) -> list[dict[str, str]]:
    """Starting points: the defaults, then each choice knob at each of its other values."""
    out: list[dict[str, str]] = [{}]
    for k in knobs.knobs_for(mode):
        out += [{k.name: s} for s in k.choices]
    return out


def first_effect(render: Callable[[dict[str, str]], Rendering], knob: knobs.Knob,
                 starts: list[dict[str, str]]) -> tuple[dict[str, str], str, Rendering] | None:
    """The first (start, value) at which setting `knob` changes the rendering or is refused."""
    for start in starts:
        if knob.name in start:
            continue
        before = render(start)
        if isinstance(before, str):
            continue  # the start itself is refused
        for value in knob.samples:
            after = render({**start, knob.name: value})
            if after != before:
                return start, value, after
    return None


@pytest.fixture(scope="module")
def render_with(tmp_path_factory) -> Callable[[str, dict[str, str], bool], Rendering]:
    probe = plan.Probe(repo=tmp_path_factory.mktemp("repo"))

    def render(mode: str, env: dict[str, str], wsl2: bool = False) -> Rendering:
        try:
            p = plan.build(mode, env, replace(probe, wsl2=wsl2))
        except plan.PlanError as e:
            assert str(e), "a refusal without a reason"
            return str(e)
        return p.argv, tuple(p.env.items())

    return render


@pytest.mark.parametrize("mode", knobs.MODES)
def test_every_knob_changes_the_argv_or_the_exports(mode, render_with):
    dead = [k.name for k in knobs.knobs_for(mode)
            if first_effect(lambda env: render_with(mode, env), k, bases(mode)) is None]
    assert not dead, f"{mode}: these knobs change nothing for any value tried: {dead}"


def test_every_exported_variable_is_read(render_with, readers):
    declared = knobs.exported_vars() | {plan.WSL2_PIN_MEMORY}
    for k in knobs.KNOBS:  # what lets the bases below reach every export
        assert not k.export or all(knobs.BY_NAME[name].choices for name in k.export.when), k.name
    seen: set[str] = set()
    for mode in knobs.MODES:  # every export is conditioned on choice knobs, so the bases reach each one
        for start in bases(mode):
            for wsl2 in (False, True):
                out = render_with(mode, start, wsl2)
                if not isinstance(out, str):
                    seen |= {name for name, _ in out[1]}
    assert seen <= declared, f"exported but not declared on a knob: {sorted(seen - declared)}"
    assert seen == declared, f"declared but never exported: {sorted(declared - seen)}"
    assert not unread(declared, readers), "exported, and read by no patch, hook or vLLM"
    assert not unread(env_vars.BY_NAME, readers), "engine/env_vars.py declares a variable nothing reads"


def test_a_synthetic_unread_export_is_caught(readers):
    fake = knobs.Knob("FAKE", BIT, (knobs.Rule(0),), "a knob for a feature nobody built",
                      export=knobs.Export("VLLM_NOBODY_READS_THIS", {"FAKE": 1}))
    assert unread([fake.export.var, "VLLM_MARLIN_INPUT_DTYPE"], readers) == ["VLLM_NOBODY_READS_THIS"]


def test_a_synthetic_knob_that_does_nothing_is_caught(render_with):
    fake = knobs.Knob("FAKE", BIT, (knobs.Rule(0),), "set, and ignored")
    assert first_effect(lambda env: render_with("batch", env), fake, bases("batch")) is None
    real = knobs.BY_NAME["REQ_METRICS"]
    start, value, after = first_effect(lambda env: render_with("batch", env), real, bases("batch"))
    assert value == "1" and "--enable-per-request-metrics" in after[0]
