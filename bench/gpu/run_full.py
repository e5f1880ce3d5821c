"""The full-shape GPU flow (bench/gpu/README.md): generate the random-weight 27B checkpoint, start one server
per config (all at once: they share the GPU while they boot), then, with nothing else on the GPU, measure the
configs one after the other (bench.fullbench lists what each runs), stop each server after its
measurements, and merge its figures into OUT/h200-full-<config>.json. Progress goes to stdout; run it detached.

    python bench/gpu/run_full.py OUT CONFIG [CONFIG ...] [--patched-site DIR] [--before-measure CMD]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import fullbench as fb  # noqa: E402
from bench import serving  # noqa: E402
from bench.serving import write_json_atomic  # noqa: E402
from qwen_serving import memory, plan  # noqa: E402

RUN_TIMEOUT_S = 1200
# Servers booted side by side, packed by a GPU memory estimate (GiB): beyond each one's weights and pool, the memory
# model's CUDA-graph allowance (1.2; the servers measured 0.11-0.39 where no other server allocated during their
# capture: vLLM's figure is a free-memory difference of the whole GPU), its 2 GiB activation peak and 1 GiB of CUDA
# context and allocator slack
GiB = memory.GiB
GRAPHS_GIB = memory.CUDAGRAPH_BYTES / GiB
OVERHEAD_GIB = memory.ACTIVATION_PEAK_BYTES / GiB + 1.0
BOUND_GIB = 130.0  # of the H200's 140.4 GiB: visit 10 read 111 GiB in use with four 27B servers beside the smoke servers
CARD_HEADROOM_GIB = 10.4  # what BOUND_GIB leaves of the H200, kept on any card
Item = TypeVar("Item")


def first_fit(items: Sequence[Item], need: Callable[[Item], float], bound: float = BOUND_GIB) -> list[list[Item]]:
    """First fit in priority order: each item in the earliest wave its estimate fits into (so an item never
    displaces one before it); an item larger than the bound alone is its own wave."""
    waves: list[list[Item]] = []
    used: list[float] = []
    for item in items:
        gib = need(item)
        for i in range(len(waves)):
            if used[i] + gib <= bound:
                waves[i].append(item)
                used[i] += gib
                break
        else:
            waves.append([item])
            used.append(gib)
    return waves


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Server(serving.ServerProcess):
    """One config's server, with where it stands: new -> starting -> up | died | timeout -> stopped."""

    def __init__(self, cfg: fb.BenchConfig, cmd: fb.ServerCommand, port: int, pythonpath: str, log_path: Path):
        # the repo last: a patched vLLM imports qwen_serving.engine as soon as vllm.envs loads (patches/env-vars.patch)
        env = {**os.environ, **cmd.env, "PYTHONPATH": os.pathsep.join([pythonpath, str(REPO)])}
        super().__init__(cfg.name, cmd.argv, port, log_path, env=env)
        self.cfg, self.cmd, self.pythonpath = cfg, cmd, pythonpath
        self.state = "new"

    def start(self) -> None:
        self.launch()
        self.state = "starting"

    def poll(self) -> str:
        if self.state == "starting":
            if self.healthy():
                self.state = "up"
            elif self.exit_code() is not None:
                self.state = "died"
        return self.state

    def stop(self, grace_s: float = 60) -> None:
        super().stop(grace_s)
        if self.state in ("starting", "up"):
            self.state = "stopped"


