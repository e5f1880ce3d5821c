"""Repeated harness runs, for figures that must come with their spread (the harness in bench/harness.py measures;
this file only decides what to run again and how the runs agree):

    python -m bench.repeats real-rep TAG N [TEMPERATURE] [--url URL]      # bench/real_rep.sh
    python -m bench.repeats prefill-ab TAG --a-url URL [--a-cmd CMD] --b-url URL [--b-cmd CMD]   # bench/prefill_ab.sh

- **real-rep**: the single-stream C1 row of `run_benchmarks.sh single` (the 8 real prompts, 1,024-token answers,
  an unmeasured warm-up before each run, its own seed and cache salt) N times against one server; mean, sample
  standard deviation, min, max and relative spread ((max - min) / mean) of the decode rate, tokens per step and
  ms per step. TEMPERATURE 0 = greedy (default: the model's own sampling).
- **prefill-ab**: two arms (two running servers, or two server commands started one at a time on one GPU), the
  harness's prefill measurement (3 single requests of fresh random tokens, 1-token answers) at each length.
  Rounds alternate the arms' order (A B, then B A, ...) so a drift over the session (clocks, heat) reaches both
  alike; a length is measured again, in both arms, until each arm's last two measurements agree within the
  tolerance (relative to their mean), or the rounds run out (then it is reported as not reproduced, exit 1).

Results: `OUT/TAG-real-rep.json`, `OUT/TAG-prefill-ab.json`, rewritten atomically after every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import harness, serving  # noqa: E402
from bench import report as br  # noqa: E402

SCHEMA = "qwen-serving repeats/1"
REAL_REP_FIGURES = ("decode_tok_s", "tokens_per_step", "ms_per_step", "e2e_output_tok_s")
DEFAULT_TOLERANCE = 0.005  # prefill rates reproduce to ~0.1% on an idle card (the spec's 3090 figure)
DEFAULT_MAX_ROUNDS = 6
BOOT_TIMEOUT_S = 1200


def spread(values: Sequence[float]) -> dict:
    """Mean, sample standard deviation (0 for one value), min, max and (max - min) / mean."""
    if not values:
        raise ValueError("no values")
    mean = statistics.fmean(values)
    return {"n": len(values), "mean": mean, "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "relative_spread": (max(values) - min(values)) / mean}


def reproduces(values: Sequence[float], tolerance: float) -> bool:
    """The last two measurements agree within `tolerance` of their mean."""
    if len(values) < 2:
        return False
    a, b = values[-2], values[-1]
    return abs(a - b) <= tolerance * (a + b) / 2


def arm_order(round_index: int, arms: Sequence[str] = ("A", "B")) -> list[str]:
    """A B in even rounds, B A in odd ones: each arm goes first as often as the other."""
    return list(arms) if round_index % 2 == 0 else list(reversed(arms))


@dataclass
class Interleaved:
    """Measurements of two arms over conditions, measured in rounds until every condition reproduces in both."""

    conditions: list[str]
    tolerance: float = DEFAULT_TOLERANCE
    arms: tuple[str, str] = ("A", "B")
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    rounds: int = 0

    def __post_init__(self):
        for arm in self.arms:
            self.values.setdefault(arm, {c: [] for c in self.conditions})

    def done(self, condition: str) -> bool:
        return all(reproduces(self.values[arm][condition], self.tolerance) for arm in self.arms)

    def pending(self) -> list[str]:
        # a condition stays in both arms until both reproduce, so neither arm's pair comes from an earlier session
        return [c for c in self.conditions if not self.done(c)]

    def run(self, measure: Callable[[str, str], float], session: Callable[[str], contextlib.AbstractContextManager],
            max_rounds: int, on_value: Callable[[], None] = lambda: None) -> bool:
        """measure(arm, condition) -> value, inside session(arm) (e.g. that arm's server up); True when every
        condition reproduced."""
        while self.pending() and self.rounds < max_rounds:
            for arm in arm_order(self.rounds, self.arms):
                todo = self.pending()
                if not todo:  # the other arm's turn finished the last condition: boot nothing more
                    break
                with session(arm):
                    for condition in todo:
                        self.values[arm][condition].append(measure(arm, condition))
                        on_value()
            self.rounds += 1
        return not self.pending()

    def summary(self) -> dict:
        out = {}
        for c in self.conditions:
            row = {}
            for arm in self.arms:
                vals = self.values[arm][c]
                row[arm] = {"values": vals, "reproduced": reproduces(vals, self.tolerance),
                            "value": statistics.fmean(vals[-2:]) if vals else None}
            a, b = (row[arm]["value"] for arm in self.arms)
            row["b_vs_a"] = b / a - 1 if a and b is not None else None
            row["reproduced"] = self.done(c)
            out[c] = row
        return out


# ---------------------------------------------------------------------------------------------
# Measuring through the harness


def harness_args(url: str, tag: str, temperature: float | None, extra: Sequence[str] = ()) -> argparse.Namespace:
    """The harness's own option set (its defaults: warm-up on, the real prompts file) for run_one."""
    argv = ["single", "--url", url, "--tag", tag, *extra]
    if temperature is not None:
        argv += ["--temperature", str(temperature)]
    return harness.parse_args(argv)


def c1_run() -> br.RunSpec:
    prompts = [line for line in (REPO / "bench" / "prompts_real.jsonl").read_text().splitlines() if line.strip()]
    return br.plan_runs("single", cohorts=(1,), prompts_in_file=len(prompts))[0]


def prefill_run(length: int) -> br.RunSpec:
    runs = br.plan_runs("batch", prefill=True, cohorts=(1,))
    spec = next(r for r in runs if r.section == "prefill")
    return br.RunSpec(f"prefill-{length}", spec.section, spec.concurrency, spec.dataset, spec.num_prompts,
                      spec.output_len, length)


@dataclass
class Arm:
    name: str
    url: str
    command: str | None = None
    server: serving.ServerProcess | None = None


@contextlib.contextmanager
def arm_session(arm: Arm, log_dir: Path, boot_timeout_s: float) -> Iterator[None]:
    """The arm's server for one round: started from its command (and stopped after), or already running."""
    if arm.command is None:
        yield
        return
    port = urllib.parse.urlsplit(arm.url).port
    arm.server = serving.ServerProcess(f"arm {arm.name}", ["bash", "-c", arm.command], port,
                                       log_dir / f"arm-{arm.name}-{time.strftime('%H%M%S')}.log")
    arm.server.launch()
    try:
        arm.server.wait_healthy(boot_timeout_s)
        yield
    finally:
        arm.server.stop()


def _write(path: Path, tag: str, kind: str, machine: dict, body: dict) -> None:
    serving.write_json_atomic(path, {"schema": SCHEMA, "kind": kind, "tag": tag, "machine": machine, **body})


def real_rep(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="real_rep.sh", description="N repeats of the single-stream C1 row.")
    p.add_argument("tag")
    p.add_argument("repeats", type=int)
    p.add_argument("temperature", type=float, nargs="?", help="0 = greedy (default: the model's own sampling)")
    p.add_argument("--url", default="http://127.0.0.1:18020")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--api-key")
    p.add_argument("--harness-arg", action="append", default=[],
                   help="passed to the harness (e.g. --harness-arg=--ignore-eos)")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("N must be >= 2 (a spread needs two runs)")
    path = args.out / f"{args.tag}-real-rep.json"
    hargs = harness_args(args.url, args.tag, args.temperature, args.harness_arg)
    key = serving.api_key(args.api_key)
    try:
        server = harness.server_facts(hargs.url, key)
    except (OSError, ValueError, KeyError, IndexError) as err:
        print(f"real_rep: no usable vLLM server at {args.url}: {err}", file=sys.stderr)
        return 3
    machine, run, seed = harness.machine_facts(), c1_run(), int(time.time()) % 2**31
    repeats: list[dict] = []
    body = {"server": server, "temperature": args.temperature, "base_seed": seed, "repeats": repeats,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qs-rep-") as workdir:
        for i in range(args.repeats):
            fig = harness.run_one(run, hargs, hargs.url, key, seed + i, workdir)
            repeats.append(fig)
            body["summary"] = {k: spread([r[k] for r in repeats]) for k in REAL_REP_FIGURES}
            _write(path, args.tag, "real-rep", machine, body)
            print(f"[{i + 1}/{args.repeats}] C1 {fig['decode_tok_s']:.1f} decode tok/s, "
                  f"{fig['tokens_per_step']:.2f} tokens/step", flush=True)
    print(real_rep_table(body["summary"]))
    print(f"wrote {path}")
    return 0


def real_rep_table(summary: dict) -> str:
    lines = ["| C1 | mean | stdev | min | max | spread |", "|---|---|---|---|---|---|"]
    for k, s in summary.items():
        lines.append(f"| {k} | {s['mean']:.2f} | {s['stdev']:.2f} | {s['min']:.2f} | {s['max']:.2f} | "
                     f"{s['relative_spread']:.1%} |")
    return "\n".join(lines)


def prefill_ab(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="prefill_ab.sh", description="Prefill A/B: two arms, interleaved, each length "
                                "repeated until it reproduces within the tolerance.")
    p.add_argument("tag")
    for arm in ("a", "b"):
        p.add_argument(f"--{arm}-url", required=True, help=f"where arm {arm.upper()}'s server answers")
        p.add_argument(f"--{arm}-cmd", help=f"a shell command that starts arm {arm.upper()}'s server (started and "
                       "stopped once per round; leave out when the server is already running)")
    p.add_argument("--lens", default=",".join(map(str, br.PREFILL_LENS)), help="prompt lengths (default %(default)s)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="relative (default %(default)s)")
    p.add_argument("--max-rounds", type=int, default=DEFAULT_MAX_ROUNDS)
    p.add_argument("--boot-timeout", type=float, default=BOOT_TIMEOUT_S)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--api-key")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lens.split(",")]
    except ValueError:
        p.error(f"--lens {args.lens!r}: comma-separated integers please")
    if args.tolerance <= 0 or args.max_rounds < 2:
        p.error("--tolerance must be > 0 and --max-rounds >= 2 (a reproduction needs two measurements)")
    arms = {"A": Arm("A", args.a_url.rstrip("/"), args.a_cmd), "B": Arm("B", args.b_url.rstrip("/"), args.b_cmd)}
    for arm in arms.values():
        if arm.command is not None and urllib.parse.urlsplit(arm.url).port is None:
            p.error(f"--{arm.name.lower()}-url {arm.url}: a server started from a command needs an explicit port")
    key = serving.api_key(args.api_key)
    path = args.out / f"{args.tag}-prefill-ab.json"
    args.out.mkdir(parents=True, exist_ok=True)
    machine, seed = harness.machine_facts(), int(time.time()) % 2**31
    state = Interleaved([f"prefill-{n}" for n in lengths], args.tolerance)
    servers: dict[str, dict] = {}
    counter = iter(range(10**9))

    def measure(arm: str, condition: str) -> float:
        if arm not in servers:
            servers[arm] = harness.server_facts(arms[arm].url, key)
        hargs = harness_args(arms[arm].url, f"{args.tag}-{arm}", None)
        with tempfile.TemporaryDirectory(prefix="qs-ab-") as workdir:
            fig = harness.run_one(prefill_run(int(condition.split("-")[1])), hargs, arms[arm].url, key,
                                  seed + next(counter), workdir)
        print(f"round {state.rounds + 1} arm {arm} {condition}: {fig['prefill_tok_s']:.1f} tok/s", flush=True)
        return fig["prefill_tok_s"]

    def save() -> None:
        _write(path, args.tag, "prefill-ab", machine, {
            "arms": {a.name: {"url": a.url, "command": a.command, "server": servers.get(a.name)} for a in arms.values()},
            "tolerance": args.tolerance, "rounds": state.rounds, "base_seed": seed, "conditions": state.summary()})

    try:
        ok = state.run(measure, lambda arm: arm_session(arms[arm], args.out, args.boot_timeout), args.max_rounds, save)
    except (OSError, RuntimeError, ValueError, KeyError) as err:  # a server that does not boot or answer
        save()
        print(f"prefill_ab: {err}", file=sys.stderr)
        return 3
    save()
    print(prefill_ab_table(state.summary(), args.tolerance))
    print(f"wrote {path}")
    return 0 if ok else 1


def prefill_ab_table(summary: dict, tolerance: float) -> str:
    lines = [f"| prefill | A tok/s | B tok/s | B vs A | reproduced within {tolerance:.1%} |", "|---|---|---|---|---|"]
    for c, row in summary.items():
        a, b = row["A"]["value"], row["B"]["value"]
        diff = f"{row['b_vs_a']:+.1%}" if row["b_vs_a"] is not None else "-"
        lines.append(f"| {c} | {a or 0:.1f} | {b or 0:.1f} | {diff} | {'yes' if row['reproduced'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"real-rep": real_rep, "prefill-ab": prefill_ab}
    if not argv or argv[0] not in commands:
        print(f"usage: python -m bench.repeats {{{','.join(commands)}}} ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
