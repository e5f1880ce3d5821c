"""Apply, verify and revert the ordered vLLM patch series (quilt-style ``patches/series``).

Every operation works on a staging copy of just the files the series touches, so the vLLM tree is
only written once the whole series has gone through, and is left byte-identical otherwise.

    python -m qwen_serving.patchset {list,apply,verify,revert} [--vllm-dir DIR] [--series FILE] [--force]
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from qwen_serving import VLLM_PIN

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SERIES = REPO / "patches" / "series"
HEADER_FIELDS = ("Description", "Why", "Measured", "Upstream")


class PatchError(Exception):
    """A refusal with a message meant for the user; the tree has not been modified."""


class State(enum.Enum):
    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    CONFLICTING = "conflicting"


@dataclass
class Patch:
    name: str
    path: Path
    header: dict[str, str]
    files: list[str]  # package-relative paths this patch touches


@dataclass
class SeriesState:
    states: dict[str, State]
    failures: dict[str, str] = field(default_factory=dict)  # patch name -> what `patch` said


def parse_header(text: str) -> dict[str, str]:
    """DEP-3 style fields before the diff; continuation lines start with whitespace."""
    fields: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith(("--- ", "diff ", "Index: ")):
            break
        match = re.match(r"^([A-Za-z][A-Za-z-]*):\s?(.*)$", line)
        if match:
            key = match.group(1)
            fields[key] = match.group(2).strip()
        elif key and line[:1] in (" ", "\t") and line.strip():
            fields[key] = (fields[key] + " " + line.strip()).strip()
        elif not line.strip():
            key = None
    return fields


def touched_files(text: str) -> list[str]:
    files: list[str] = []
    for line in text.splitlines():
        if line.startswith(("--- ", "+++ ")):
            target = line[4:].split("\t")[0].strip()
            if target == "/dev/null":
                continue
            rel = target.split("/", 1)[1] if "/" in target else target  # strip a/ or b/ (-p1)
            if rel not in files:
                files.append(rel)
    return files


def read_series(series: Path) -> list[Patch]:
    if not series.is_file():
        raise PatchError(f"series file not found: {series}")
    patches = []
    for number, raw in enumerate(series.read_text().splitlines(), 1):
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        path = series.parent / name
        if not path.is_file():
            raise PatchError(f"{series}:{number}: patch file not found: {path}")
        text = path.read_text()
        header = parse_header(text)
        missing = [f for f in HEADER_FIELDS if not header.get(f)]
        if missing:
            raise PatchError(f"{path.name}: header lacks {', '.join(missing)} (every patch starts with "
                             f"{', '.join(f + ':' for f in HEADER_FIELDS)})")
        files = touched_files(text)
        if not files:
            raise PatchError(f"{path.name}: no diff found")
        patches.append(Patch(name, path, header, files))
    return patches


def default_vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("vllm is not installed in this Python; pass --vllm-dir DIR (the `vllm` package folder)")
    return Path(next(iter(spec.submodule_search_locations)))


def vllm_version(vllm_dir: Path) -> str | None:
    version_file = vllm_dir / "_version.py"
    if version_file.is_file():
        match = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", version_file.read_text())
        if match:
            return match.group(1)
    for dist in sorted(vllm_dir.parent.glob("vllm-*.dist-info")):
        return dist.name[len("vllm-"):-len(".dist-info")]
    return None


def check_version(vllm_dir: Path, force: bool) -> str:
    found = vllm_version(vllm_dir)
    if found != VLLM_PIN and not force:
        raise PatchError(f"vLLM at {vllm_dir} is {found or 'of unknown version'}; this patch series is written "
                         f"against vllm=={VLLM_PIN} (the pin). Install vllm=={VLLM_PIN} (bash install.sh), or pass "
                         f"--force to try anyway.")
    return found or "unknown"


def _run_patch(stage: Path, patch: Patch, reverse: bool, dry_run: bool) -> tuple[bool, str]:
    # --force: take --reverse literally (--batch would guess and flip the direction of a reversed-looking patch)
    cmd = ["patch", "-p1", "-d", str(stage), "--force", "--fuzz=0", "--no-backup-if-mismatch",
           "--reject-file=-", "-i", str(patch.path)]
    cmd.append("--reverse" if reverse else "--forward")
    if dry_run:
        cmd.append("--dry-run")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise PatchError("GNU patch is required (apt-get install patch)") from exc
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _failure_summary(output: str) -> str:
    """The lines of `patch` output that name the file and the hunk that did not apply."""
    keep = [line for line in output.splitlines()
            if line.startswith(("patching file", "checking file")) or "FAILED" in line or "can't find" in line
            or "Reversed" in line or "malformed" in line.lower() or "Only garbage" in line]
    lines: list[str] = []
    for i, line in enumerate(keep):  # drop "patching file X" lines with no failure under them
        nxt = keep[i + 1] if i + 1 < len(keep) else ""
        if line.startswith(("patching file", "checking file")) and (not nxt or nxt.startswith(("patching", "checking"))):
            continue
        lines.append(line)
    return "\n".join(lines) or output


class Stage:
    """A scratch copy of the files a series touches, laid out like the vLLM package."""

    def __init__(self, vllm_dir: Path, files: list[str]):
        self.vllm_dir = vllm_dir
        self.files = files
        self.dir = Path(tempfile.mkdtemp(prefix="qs-patch-stage-"))
        for rel in files:
            src = vllm_dir / rel
            if src.is_file():
                dst = self.dir / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)

    def snapshot(self) -> dict[str, bytes | None]:
        return {rel: (self.dir / rel).read_bytes() if (self.dir / rel).is_file() else None for rel in self.files}

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def series_files(patches: list[Patch]) -> list[str]:
    """Every file the series touches, each once, in the order the patches first touch them."""
    files: list[str] = []
    for patch in patches:
        files += [f for f in patch.files if f not in files]
    return files


def _evaluate(stage: Stage, patches: list[Patch]) -> tuple[SeriesState, dict[str, bytes | None]]:
    """Find each patch's state. Leaves the stage fully applied where possible; returns the base snapshot.

    Reverse pass, last to first: a patch whose reverse goes through is applied; undoing it there gives the
    base tree. Forward pass over the base, in order: every patch must go through, or it conflicts.
    """
    applied = set()
    for patch in reversed(patches):
        ok, _ = _run_patch(stage.dir, patch, reverse=True, dry_run=True)
        if ok:
            _run_patch(stage.dir, patch, reverse=True, dry_run=False)
            applied.add(patch.name)
    base = stage.snapshot()
    result = SeriesState({})
    for patch in patches:
        ok, output = _run_patch(stage.dir, patch, reverse=False, dry_run=True)
        if ok:
            _run_patch(stage.dir, patch, reverse=False, dry_run=False)
            result.states[patch.name] = State.APPLIED if patch.name in applied else State.NOT_APPLIED
        else:
            result.states[patch.name] = State.CONFLICTING
            result.failures[patch.name] = _failure_summary(output)
    return result, base


def _write_back(vllm_dir: Path, wanted: dict[str, bytes | None]) -> list[str]:
    """Make the tree hold `wanted`; restores every file if any write fails."""
    originals: dict[str, bytes | None] = {}
    changed: list[str] = []
    try:
        for rel, content in wanted.items():
            target = vllm_dir / rel
            current = target.read_bytes() if target.is_file() else None
            if current == content:
                continue
            originals[rel] = current
            if content is None:
                target.unlink()
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.qs-tmp")
                tmp.write_bytes(content)
                if target.exists():
                    shutil.copymode(target, tmp)
                os.replace(tmp, target)
            changed.append(rel)
    except BaseException:
        for rel, content in originals.items():
            target = vllm_dir / rel
            if content is None:
                target.unlink(missing_ok=True)
            else:
                target.write_bytes(content)
        raise
    return changed


@contextlib.contextmanager
def _evaluated(vllm_dir: Path, patches: list[Patch]):
    """Stage the series' files, evaluate every patch; yields (stage fully applied, states, base snapshot)."""
    stage = Stage(vllm_dir, series_files(patches))
    try:
        result, base = _evaluate(stage, patches)
        yield stage, result, base
    finally:
        stage.close()