def device_copy_gbps(python: str, pythonpath: str) -> float | None:
    """Measured before any server holds the GPU (step_profile.py would otherwise need 2 GB beside them)."""
    code = "import step_profile; g = step_profile.device_copy_gbps(); print(g if g else '')"
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=REPO / "bench",
                         env={**os.environ, "PYTHONPATH": pythonpath}, timeout=300)
    try:
        return float(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        log(f"device copy bandwidth not measured: {res.stderr.strip()[-300:]}")
        return None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("configs", nargs="+", metavar="CONFIG", help=f"of: {', '.join(fb.CONFIGS)}")
    p.add_argument("--site", type=Path, default=Path("/tmp/site"), help="the staged stock stack (default %(default)s)")
    p.add_argument("--patched-site", type=Path, help="a folder holding the patched vllm package (patched* configs)")
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/qwen-full"), help="generated here if missing")
    p.add_argument("--base-port", type=int, default=18020, help="config i listens on base + i")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--before-measure", help="shell command run (and waited for) once the servers are up, before "
                                             "the first measurement: e.g. wait for other GPU work to end")
    p.add_argument("--start-timeout", type=float, default=1200.0, help="seconds for all servers to come up")
    p.add_argument("--dry-run", action="store_true", help="print every command, start nothing")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in fb.CONFIGS]
    if unknown:
        p.error(f"unknown config {unknown[0]!r} (one of {', '.join(fb.CONFIGS)})")
    if len(set(args.configs)) != len(args.configs):
        p.error("a config is named twice")
    alone = [c for c in args.configs if not fb.CONFIGS[c].shared_start]
    if alone and len(args.configs) > 1:
        p.error(f"{alone[0]} boots with vLLM's memory profiling, which servers beside it would upset: run it alone")
    if any(fb.CONFIGS[c].patched for c in args.configs):
        if not args.patched_site:
            p.error("patched configs need --patched-site (a folder holding the patched vllm package)")
        if not args.dry_run and not (args.patched_site / "vllm" / "__init__.py").is_file():
            p.error(f"--patched-site {args.patched_site}: no vllm package there")
    return args


def build_servers(args: argparse.Namespace, out: Path) -> list[Server]:
    servers = []
    for i, name in enumerate(args.configs):
        cfg = fb.CONFIGS[name]
        paths = [str(args.patched_site), str(args.site)] if cfg.patched else [str(args.site)]
        probe = plan.Probe.detect(REPO)  # the plan's vLLM facts are vllm_028's, whichever vllm the server runs
        traces = out / f"traces-{name}"
        port = args.base_port + i
        cmd = fb.server_command(cfg, python=args.python, ckpt=args.ckpt, port=port, traces=traces, probe=probe)
        servers.append(Server(cfg, cmd, port, os.pathsep.join(paths), out / f"h200-full-{name}.server.log"))
    return servers


def wait_until_up(servers: list[Server], timeout_s: float) -> None:
    t0, last = time.time(), 0.0
    while any(s.poll() == "starting" for s in servers):
        if time.time() - t0 > timeout_s:
            for s in servers:
                if s.state == "starting":
                    s.state = "timeout"
                    s.stop()
            break
        if time.time() - last >= 30:
            last = time.time()
            log("servers: " + ", ".join(f"{s.cfg.name} {s.state}" for s in servers) + f" ({time.time() - t0:.0f} s)")
        time.sleep(5)
    log("servers: " + ", ".join(f"{s.cfg.name} {s.state}" for s in servers) + f" ({time.time() - t0:.0f} s)")


def gpu_state() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi not available"


def bound_gib(query=subprocess.run) -> float:
    """BOUND_GIB on the H200; on a smaller card (the device may lend an H100, 79.6 GiB) its total memory less the
    same headroom, so that a wave packed for the H200 does not boot out of memory there. BOUND_GIB where
    nvidia-smi does not answer."""
    try:
        out = query(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=30).stdout.split()
        total_gib = int(out[0]) / 1024
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return BOUND_GIB
    return round(min(BOUND_GIB, total_gib - CARD_HEADROOM_GIB), 1)


