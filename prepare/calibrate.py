"""Calibrate the MTP draft head on the served model's own outputs: count, choose, build, say restart.

    bash single-user/calibrate.sh                 # against the server single-user/start_qwen.sh started
    bash single-user/calibrate.sh --tokens 300000 # less (or more) than the default ~15 min of a 3090
    bash single-user/calibrate.sh --proxy 18021   # count your own traffic first (Ctrl-C when done), then build

The address, the API key and the checkpoint come from the same knobs and plan as the server's
(`python -m qwen_serving.plan single`). The counts go to models/calibration-counts.json (your traffic's to
models/calibration-counts-traffic.json), written every
--save-every requests: an interrupted run continues where it stopped when re-run. Then the K most
frequent ids (plus the end-of-turn ids) become the draft head in the served checkpoint
(prepare/build_draft_vocab.py, with the held-out coverage), the list is kept in prepare/draft_vocab_ids.json
(the first start builds from it again if the checkpoint is rebuilt), and a restart serves the head.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "prepare"))

import count_outputs  # noqa: E402

from bench import serving  # noqa: E402
from qwen_serving import knobs, plan  # noqa: E402
from qwen_serving.checkpoint import draft_vocab  # noqa: E402

COUNTS = "models/calibration-counts.json"


def main(argv: list[str] | None = None, env: dict[str, str] | None = None, repo: Path = REPO) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=count_outputs.DEFAULT_TOKENS,
                        help=f"tokens to count (default {count_outputs.DEFAULT_TOKENS:,}: ~15 min of a 3090 at 64 "
                             "concurrent, longer on a single-user server's 8 seats)")
    parser.add_argument("--proxy", type=int, metavar="PORT", help="first count your own traffic through this port")
    parser.add_argument("--prompts", type=Path, default=count_outputs.PROMPT_SET)
    parser.add_argument("--k", type=int, default=draft_vocab.DEFAULT_K, help="draft vocabulary size")
    parser.add_argument("--counts", type=Path, help=f"counts file (default {COUNTS})")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--save-every", type=int, default=32)
    args = parser.parse_args(argv)
    env = dict(os.environ if env is None else env)
    try:
        p = plan.build("single", env, plan.Probe.detect(repo))
    except plan.PlanError as e:
        print(f"calibrate: the serve plan refuses this configuration: {e}", file=sys.stderr)
        return 2
    if p.value("SPEC") != "mtp":
        print(f"calibrate: the draft head is for SPEC=mtp; this configuration has SPEC={p.value('SPEC')}",
              file=sys.stderr)
        return 2
    model_dir = repo / p.served
    counts = args.counts or repo / COUNTS
    key = env.get(knobs.SECRET_ENV) or p.secret_env.get(knobs.SECRET_ENV)  # the key the server was started with
    common = ["--url", serving.local_url(p.value("HOST"), p.value("PORT")) + "/v1", "--holdout-every", "10", "--save-every", str(args.save_every),
              *(["--api-key", key] if key else [])]
    traffic = counts.with_name(counts.stem + "-traffic.json")  # the user's own, counted apart from the prompt set
    if args.proxy:
        rc = count_outputs.main([*common, "--out", str(traffic), "--proxy", str(args.proxy)])
        if rc:
            return rc
    rc = count_outputs.main([*common, "--out", str(counts), "--prompts", str(args.prompts), "--tokens",
                             str(args.tokens), "--concurrency", str(args.concurrency), "--max-tokens",
                             str(args.max_tokens)])
    if rc:
        return rc
    sources = [str(path) for path in (counts, traffic) if path.exists()]
    ids_file = repo / knobs.DRAFT_IDS
    build = [sys.executable, str(REPO / "prepare" / "build_draft_vocab.py"), str(model_dir), "--counts", *sources,
             "--holdout", *sources, "--k", str(args.k), "--write-ids", str(ids_file)]
    print(f"calibrate: building the draft head in {p.served}", flush=True)
    if subprocess.run(build, cwd=repo).returncode:
        return 2
    after = plan.build("single", env, plan.Probe.detect(repo))
    if after.env.get("VLLM_MTP_DRAFT_VOCAB") != "1":
        print(f"calibrate: error: the plan does not see the head in {p.served}", file=sys.stderr)
        return 2
    print(f"calibrate: done; the list is in {knobs.DRAFT_IDS}. Restart the server to draft over it "
          "(stop it, then bash single-user/start_qwen.sh)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
