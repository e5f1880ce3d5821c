"""Checks before anything heavy (the ~5.5 GB install, the 19.5 GB download): an NVIDIA GPU and driver,
its VRAM, free disk where the model goes, Python. Each check is one `PASS|WARN|FAIL name: message`
line, and a FAIL says what to do.

    python -m qwen_serving.preflight [--model-dir DIR] [--need-disk] [--tp N]

Standard library only; never imports torch or vllm. qwen_serving/start_server.sh runs it before the first-start
steps when it is to serve; --dry-run, explain and --prepare do not, so they work on machines without a GPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from .knobs import BASE_MODEL

MIN_DRIVER = 580  # the CUDA 13 wheels (torch 2.13.0, vllm 0.28.0)
MIN_VRAM_BYTES = 24 * 10**9  # 24 GB; a 3090 reports 24,576 MiB
MIN_DISK_BYTES = 40 * 10**9  # the W4A16 checkpoint (~19.5 GB) and its requantized copy
MIN_PYTHON = (3, 11)
GPU_QUERY = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]


@dataclass(frozen=True)
class Check:
    level: str  # PASS, WARN or FAIL
    name: str
    message: str

    def line(self) -> str:
        return f"{self.level} {self.name}: {self.message}"


def query_gpus() -> str:
    """nvidia-smi's CSV, one GPU a line (name, MiB, driver); raises OSError or CalledProcessError."""
    return subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=30, check=True).stdout


def gpu_checks(query: Callable[[], str] = query_gpus, tp: int = 1) -> list[Check]:
    """The driver, and the VRAM of the card (TP=1) or of the TP cards the model is split across."""
    try:
        out = query()
    except FileNotFoundError:
        return [Check("FAIL", "gpu", "no NVIDIA GPU found (no nvidia-smi on PATH): serving needs a 24 GB NVIDIA GPU "
                                     f"and driver >= {MIN_DRIVER}; --dry-run and explain work without one")]
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
        return [Check("FAIL", "gpu", f"nvidia-smi failed ({detail[-1] if detail else e}): install or repair the "
                                     f"NVIDIA driver (>= {MIN_DRIVER}), then check that nvidia-smi lists the GPU")]
    gpus = []
    for row in filter(None, (line.strip() for line in out.splitlines())):
        name, mib, driver = (part.strip() for part in row.rsplit(",", 2))
        try:
            gpus.append((name, int(float(mib)) * 2**20, driver, int(driver.split(".")[0])))
        except ValueError:
            return [Check("FAIL", "gpu", f"cannot read nvidia-smi's line {row!r}")]
    if not gpus:
        return [Check("FAIL", "gpu", f"nvidia-smi lists no GPU: serving needs a 24 GB NVIDIA GPU, driver >= {MIN_DRIVER}")]
    if len(gpus) < tp:
        return [Check("FAIL", "gpu", f"TP={tp} splits the model across {tp} cards and nvidia-smi lists {len(gpus)}: "
                                     f"set TP={len(gpus)} or fewer, or add cards")]
    name, total, driver, major = max(gpus, key=lambda g: g[1]) if tp == 1 else min(gpus, key=lambda g: g[1])
    checks = []
    if major < MIN_DRIVER:
        checks.append(Check("FAIL", "driver", f"{driver} is older than {MIN_DRIVER}, which the CUDA 13 wheels need: "
                                              f"install NVIDIA driver {MIN_DRIVER} or newer"))
    else:
        checks.append(Check("PASS", "driver", f"{driver}"))
    if tp > 1:  # each card holds 1/TP of the weights: together they need what one card needs
        if total * tp >= MIN_VRAM_BYTES:
            checks.append(Check("PASS", "gpu", f"TP={tp}: {len(gpus)} cards, the smallest {name} with "
                                               f"{total / 2**30:.1f} GiB"))
        else:
            checks.append(Check("WARN", "gpu", f"TP={tp}: the smallest card, {name}, has {total / 2**30:.1f} GiB; "
                                               f"{tp} of it is below the 24 GB this is sized for: see what the plan "
                                               "can seat with KV_MEM=auto and explain"))
        return checks
    more = f" (largest of {len(gpus)})" if len(gpus) > 1 else ""
    if total >= MIN_VRAM_BYTES:
        checks.append(Check("PASS", "gpu", f"{name}, {total / 2**30:.1f} GiB{more}"))
    else:
        split = f" (TP={len(gpus)})" if len(gpus) > 1 else " (TP=2 on two cards)"
        checks.append(Check("WARN", "gpu", f"{name} has {total / 2**30:.1f} GiB{more}, below the 24 GB this is sized "
                                           "for: the defaults will not fit; see what the plan can seat with "
                                           f"KV_MEM=auto and explain, or split the model across cards{split}"))
    return checks


