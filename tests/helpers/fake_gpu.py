"""A stand-in `nvidia-smi` for tests of the launchers on machines without a GPU (qwen_serving/preflight.py reads it)."""

from __future__ import annotations

from pathlib import Path

RTX_3090 = "NVIDIA GeForce RTX 3090, 24576, 580.95.05"  # name, MiB, driver: what preflight's query prints


def fake_nvidia_smi(folder: Path, answer: str = RTX_3090) -> Path:
    """folder/nvidia-smi answering `answer`; put folder first on PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f'#!/usr/bin/env bash\necho "{answer}"\n')
    script.chmod(0o755)
    return folder
