"""Download the W4A16 checkpoint into models/ (hf-xet, resumable) and verify it is complete.

    python prepare/download.py [--repo dbirks/Qwen3.8-27B-W4A16-AutoRound] [--dir models/...]

An existing complete download is verified and not fetched again; an interrupted one is resumed.
HF_TOKEN (or --token) is used for gated or private repos. ~19.5 GB for the default repo.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.quant import hub  # noqa: E402
from qwen_serving.quant.checkpoint import CheckpointError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=hub.BASE_REPO)
    parser.add_argument("--dir", help="target directory (default: models/<repo name>)")
    parser.add_argument("--revision")
    parser.add_argument("--token", help="Hugging Face token (default: HF_TOKEN)")
    args = parser.parse_args(argv)
    target = Path(args.dir) if args.dir else hub.default_dir(args.repo)
    try:
        hub.download(args.repo, target, revision=args.revision, token=args.token)
    except (CheckpointError, OSError) as e:
        print(f"download: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
