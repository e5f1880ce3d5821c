"""Where a vLLM server's engine core spends its host time: py-spy samples of the engine-core process while it
decodes, summarized by function (issue #17: the visit-9 profile found our MTP k=4 step waiting on the host for
4.6 ms a step, and a torch trace cannot name the Python that does it).

    python -m bench.host_profile SPEEDSCOPE.json [--top N]   # the summary of a recorded profile, as JSON

bench/gpu/scripted_mtp.py records one per MTP server of its first wave (`py-spy record --format speedscope`,
py-spy from tests/gpu/stage-extra.sh); the summary goes into the run's JSON, the profile beside the traces.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ENGINE_CORE = "EngineCore"  # vLLM 0.28.0 titles its engine-core process VLLM::EngineCore_DP0
PYSPY_RATE = 250  # samples per second: a 15 ms step gets ~4


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The direct children of `pid` (every thread's children file)."""
    out = []
    for task in sorted((proc / str(pid) / "task").glob("*")):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def engine_core_pid(root: int, proc: Path = Path("/proc")) -> int | None:
    """The engine-core process under a `vllm serve` process: the first descendant whose command line names it."""
    todo = children(root, proc)
    while todo:
        pid = todo.pop(0)
        try:
            cmdline = (proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if ENGINE_CORE in cmdline:
            return pid
        todo += children(pid, proc)
    return None


def pyspy_binary(search: list[str] | None = None) -> str | None:
    """py-spy on PATH, or in the bin/ of a sys.path entry (pip --target puts it in /tmp/site/bin on the device)."""
    found = shutil.which("py-spy")
    if found:
        return found
    for entry in search if search is not None else sys.path:
        candidate = Path(entry or ".") / "bin" / "py-spy"
        if candidate.is_file():
            return str(candidate)
    return None


def record_command(binary: str, pid: int, seconds: float, out: Path, rate: int = PYSPY_RATE) -> list[str]:
    return [binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
            "--format", "speedscope", "--output", str(out), "--nonblocking"]


def summarize(doc: dict, top: int = 25) -> dict:
    """Per function (name, file:line), its share of all samples on top of the stack (self) and anywhere in it
    (inclusive), over every thread's profile of a speedscope document; the `top` largest of each."""
    labels = [f"{f['name']} ({Path(f['file']).name}:{f['line']})" if f.get("file") else f["name"]
              for f in doc["shared"]["frames"]]

    self_w: Counter[str] = Counter()
    incl_w: Counter[str] = Counter()
    total = 0.0
    threads = []
    for prof in doc["profiles"]:
        weights = prof.get("weights") or [1] * len(prof["samples"])
        threads.append({"name": prof.get("name", ""), "samples": len(prof["samples"])})
        for stack, w in zip(prof["samples"], weights, strict=True):
            total += w
            if stack:
                self_w[labels[stack[-1]]] += w
            for name in {labels[i] for i in stack}:
                incl_w[name] += w

    def share(c: Counter[str]) -> list[dict]:
        return [{"function": name, "share": round(w / total, 4)} for name, w in c.most_common(top)] if total else []

    return {"samples": total, "threads": threads, "self": share(self_w), "inclusive": share(incl_w)}


def record_while(binary: str, pid: int, seconds: float, out: Path, work) -> dict:
    """py-spy on `pid` for `seconds` while `work()` runs (called until py-spy is done); its summary, or why not."""
    proc = subprocess.Popen(record_command(binary, pid, seconds, out), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    rounds = 0
    while proc.poll() is None:
        work()
        rounds += 1
    output = proc.communicate()[0][-2000:]
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"py-spy exit {proc.returncode}: {output}", "rounds": rounds}
    return {"profile": out.name, "seconds": seconds, "rate": PYSPY_RATE, "rounds": rounds,
            **summarize(json.loads(out.read_text()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, help="a py-spy speedscope JSON")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(json.dumps(summarize(json.loads(args.profile.read_text()), args.top), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
