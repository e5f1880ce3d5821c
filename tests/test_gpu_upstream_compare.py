"""tests/gpu/upstream_compare.py: vLLM's own tests run on the stock and the patched tree, compared outcome by
outcome from pytest's junit XML (the device runs them: tests/gpu/vllm_sampler_tests.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import upstream_compare  # noqa: E402


def _junit(path: Path, cases: dict[str, str]) -> Path:
    body = {"passed": "", "failed": '<failure message="assert">trace</failure>', "error": "<error message='x'/>",
            "skipped": '<skipped message="needs CUDA"/>'}
    rows = "".join(f'<testcase classname="tests.v1.sample.test_sampler" name="{name}" time="0.1">{body[state]}'
                   "</testcase>" for name, state in cases.items())
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return path


def test_a_test_only_the_patched_tree_fails_is_a_regression(tmp_path):
    stock = _junit(tmp_path / "s.xml", {"a": "passed", "b": "passed", "c": "failed", "d": "skipped", "e": "failed"})
    patched = _junit(tmp_path / "p.xml", {"a": "passed", "b": "failed", "c": "failed", "d": "skipped",
                                          "e": "passed", "f": "error"})
    result = upstream_compare.compare(upstream_compare.outcomes(stock), upstream_compare.outcomes(patched))
    key = "tests.v1.sample.test_sampler::"
    assert result["regressions"] == [key + "b"] and not result["passed"]
    assert result["failed_on_both"] == [key + "c"] and result["fixed"] == [key + "e"]
    assert result["only_patched"] == [key + "f"] and result["only_stock"] == []
    assert result["patched"] == {"passed": 2, "failed": 3, "skipped": 1}
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(REPO / "tests" / "gpu" / "upstream_compare.py"), str(stock),
                           str(patched), "--out", str(out)], capture_output=True, text=True, timeout=60)
    report = json.loads(out.read_text())
    assert done.returncode == 1 and report["regressions"] == [key + "b"]
    assert report["date"] and "gpu" in report["machine"] and "sampler-small-topk.patch" in report["patches"]


def test_failures_both_trees_share_do_not_fail_the_run_but_nothing_run_does(tmp_path):
    stock = upstream_compare.outcomes(_junit(tmp_path / "s.xml", {"a": "failed", "b": "passed"}))
    assert upstream_compare.compare(stock, dict(stock))["passed"]
    skipped = upstream_compare.outcomes(_junit(tmp_path / "k.xml", {"a": "skipped", "b": "skipped"}))
    assert not upstream_compare.compare(skipped, skipped)["passed"]  # a run where nothing ran proves nothing
