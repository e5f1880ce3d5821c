"""All-or-nothing changes to a model directory.

A step never writes inside the live model directory. It builds the complete next state in a
staging directory beside it (same filesystem): unchanged files are hard links, changed files are
written new and fsynced. Then one `renameat2(RENAME_EXCHANGE)` swaps the two directories
atomically, and the old tree (now at the staging path) is deleted. Killed at any moment, the model
directory is either entirely the old state or entirely the new one; the next run, of any step,
removes the leftover staging tree first.

Where the filesystem cannot exchange (EINVAL/ENOTSUP), the swap is two renames with a marker:
model -> .old, staging -> model. A crash between them leaves no model directory for a moment;
`recover` finishes the swap (marker present) or rolls it back (marker absent) on the next run.
A lock file beside the model directory keeps two steps from interleaving.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

RENAME_EXCHANGE = 2
COMMIT_MARKER = ".prepare-complete"


def _sibling(model: Path, tag: str) -> Path:
    return model.parent / f".{model.name}.{tag}"


def staging_path(model: Path) -> Path:
    return _sibling(model, "prepare-staging")


def old_path(model: Path) -> Path:
    return _sibling(model, "prepare-old")


def leftovers(model: Path) -> list[Path]:
    return [p for p in (staging_path(model), old_path(model)) if p.exists() or p.is_symlink()]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the filesystem or kernel cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2 exchange {a} <-> {b}: {os.strerror(err)}")


def remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def recover(model: Path) -> list[str]:
    """Bring a model directory back to a committed state after an interrupted step."""
    done: list[str] = []
    staging, old = staging_path(model), old_path(model)
    if not model.exists() and old.exists():
        if (staging / COMMIT_MARKER).exists():
            os.rename(staging, model)  # the fallback swap had been decided: finish it
            done.append("finished an interrupted commit")
        else:
            os.rename(old, model)
            done.append("rolled back an interrupted commit")
        fsync_dir(model.parent)
    (model / COMMIT_MARKER).unlink(missing_ok=True)
    for leftover in (staging, old):
        if leftover.exists() or leftover.is_symlink():
            remove_tree(leftover)
            done.append(f"removed leftover {leftover.name}")
    return done


@contextmanager
def locked(model: Path) -> Iterator[None]:
    lock_path = _sibling(model, "prepare.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise RuntimeError(f"another prepare step is running on {model} (lock {lock_path})") from e
        yield
    finally:
        os.close(fd)


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # follows a symlink (HF cache layout) to the real file
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        shutil.copy2(src, dst)


def stage_tree(model: Path, staging: Path, replaced: set[str]) -> None:
    """Recreate `model` under `staging` as hard links, leaving out the relative paths in `replaced`."""
    staging.mkdir()
    shutil.copymode(model, staging)
    for root, dirs, files in os.walk(model):
        rel_root = Path(root).relative_to(model)
        for d in dirs:
            (staging / rel_root / d).mkdir()
        for name in files:
            rel = (rel_root / name).as_posix()
            if rel in replaced or rel == COMMIT_MARKER:
                continue
            link_or_copy(Path(root) / name, staging / rel)


def commit(model: Path, staging: Path) -> None:
    """Make `staging` the model directory, atomically, and drop the previous tree."""
    for root, _dirs, _files in os.walk(staging):
        fsync_dir(Path(root))
    if exchange_paths(staging, model):
        fsync_dir(model.parent)
    else:
        old = old_path(model)
        (staging / COMMIT_MARKER).touch()
        fsync_dir(staging)
        os.rename(model, old)
        os.rename(staging, model)
        fsync_dir(model.parent)
        (model / COMMIT_MARKER).unlink()
        staging = old
    remove_tree(staging)


def create(target: Path, staging: Path) -> None:
    """Make `staging` the new directory `target` (which must not exist) in one rename."""
    for root, _dirs, _files in os.walk(staging):
        fsync_dir(Path(root))
    os.rename(staging, target)  # fails, leaving staging for recover(), if target appeared meanwhile
    fsync_dir(target.parent)
