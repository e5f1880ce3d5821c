"""Build the single-user "fast" variant: the published int4 GPTQ lm_head + MTP over the base model.

    python prepare/fetch_fast_variant.py [--base models/Qwen3.8-27B-W4A16-AutoRound]
        [--out models/Qwen3.8-27B-W4A16-AutoRound-fast] [--repo syvai/qwen3.8-27b-3090-fast-variant]

Downloads the variant's tensors (~1 GB, into models/.downloads/), then writes a new model
directory: the base's unchanged shards hard-linked, the variant's modules replacing the base's,
the quantization_config extended to match; verified, then renamed into place in one step.
single-user/start_qwen.sh picks the -fast directory up when it exists.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.checkpoint import hub  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=hub.FAST_REPO)
    parser.add_argument("--base", default=str(hub.default_dir(hub.BASE_REPO)))
    parser.add_argument("--out", help="new model directory (default: <base>-fast)")
    parser.add_argument("--downloads", default=str(hub.DOWNLOADS), help="where the variant's own files are kept")
    parser.add_argument("--revision")
    parser.add_argument("--token", help="Hugging Face token (default: HF_TOKEN)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.base.rstrip("/") + "-fast")
    return hub.fetch_fast_variant(Path(args.base), out, args.repo, revision=args.revision, token=args.token,
                                  downloads=Path(args.downloads))


if __name__ == "__main__":
    sys.exit(main())
