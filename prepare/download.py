"""Download the W4A16 checkpoint into models/ (hf-xet, resumable) and verify it is complete.

    python prepare/download.py [--repo dbirks/Qwen3.8-27B-W4A16-AutoRound] [--dir models/...]

An existing complete download is verified and not fetched again; an interrupted one is resumed.
HF_TOKEN (or --token) is used for gated or private repos. ~19.5 GB for the default repo.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_serving.checkpoint import hub  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return hub.download_main("download", __doc__, hub.BASE_REPO, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