def _names(patches: list[Patch], result: SeriesState, state: State) -> list[str]:
    return [p.name for p in patches if result.states[p.name] is state]


def evaluate(vllm_dir: Path, patches: list[Patch]) -> SeriesState:
    with _evaluated(vllm_dir, patches) as (_, result, _):
        return result


def apply(vllm_dir: Path, patches: list[Patch]) -> str:
    with _evaluated(vllm_dir, patches) as (stage, result, _):
        conflicts = _names(patches, result, State.CONFLICTING)
        if conflicts:
            details = "\n".join(f"  {name}:\n    " + result.failures[name].replace("\n", "\n    ") for name in conflicts)
            raise PatchError(f"cannot apply the series to {vllm_dir}: {len(conflicts)} patch(es) do not apply; "
                             f"nothing was changed.\n{details}")
        todo = _names(patches, result, State.NOT_APPLIED)
        if not todo:
            return f"series already applied ({len(patches)} patches); nothing to do"
        changed = _write_back(vllm_dir, stage.snapshot())
        return f"applied {len(todo)} patch(es) ({', '.join(todo)}); {len(changed)} file(s) changed in {vllm_dir}"


def revert(vllm_dir: Path, patches: list[Patch]) -> str:
    with _evaluated(vllm_dir, patches) as (_, result, base):
        conflicts = _names(patches, result, State.CONFLICTING)
        if conflicts:
            raise PatchError(f"cannot revert: {', '.join(conflicts)} conflict with the tree at {vllm_dir}; "
                             "nothing was changed (reinstall vllm to get a pristine tree)")
        applied = _names(patches, result, State.APPLIED)
        if not applied:
            return "series not applied; nothing to revert"
        changed = _write_back(vllm_dir, base)
        return f"reverted {len(applied)} patch(es) in reverse order; {len(changed)} file(s) restored in {vllm_dir}"


