"""vLLM's own tests, run twice on the device (stock tree, patched tree): which outcomes the patches changed.

    python tests/gpu/upstream_compare.py STOCK.xml PATCHED.xml --out OUT.json

Each XML is pytest's --junitxml of the same test files. A test the patched tree fails where stock passes is a
regression (the run fails); one both fail is vLLM's or the machine's, recorded, not held against the patches; a test
that ran on one tree only is listed, since the two runs should collect the same tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench import harness  # noqa: E402
from qwen_serving import patchset  # noqa: E402


def outcomes(junit_xml: Path) -> dict[str, str]:
    """test id (classname::name) -> passed / failed / skipped (an error counts as failed)."""
    out = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag for child in case}
        out[test_id] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    return out


def compare(stock: dict[str, str], patched: dict[str, str]) -> dict:
    both = sorted(stock.keys() & patched.keys())
    regressions = [t for t in both if patched[t] == "failed" and stock[t] != "failed"]
    return {
        "stock": dict(Counter(stock.values())), "patched": dict(Counter(patched.values())),
        "regressions": regressions,
        "fixed": [t for t in both if stock[t] == "failed" and patched[t] == "passed"],
        "failed_on_both": [t for t in both if stock[t] == patched[t] == "failed"],
        "only_stock": sorted(stock.keys() - patched.keys()), "only_patched": sorted(patched.keys() - stock.keys()),
        "passed": not regressions and any(v == "passed" for v in patched.values()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stock", type=Path)
    parser.add_argument("patched", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result = compare(outcomes(args.stock), outcomes(args.patched))
    series = [patch.name for patch in patchset.read_series(patchset.DEFAULT_SERIES)]
    result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": harness.machine_facts(),
              "tests": "vLLM 0.28.0's own tests/v1/sample (test_sampler, test_topk_topp_sampler, test_rejection_sampler)"
                       " from the release's source archive (tests/gpu/stage-vllm-tests.sh)",
              "patches": series, **result}
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.out)
    print(json.dumps({k: result[k] for k in ("stock", "patched", "passed")}), f"regressions: {len(result['regressions'])}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