def tp_from_env(env: Mapping[str, str]) -> int:
    """The TP knob as start_server.sh exports it (the plan, which ran first, has refused a bad one); 1 if unset."""
    try:
        return max(1, int(env.get("TP") or 1))
    except ValueError:
        return 1


def free_bytes(where: Path) -> int:
    """Free bytes on where's filesystem: GNU df's answer (a stand-in df on PATH fakes it, as nvidia-smi is faked),
    else the kernel's (busybox df has no --output)."""
    try:
        out = subprocess.run(["df", "-B1", "--output=avail", str(where)], capture_output=True, text=True,
                             timeout=30, check=True).stdout
        return int(out.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return shutil.disk_usage(where).free


def bytes_on_disk(folder: Path) -> int:
    """What the files under folder already occupy (an interrupted download resumes: those bytes are not needed twice)."""
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_blocks * 512 for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def disk_check(model_dir: Path, need: int = MIN_DISK_BYTES) -> Check:
    """Free space on the filesystem that will hold model_dir (its nearest existing parent), less what a download
    already put in model_dir."""
    where = model_dir.resolve()
    while not where.exists() and where != where.parent:
        where = where.parent
    free, have = free_bytes(where), min(bytes_on_disk(model_dir), need)
    still = need - have
    done = f" ({have / 1e9:.1f} GB of it already there)" if have else ""
    if free >= still:
        return Check("PASS", "disk", f"{free / 1e9:.0f} GB free at {where}{done}")
    return Check("FAIL", "disk", f"{free / 1e9:.1f} GB free at {where}; the checkpoint and its requantized copy "
                                 f"need ~{still / 1e9:.0f} GB more{done}: free some space, or make models/ a link "
                                 "to a folder on a larger disk")


def python_check(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> Check:
    shown = ".".join(map(str, version))
    if tuple(version[:2]) >= MIN_PYTHON:
        return Check("PASS", "python", shown)
    return Check("FAIL", "python", f"{shown} runs this; the install needs Python >= 3.11 (3.12 preferred): "
                                   "apt-get install python3.12 python3.12-venv, or set PYTHON=/path/to/python3.12")


def run(model_dir: Path | None = None, query: Callable[[], str] = query_gpus, tp: int = 1) -> list[Check]:
    """Every check; the disk only when model_dir (where a download would go) is given."""
    checks = [python_check(), *gpu_checks(query, tp)]
    if model_dir is not None:
        checks.append(disk_check(model_dir))
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qwen_serving.preflight", description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=Path(__file__).resolve().parents[1] / BASE_MODEL,
                    help="where the checkpoint is downloaded to (for the disk check)")
    ap.add_argument("--need-disk", action="store_true", help="check free disk (the model is still to download)")
    ap.add_argument("--tp", type=int, default=None, help="cards the model is split across (default: the TP knob)")
    args = ap.parse_args(argv)
    tp = args.tp if args.tp is not None else tp_from_env(os.environ)
    checks = run(args.model_dir if args.need_disk else None, tp=tp)
    for check in checks:
        print(check.line())
    return 1 if any(c.level == "FAIL" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
