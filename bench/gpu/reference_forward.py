"""What the quality battery's scripted check costs beside a server: its float32 reference forward at full size.

    python bench/gpu/reference_forward.py --ckpt /tmp/qwen-scripted-full --out OUT.json [--device cuda]

The check (bench/gpu/quality_scripted.py, the product visit's `quality` part) scores walks through the server and
then runs bench.quality_battery.forward_logprobs over the same walks on the GPU the server shares. Its time and
memory at full size were estimated, never measured; this runs that forward alone, with no vLLM, on the same
walks (the battery's defaults: 4,096 tokens, 1,024-id walks, the last of 5 ids), and records:
- the seconds of each phase (the reference's set-up, the context-free table, the walks, the forward) and the
  GPU memory peak (torch.cuda.max_memory_allocated), to set the visit's estimate and to know it fits beside a
  server;
- the forward against the table (`compare`: the perplexity difference the residual branches make at full size,
  which the check's recorded `design_check` sets the engine against).
The checkpoint is generated first when --ckpt has none (the scripted full design the product visit uses).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import scripted_mtp as sm  # noqa: E402
import smoke_lib  # noqa: E402

from bench import quality_battery as qb  # noqa: E402
from bench import serving  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", type=Path, required=True, help="the scripted checkpoint (generated when missing)")
    p.add_argument("--out", type=Path, required=True, help="the results JSON")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--walk", type=int, default=1024)
    args = p.parse_args(argv)
    import torch

    from qwen_serving.checkpoint.scripted import Design
    from qwen_serving.checkpoint.scripted_reference import Reference

    phases: dict[str, float] = {}
    t0 = time.monotonic()
    if not (args.ckpt / "config.json").exists():  # as the product visit makes it (its log: OUT's folder/synth.log)
        args.agree, args.coverage, args.python = sm.DEFAULT_AGREE, sm.DEFAULT_COVERAGE, sys.executable
        args.out.parent.mkdir(parents=True, exist_ok=True)
        sm.make_checkpoint(args, dict(os.environ), args.out.parent, lambda limit_s: limit_s)
        phases["synth"] = round(time.monotonic() - t0, 1)

    def timed(name, fn):
        start = time.monotonic()
        value = fn()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        phases[name] = round(time.monotonic() - start, 2)
        return value

    ref = timed("reference", lambda: Reference(args.ckpt, args.device))
    table = timed("table", lambda: qb.ContextFreeTable(ref, Design.read(args.ckpt).active))
    walks = timed("walks", lambda: qb.scripted_walks(table, args.tokens, args.walk))
    forward, forward_top = timed("forward", lambda: qb.forward_logprobs(ref, walks))
    measured = [lp for w in forward for lp in w]
    closed_by_walk = [table.closed_form(w) for w in walks]
    closed = [lp for w in closed_by_walk for lp in w]
    top_table = [table.argmax(t) for w in walks for t in w[:-1]]
    data = {"schema": "qwen-serving reference-forward/1", "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "gpu": smoke_lib.gpu_description(), "versions": smoke_lib.package_versions(("torch", "triton")),
            "checkpoint": str(args.ckpt), "device": args.device, "tokens": args.tokens,
            "walks": [len(w) for w in walks], "phases_s": phases,
            "peak_gib": qb.forward_peak_gib(args.device),
            "forward_vs_table": qb.compare(measured, closed, [t for w in forward_top for t in w], top_table),
            "per_walk_vs_table": [qb.perplexity(f)["ppl"] / qb.perplexity(c)["ppl"] - 1
                                  for f, c in zip(forward, closed_by_walk, strict=True)]}
    serving.write_json_atomic(args.out, data)
    print(f"reference forward: {phases} peak {data['peak_gib']} GiB; forward vs table "
          f"{data['forward_vs_table']['relative_difference']:+.4%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
