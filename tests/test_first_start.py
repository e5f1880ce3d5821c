"""Every first-start step `plan <mode> --missing` lists runs and exits 0 (issue 15's "Must show"), on a checkout
whose checkpoint is the tiny synthetic one: the install and the downloads are faked, every other step is the
real command, run the way qwen_serving/start_server.sh runs it (`bash -c STEP` in the checkout). Afterwards
the plan lists nothing more."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_serving import knobs, plan
from tests.helpers.tiny_checkpoint import make_tiny

REPO = Path(__file__).resolve().parents[1]


def fakes(checkout: Path, tiny: Path) -> dict[str, object]:
    """The steps that would install or download, by command: what they would leave behind."""
    def install():
        (checkout / "venv" / "bin" / "vllm").write_text("#!/bin/sh\n")

    return {
        "bash install.sh": install,
        f"{plan.VENV_PYTHON} prepare/download.py": lambda: shutil.copytree(tiny, checkout / knobs.BASE_MODEL),
        # the fast variant is the base with other lm_head/MTP tensors; the tiny base stands in for it
        f"{plan.VENV_PYTHON} prepare/fetch_fast_variant.py":
            lambda: shutil.copytree(checkout / knobs.BASE_MODEL, checkout / knobs.FAST_MODEL),
    }


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A checkout without venv/ or models/: prepare/ is the repo's, venv/bin/python runs this interpreter."""
    repo = tmp_path / "checkout"
    (repo / "venv" / "bin").mkdir(parents=True)
    (repo / "prepare").symlink_to(REPO / "prepare")  # the scripts import qwen_serving from the real checkout
    python = repo / plan.VENV_PYTHON
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    (repo / "ids.json").write_text(json.dumps({"ids": list(range(0, 600, 3))}))
    return repo


@pytest.mark.parametrize(("mode", "env"), [("batch", {}), ("single", {}), ("single", {"DRAFT_IDS": "ids.json"})],
                         ids=["batch", "single", "single-with-a-list"])
def test_every_listed_step_runs_and_exits_0(checkout, tmp_path_factory, monkeypatch, mode, env):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    probe = plan.Probe(repo=checkout, vllm_installed=False)
    steps = [s.command for s in plan.build(mode, env, probe).missing]
    faked = fakes(checkout, make_tiny(tmp_path_factory))
    real = [c for c in steps if c not in faked]
    assert steps[0] == "bash install.sh" and [c for c in steps if c in faked] == list(faked)[:2 + (mode == "single")]
    assert len(real) == 3 + ("DRAFT_IDS" in env)  # the three requantizations, and the draft head from the list
    env_run = {"PATH": os.environ["PATH"], "SOURCE_DATE_EPOCH": "1700000000"}
    for command in steps:
        if command in faked:
            faked[command]()
            continue
        r = subprocess.run(["bash", "-c", command], cwd=checkout, env=env_run, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, (command, r.stdout, r.stderr)
    after = plan.build(mode, env, plan.Probe.detect(checkout))
    assert after.missing == ()
    if mode == "single":
        assert after.served == knobs.FAST_MODEL
        assert after.env["VLLM_MTP_DRAFT_VOCAB"] == ("1" if "DRAFT_IDS" in env else "0")
        model = checkout / knobs.FAST_MODEL
    else:
        model = checkout / knobs.BASE_MODEL
    recorded = set(json.loads((model / "prepared.json").read_text())["steps"])
    assert {"quant_lm_head", "quant_embed", "quant_mtp"} <= recorded
    assert ("draft_vocab" in recorded) == ("DRAFT_IDS" in env)