def format_table(patches: list[Patch]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| # | patch | " + " | ".join(f.lower() for f in HEADER_FIELDS) + " |",
            "|---|---|" + "---|" * len(HEADER_FIELDS)]
    for i, patch in enumerate(patches, 1):
        rows.append(f"| {i} | `{patch.name}` | " + " | ".join(cell(patch.header[f]) for f in HEADER_FIELDS) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen_serving.patchset", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["list", "apply", "verify", "revert"])
    parser.add_argument("--vllm-dir", type=Path, help="the vllm package folder (default: the installed one)")
    parser.add_argument("--series", type=Path, default=DEFAULT_SERIES, help=f"series file (default {DEFAULT_SERIES})")
    parser.add_argument("--force", action="store_true", help=f"work on a vLLM other than {VLLM_PIN}")
    args = parser.parse_args(argv)
    try:
        patches = read_series(args.series)
        if args.command == "list":
            print(format_table(patches) if patches else "the series is empty")
            return 0
        vllm_dir = (args.vllm_dir or default_vllm_dir()).resolve()
        if not (vllm_dir / "__init__.py").is_file():
            raise PatchError(f"{vllm_dir} is not a vllm package folder (no __init__.py)")
        check_version(vllm_dir, args.force)
        if args.command == "apply":
            print(apply(vllm_dir, patches))
        elif args.command == "revert":
            print(revert(vllm_dir, patches))
        else:
            result = evaluate(vllm_dir, patches)
            width = max((len(p.name) for p in patches), default=0)
            for patch in patches:
                state = result.states[patch.name]
                print(f"{patch.name:<{width}}  {state.value}")
                if state is State.CONFLICTING:
                    print("    " + result.failures[patch.name].replace("\n", "\n    "))
            ok = all(s is State.APPLIED for s in result.states.values())
            print(f"{'OK' if ok else 'NOT OK'}: {sum(s is State.APPLIED for s in result.states.values())}/"
                  f"{len(patches)} patches applied in {vllm_dir}")
            return 0 if ok else 1
    except PatchError as exc:
        print(f"patchset: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