def gpu_mib_by_pid(query=subprocess.run) -> dict[int, int]:
    """GPU memory each process holds (nvidia-smi's compute apps), MiB by PID; empty where nvidia-smi lists none.
    Unlike vLLM's own graph figure (the device's free memory before and after) a process's figure is its own,
    whatever boots beside it."""
    try:
        out = query(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                    capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    held: dict[int, int] = {}
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            held[int(pid)] = held.get(int(pid), 0) + int(mib)
    return held


def server_gpu_mib(pids: Collection[int], held: Mapping[int, int]) -> int | None:
    """What a server's processes (API server, engine core) hold on the GPU; None when none of them is listed
    (nvidia-smi in a container may list host PIDs)."""
    mine = [held[pid] for pid in pids if pid in held]
    return sum(mine) if mine else None


def measure(server: Server, args: argparse.Namespace, out: Path, gbps: float | None) -> dict:
    cfg = server.cfg
    log(f"{cfg.name}: GPU before measuring (utilization, memory used): {gpu_state()}")
    traces = out / f"traces-{cfg.name}"
    url = f"http://127.0.0.1:{server.port}"
    runs = fb.runs_for(cfg, python=args.python, repo=REPO, url=url, out=out, ckpt=args.ckpt, traces=traces)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), server.pythonpath])}
    parts, errors = {}, {}
    for i, run in enumerate(runs):
        argv = list(run.argv) + (["--bandwidth-gbps", str(gbps)] if run.part == "steps" and gbps else [])
        log(f"{cfg.name}: {run.part} ...")
        t0 = time.time()
        with open(out / f"h200-full-{cfg.name}-{run.part}.log", "w") as run_log:
            try:
                rc = subprocess.run(argv, stdout=run_log, stderr=subprocess.STDOUT, env=env,
                                    timeout=RUN_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        report = out / f"h200-full-{cfg.name}-{run.part}.json"
        parts[run.part] = json.loads(report.read_text()) if report.exists() else None
        if rc != 0:
            errors[run.part] = f"exit {rc} (see h200-full-{cfg.name}-{run.part}.log)"
        log(f"{cfg.name}: {run.part} exit {rc} after {time.time() - t0:.0f} s")
        if i + 1 < len(runs):  # a visit that ends here keeps this config's figures so far
            unfinished = {"unfinished": ", ".join(r.part for r in runs[i + 1:])}
            write_json_atomic(out / f"h200-full-{cfg.name}.json",
                              fb.merge(cfg.name, server.cmd.shell(), parts, {**errors, **unfinished}))
    return fb.merge(cfg.name, server.cmd.shell(), parts, errors)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    if args.dry_run:
        servers = build_servers(args, out)
        for s in servers:
            print(f"# {s.cfg.name} (port {s.port}): {s.cfg.what}\nPYTHONPATH={s.pythonpath} {s.cmd.shell()}")
            for run in fb.runs_for(s.cfg, python=args.python, repo=REPO, url=f"http://127.0.0.1:{s.port}", out=out,
                                   ckpt=args.ckpt, traces=out / f"traces-{s.cfg.name}"):
                print(f"  {run.part}: {' '.join(run.argv)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the servers (finally below)
    stock_path = os.pathsep.join([str(REPO), str(args.site)])
    if not (args.ckpt / "config.json").exists():
        log(f"generating the full-shape checkpoint in {args.ckpt}")
        subprocess.run([args.python, "-m", "qwen_serving.checkpoint.synth", "--size", "full", "--out", str(args.ckpt),
                        "--seed", "0"], cwd=REPO, env={**os.environ, "PYTHONPATH": stock_path}, check=True)
    gbps = device_copy_gbps(args.python, stock_path)
    log(f"device copy bandwidth: {gbps} GB/s")
    servers = build_servers(args, out)
    merged_all: dict[str, dict] = {}
    try:
        for s in servers:
            (out / f"h200-full-{s.cfg.name}.serve-cmd.txt").write_text(s.cmd.shell() + "\n")
            for_traces = out / f"traces-{s.cfg.name}"
            for_traces.mkdir(exist_ok=True)
            log(f"{s.cfg.name}: starting on port {s.port} (log {s.log_path.name})")
            s.start()
        wait_until_up(servers, args.start_timeout)
        if args.before_measure:
            log(f"before measuring: {args.before_measure}")
            subprocess.run(["bash", "-c", args.before_measure], check=False)
        for s in servers:
            if s.state != "up":
                merged = fb.merge(s.cfg.name, s.cmd.shell(), {}, {"server": f"{s.state} (see {s.log_path.name})"})
            else:
                merged = measure(s, args, out, gbps)
                s.stop()
            merged_all[s.cfg.name] = merged
            write_json_atomic(out / f"h200-full-{s.cfg.name}.json", merged)
            log(f"{s.cfg.name}: wrote h200-full-{s.cfg.name}.json (errors: {merged['errors'] or 'none'})")
    finally:
        for s in servers:
            s.stop()
    failed = [name for name, m in merged_all.items() if m["errors"]]
    log(f"done: {out}" + (f"; with errors: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
